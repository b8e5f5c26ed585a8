"""Notebook 05: what each failed save left on disk, and the sentences and answers computed from it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import MANIFEST, RANK_FILE, committed_tags, latest_name, tag_for, tag_step
from zckpt_nb.format.units import counted
from zckpt_nb.lessons.claims import RESUME_TOLERANCE
from zckpt_nb.run.launch import RunResult

DEFAULT_COLLECTIVE_TIMEOUT = 5.0  # notebook 05's defaults, which its exercises' answers compare against
DEFAULT_KEEP_LAST = 2
DEFAULT_NPROC = 2


def deepspeed_latest_lines() -> str:
    """The end of DeepSpeed's `save_checkpoint`, read from the installed source without importing it: rank 0 writes
    `latest` as soon as its own files are written, and only then does every rank meet at the final barrier."""
    import ast
    from importlib.util import find_spec

    path = Path(find_spec("deepspeed").origin).parent / "runtime" / "engine.py"
    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "save_checkpoint")
    lines = text.splitlines()[node.lineno - 1:node.end_lineno]
    start = next(i for i, line in enumerate(lines) if "Save latest checkpoint tag" in line)
    return "".join(f"{node.lineno + i:5d} {line}\n" for i, line in enumerate(lines[start:], start))


class LineClock:
    """An `on_line` for `launch`: seconds after the launch at which rank 0 printed step `step` (the save follows it)
    and at which any rank printed its first error line."""

    def __init__(self, step: int) -> None:
        self.start, self.step, self.marks = time.monotonic(), f"step {step}/", {}

    def __call__(self, who: str, text: str) -> None:
        if who == "rank 0" and text.startswith(self.step):
            self.marks.setdefault("save", time.monotonic() - self.start)
        elif "save" in self.marks and "error" in text.lower():
            self.marks.setdefault("error", time.monotonic() - self.start)


def hang_answer(seconds: float, clock: LineClock, collective_timeout: float, committed: list[str],
                default: float = DEFAULT_COLLECTIVE_TIMEOUT) -> str:
    """Exercise: how long the rank-0-only save ran, split at the save and the first error, against the timeout, and
    what another timeout would give (the default's, or 15 s when this run is the default)."""
    if "error" not in clock.marks:
        return (f"The job finished in {seconds:.0f} s: with one rank nobody waits for anybody, so the rank-0 guard "
                "cannot hang (and hides the bug until the job runs on two ranks).")
    before, waited = clock.marks["save"], clock.marks["error"] - clock.marks["save"]
    other = 15.0 if collective_timeout == default else default
    return (f"Rank 0 reached the save after {before:.1f} s of start-up and training; the first error line came "
            f"{waited:.1f} s later (collective timeout {collective_timeout:g} s); torchrun had stopped every rank "
            f"{seconds - clock.marks['error']:.1f} s after that: {seconds:.1f} s in all, checkpoints committed: "
            f"{', '.join(committed) or 'none'}. The wait is the timeout, the rest does not depend on it: with "
            f"COLLECTIVE_TIMEOUT = {other:g} expect about {seconds - collective_timeout + other:.0f} s.")


def rotation_sentence(run: RunResult, keep_last: int) -> str:
    """What `--keep_last` kept and deleted in this run, from its files and its record."""
    deleted = [t for s in run.ranks[0]["saves"] for t in s["deleted"]]
    kept = committed_tags(run.output_dir)
    return (f"Rotation (--keep_last {keep_last}) left {', '.join(kept)} and deleted {', '.join(deleted) or 'nothing'}, "
            "each only after a newer save had committed.")


def rotation_answer(run: RunResult, keep_last: int, default: int = DEFAULT_KEEP_LAST) -> str:
    """Exercise: which committed checkpoints `--keep_last` kept, against what the default (or 1, when this run is
    the default) keeps of the same saves."""
    deleted = [t for s in run.ranks[0]["saves"] for t in s["deleted"]]
    kept = committed_tags(run.output_dir)
    every = sorted(set(kept) | set(deleted), key=tag_step)
    other = 1 if keep_last == default else default
    return (f"With --keep_last {keep_last}, {len(kept)} of the {counted(len(every), 'committed checkpoint')} remain "
            f"({', '.join(kept)}) and rotation deleted {', '.join(deleted) or 'nothing'}. Of the same saves, "
            f"--keep_last {other} would keep {', '.join(every[-other:])}: the newest K, never one before a newer "
            "one has committed.")


def resume_sentence(uninterrupted: RunResult, resumed: RunResult, dtype: str) -> str:
    """The crash-and-resume check: where the resume started and how far its losses lie from the uninterrupted run,
    against the tolerance the run's dtype can meet (`claims.RESUME_TOLERANCE`)."""
    by_step = dict(zip(uninterrupted.steps, uninterrupted.losses))
    diff = max(abs(by_step[s] - loss) for s, loss in zip(resumed.steps, resumed.losses))
    tolerance = RESUME_TOLERANCE[dtype]
    how = ("are bit for bit the same as those of the run never killed (the full-disk run)" if diff == 0 else
           f"differ from those of the run never killed (the full-disk run) by at most {diff:.1e}, "
           f"{'within' if diff <= tolerance else 'OUTSIDE'} the {tolerance:.0e} a {dtype} resume can meet")
    return (f"The run killed during its step-8 save resumed from step {resumed.data['resumed_from_step']}, the newest "
            f"committed checkpoint; its losses {how}.")


def log_steps(steps: list[int]) -> list[int]:
    """Steps as the log counts them ("step k" is the k-th update), as every plot of notebook 05 draws them."""
    return [s + 1 for s in steps]


def protocol_share(saves: list[dict[str, Any]]) -> float:
    """The commit protocol's own steps (preflight, agreement, manifest, latest) as a share of the saves' seconds; the
    hash runs beside the write, so it is inside the write's seconds, not added to them."""
    total = sum(t["write"] + t.get("fsync", 0.0) + t.get("protocol", 0.0) for t in (s["timings"] for s in saves))
    return sum(s["timings"].get("protocol", 0.0) for s in saves) / total if total else 0.0


def rank_files(pairs: set[tuple[str, str]]) -> str:
    """(rank, kind) pairs of rank files as 'rank 0 model, rank 1 optim', or 'none'."""
    return ", ".join(f"rank {r} {k}" for r, k in sorted(pairs)) or "none"


def left_behind(ckpt_dir: str | Path, step: int, nproc: int) -> dict[str, Any]:
    """What a save killed at `step` left on disk: where `latest` points, which rank files the step's folder holds and
    lacks, and whether it has a manifest."""
    folder = Path(ckpt_dir) / tag_for(step)
    found = {m.group(1, 2) for p in (folder.iterdir() if folder.is_dir() else []) if (m := RANK_FILE.search(p.name))}
    every = {(str(r), kind) for r in range(nproc) for kind in ("model", "optim")}
    return {"`latest` names": latest_name(ckpt_dir) or "nothing", f"{folder.name} holds": rank_files(found & every),
            f"{folder.name} lacks": rank_files(every - found),
            "its manifest": "yes" if (folder / MANIFEST).is_file() else "no",
            "committed checkpoints": ", ".join(committed_tags(ckpt_dir)) or "none"}


def crash_rows(dirs: dict[str, str | Path], step: int, nproc: int) -> list[dict[str, Any]]:
    """One row per save kind (DeepSpeed's save alone, the commit protocol) killed at the same moment."""
    return [{"save": kind, **left_behind(d, step, nproc)} for kind, d in dirs.items()]


def crash_sentence(rows: list[dict[str, Any]], step: int) -> str:
    """What a resume that trusts `latest` would load after each save kind's crash, from `crash_rows`."""
    tag = tag_for(step)
    said = []
    for r in rows:
        complete = r[f"{tag} lacks"] == "none"
        if r["`latest` names"] != tag:
            said.append(f"after {r['save']}, `latest` names {r['`latest` names']}, the checkpoint before the crash")
        else:
            said.append(f"after {r['save']}, `latest` names {tag}, " + (
                "complete but never checked" if complete else f"which lacks {r[f'{tag} lacks']}"))
    return ("The same kill, at the same moment: " + "; ".join(said) + ". `engine.load_checkpoint(dir)` reads the tag "
            "`latest` names; only a checkpoint with a manifest was seen complete on every rank.")


def crash_answer(crash_dir: str | Path, report: str, resumed: RunResult, nproc: int,
                 default: int = DEFAULT_NPROC) -> str:
    """Exercise: how many ranks spoke when the last one was killed mid-save (their lines are section 5's, not
    repeated), and where the resume started, against the default world size."""
    said = [line for line in report.splitlines()[1:-1] if "printed no error" not in line]
    other = 3 if nproc == default else default
    survivors = "the surviving rank would print" if other == 2 else f"the {other - 1} surviving ranks would each print"
    why = " naming a dead peer" if said and all("peer" in line for line in said) else ""
    alive = "the surviving rank" if nproc == 2 else f"{len(said)} of the {nproc - 1} surviving ranks"
    spoke = f"{alive} printed an error line{why}" if nproc > 1 else "no other rank was left to print a line"
    silent = " and printed nothing" if f"rank {nproc - 1}: printed no error" in report else ""
    return (f"With N = {nproc}, rank {nproc - 1} was killed{silent}; {spoke} (section 5 shows each "
            f"rank's line; {Path(crash_dir) / 'launch.log'} holds everything). "
            f"The resume started from step {resumed.data['resumed_from_step']}, the newest checkpoint with a manifest. "
            f"With N = {other} the same would hold: {survivors} the same kind of line, and the kill hits the same "
            "save, so the resume starts from the same step whatever N.")


def peer_failure_rows(rank: int, tag: str) -> list[dict[str, str]]:
    """How the save path classifies what a rank sees when a peer dies, shown on errors built here (NCCL's message
    as torch raises it): a peer failure stops every rank with one line; a disk error is this rank's own."""
    import torch.distributed as dist

    from zckpt_nb.errors import is_peer_failure, peer_failure

    seen = {"NCCL, a dead peer": dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited "
                                                       "or there was a network error"),
            "gloo, a dead peer (section 5)": RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"),
            "a full disk (section 4)": OSError(28, "No space left on device")}
    return [{"what the rank sees": kind, "exception": type(err).__name__,
             "is_peer_failure": "yes" if is_peer_failure(err) else "no",
             "the save path then": str(peer_failure(err, rank, f"save of {tag}")) if is_peer_failure(err) else
             "this rank's write error, shared in the agreement; training goes on (or stops, --on_save_error)"}
            for kind, err in seen.items()]


