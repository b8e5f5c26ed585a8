"""Notebook 05: what each failed save left on disk, and the sentences and answers computed from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import committed_tags
from zckpt_nb.run.launch import RunResult


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


def crash_answer(crash_dir: str | Path, report: str, resumed: RunResult) -> str:
    """Exercise: what the ranks said when the last one was killed mid-save, and where the resume started."""
    said = "\n".join(report.splitlines()[1:-1])
    return (f"Each rank's own line ({Path(crash_dir) / 'launch.log'} holds everything):\n\n```\n{said}\n```\n\n"
            f"The resume started from step {resumed.data['resumed_from_step']}: the newest checkpoint with a manifest.")
