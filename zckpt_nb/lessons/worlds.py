"""Notebook 07: one checkpoint resumed on several world sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.run.launch import launch


def resume_on(source: str | Path, tag: str, worlds: list[int], steps: int, out_root: str | Path,
              **launch_kw: Any) -> dict[int, Any]:
    """Notebook 07: resume a copy of checkpoint `tag` on each world size in `worlds`; their `RunResult`s."""
    runs = {}
    for world in worlds:
        folder = copy_checkpoint(source, Path(out_root) / f"resumed_on_{world}", tag)
        runs[world] = launch(world, steps, folder, resume=True, **launch_kw)
    return runs