def deepspeed_default_timeout() -> float:
    """Seconds of `deepspeed.init_distributed`'s default timeout (`deepspeed/constants.py`, $DEEPSPEED_TIMEOUT),
    read from that one file: importing `deepspeed` itself would set up an accelerator in this kernel for one number."""
    from importlib.util import find_spec, module_from_spec, spec_from_file_location

    path = Path(find_spec("deepspeed").origin).parent / "constants.py"
    spec = spec_from_file_location("deepspeed_constants", path)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.default_pg_timeout.total_seconds()


def timeout_rows(collective_timeout: float) -> list[dict[str, str]]:
    """The timeouts a waiting collective can meet, read from the installed packages where they live."""
    from torch.distributed import constants

    from zckpt_nb.saving.collective import timeout_seconds

    nccl = constants.default_pg_nccl_timeout
    rows = [("section 2's job (COLLECTIVE_TIMEOUT)", collective_timeout,
             "--collective_timeout, passed to deepspeed.init_distributed"),
            ("this package's worker, by default", timeout_seconds(None), "$ZCKPT_COLLECTIVE_TIMEOUT"),
            ("deepspeed.init_distributed, by default", deepspeed_default_timeout(), "$DEEPSPEED_TIMEOUT"),
            ("torch's init_process_group without one: gloo", constants.default_pg_timeout.total_seconds(), "torch"),
            ("torch's init_process_group without one: NCCL", nccl.total_seconds() if nccl else 600.0,
             "torch" if nccl else "torch (ProcessGroupNCCL's default; this CPU build of torch has no NCCL)")]
    return [{"timeout": name, "seconds": f"{value:,.0f}", "set by": by} for name, value, by in rows]


def job_reports(results: dict[str, Any], dirs: dict[str, str | Path]) -> dict[str, str]:
    """Each job of `together` in a few lines: `failure_report` for a failed launch, 'the job finished' otherwise;
    any other exception is raised (it is not the failure the lesson shows)."""
    from zckpt_nb.errors import LaunchError
    from zckpt_nb.run.logs import failure_report

    reports = {}
    for key, result in results.items():
        if isinstance(result, LaunchError):
            reports[key] = failure_report(result, dirs[key])
        elif isinstance(result, Exception):
            raise result
        else:
            reports[key] = "the job finished"
    return reports
