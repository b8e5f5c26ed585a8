"""Notebook 07: one checkpoint resumed on several world sizes.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.format.layout import universal_dir
from zckpt_nb.lessons import claims
from zckpt_nb.lessons.together import all_done, together
from zckpt_nb.run.launch import launch


def resume_on(source: str | Path, tag: str, worlds: list[int], steps: int, out_root: str | Path,
              **launch_kw: Any) -> dict[int, Any]:
    """Notebook 07: resume a copy of checkpoint `tag` on each world size in `worlds`, all started at once
    (`together`: their figures are losses, not seconds); their `RunResult`s, or the first failure raised.

    The source's universal copy, when it has one, is copied too: each job then loads it instead of converting again."""
    folders = {world: copy_checkpoint(source, Path(out_root) / f"resumed_on_{world}", tag) for world in worlds}
    if universal_dir(source, tag).is_dir():
        for folder in folders.values():
            shutil.copytree(universal_dir(source, tag), universal_dir(folder, tag))
    return all_done(together({world: partial(launch, world, steps, folders[world], resume=True, **launch_kw)
                              for world in worlds}))


def batch_answer(rows: list[dict[str, Any]], global_batch: int, micro_batch: int, dtype: str = "fp32") -> str:
    """Exercise: how each world size split the global batch, and whether every resumed run still continued the
    uninterrupted one (`claims.reshard_sentence`)."""
    split = "; ".join(f"on {r['resumed on N']} rank(s), {global_batch // r['resumed on N']} to "
                      f"{-(-global_batch // r['resumed on N'])} sequences per rank in {r['accumulation steps']} "
                      "micro-step(s)" for r in rows)
    return (f"A global batch of {global_batch} sequences (at most {micro_batch} per micro-step): {split}. "
            + claims.reshard_sentence(rows, dtype))


def nodes_answer(rows: list[dict[str, Any]]) -> str:
    """Exercise: what each node's own folder held after a job with a folder per node (`nodes.folder_rows`)."""
    return (f"{len(rows)} folders, one per node: " + "; ".join(
        f"{r['folder']} holds the files of rank(s) {r['ranks whose files it holds']}, and its manifest lists "
        f"{r['files its manifest lists']} files, {r['of them on other nodes']} of them on other nodes" for r in rows)
        + ".")


def loss_differences(base: Any, runs: dict[int, Any], floor: float = 1e-9) -> dict[str, tuple[list[int], list[float]]]:
    """Per resumed run, |its loss - the uninterrupted run's| at each step both logged, raised to `floor` so that an
    exact match still shows on a log scale."""
    by_step = dict(zip(base.steps, base.losses))
    return {f"resumed on {n} rank(s)": ([s for s in run.steps if s in by_step],
                                        [max(abs(loss - by_step[s]), floor) for s, loss in zip(run.steps, run.losses)
                                         if s in by_step])
            for n, run in runs.items()}
