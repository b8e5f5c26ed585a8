"""Notebook 05: what each failed save left on disk, and the sentences and answers computed from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import RANK_FILE, committed_tags, latest_name
from zckpt_nb.run.launch import RunResult


def missing_rank_files(ckpt_dir: str | Path, tag: str, nproc: int) -> list[str]:
    """The rank files (model and optimizer states of every rank) that folder `tag` lacks."""
    folder = Path(ckpt_dir) / tag
    present = {(int(m.group(1)), m.group(2)) for p in folder.iterdir() if (m := RANK_FILE.search(p.name))}
    return [f"rank {r} {kind} states" for r in range(nproc) for kind in ("model", "optim") if (r, kind) not in present]


def plain_outcome(ckpt_dir: str | Path, nproc: int) -> tuple[str | None, list[str]]:
    """What `latest` names after DeepSpeed's save alone, and which of that tag's rank files are missing."""
    named = latest_name(ckpt_dir)
    if named is None or not (Path(ckpt_dir) / named).is_dir():
        return named, []
    return named, missing_rank_files(ckpt_dir, named, nproc)


def plain_sentence(ckpt_dir: str | Path, nproc: int) -> str:
    """What DeepSpeed's save alone left when its last rank was killed mid-save: does `latest` name a whole tag?"""
    named, missing = plain_outcome(ckpt_dir, nproc)
    if named is None or not (Path(ckpt_dir) / named).is_dir():
        return f"`latest` names {named or 'nothing'}: the kill came before DeepSpeed moved it in this run."
    if not missing:
        return (f"`latest` names {named} and all {2 * nproc} of its rank files are present: the kill came too late "
                "in this run to show the gap.")
    return (f"`latest` names **{named}**, and {len(missing)} of its {2 * nproc} rank files are missing "
            f"({', '.join(missing)}): a resume that trusts `latest` loads a checkpoint that is not there.")


def hang_answer(seconds: float, collective_timeout: float, failed: bool, committed: list[str]) -> str:
    """Exercise: how long the rank-0-only save ran before it ended, against the collective timeout."""
    if not failed:
        return (f"The job finished in {seconds:.0f} s: with one rank nobody waits for anybody, so the rank-0 guard "
                "cannot hang (and hides the bug until the job runs on two ranks).")
    return (f"The job ended after {seconds:.0f} s with a collective timeout of {collective_timeout} s (the rest is "
            f"start-up and training up to the save); checkpoints committed: {', '.join(committed) or 'none'}.")


def rotation_answer(run: RunResult, keep_last: int) -> str:
    """Exercise: which committed checkpoints `--keep_last` kept, and which it deleted, from the run's files."""
    deleted = [t for s in run.ranks[0]["saves"] for t in s["deleted"]]
    kept = committed_tags(run.output_dir)
    return (f"With --keep_last {keep_last}, {len(kept)} committed checkpoint(s) remain ({', '.join(kept)}); "
            f"rotation deleted {', '.join(deleted) or 'nothing'}, each only after a newer save had committed.")


def resume_sentence(uninterrupted: RunResult, resumed: RunResult) -> str:
    """The crash-and-resume check: where the resume started and how far its losses lie from the uninterrupted run."""
    by_step = dict(zip(uninterrupted.steps, uninterrupted.losses))
    diff = max(abs(by_step[s] - loss) for s, loss in zip(resumed.steps, resumed.losses))
    return (f"The run killed during its step-8 save resumed from step {resumed.data['resumed_from_step']}, the newest "
            f"committed checkpoint; its losses differ from the uninterrupted run's by at most {diff:.1e}"
            + (" (bit for bit the same)." if diff == 0 else "."))


def save_phases(saves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each save's phases in milliseconds (rank 0), one format for every column."""
    return [{"tag": s["tag"], **{f"{k} (ms)": f"{v * 1000:.1f}" for k, v in s["timings"].items()}} for s in saves]
