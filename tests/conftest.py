"""Shared fixtures: real 2-rank ZeRO-3 runs on CPU, made once per session and reused."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.run.launch import RunResult, launch

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
