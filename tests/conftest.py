"""Shared fixtures: real 2-rank ZeRO-3 runs on CPU, made once per session and reused."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import psutil
import pytest

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.run.launch import RunResult, free_port, launch

STEPS, SAVE_EVERY, RESUME_STEP = 150, 50, 50


@pytest.fixture(scope="session")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The default tiny job on 2 CPU ranks, saving every 50 steps."""
    out = tmp_path_factory.mktemp("full")
    return launch(2, STEPS, out, save_every=SAVE_EVERY, verbose=False, progress=False, timeout=600)


@pytest.fixture(scope="session")
def resumed_run(full_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The same job resumed from the step-50 checkpoint of `full_run`, in a separate folder."""
    dst = copy_checkpoint(full_run.output_dir, tmp_path_factory.mktemp("resumed"),
                                     f"global_step{RESUME_STEP}")
    return launch(2, STEPS, dst, resume=True, save_checkpoint=True, verbose=False, progress=False, timeout=600)


def cli(*args: object) -> subprocess.CompletedProcess:
    """`python -m zckpt_nb ARGS` run in this process, sparing each call an interpreter's start and its imports: exit
    code, stdout and stderr as a subprocess would give them (warnings shown once per place, as a fresh one shows)."""
    from zckpt_nb.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors exit 2
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["python", "-m", "zckpt_nb", *argv], code, out.getvalue(), err.getvalue())


def refused(done: subprocess.CompletedProcess, *words: str, code: int | None = None) -> str:
    """The one line a refused command wrote, after checking its exit (`code`, or any non-zero), that it said one line
    and no traceback, and that the line names `words`."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code if code is not None else done.returncode != 0, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def procs_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (to prove no rank was left behind)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if text in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def file_hashes(output_dir: Path, tag: str) -> dict[str, str]:
    """A committed checkpoint's files and their SHA-256, as its manifest lists them."""
    from zckpt_nb.format.manifest import read_manifest

    return {f.path: f.sha256 for f in read_manifest(output_dir / tag).files}


def torchrun(script: Path, nproc: int, *args: object) -> list[str]:
    """`script ARGS` on `nproc` CPU ranks under torchrun, as a user runs a loop of their own; its output lines."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(free_port()), str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()
