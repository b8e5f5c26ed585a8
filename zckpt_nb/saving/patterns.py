"""DeepSpeed's save alone (`plain` and DeepSpeed's own engines): what the commit protocol is compared with."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import tag_step
from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.saving import faults


class FaultBetweenFiles:
    """DeepSpeed's own checkpoint engine, with the `shards` fault point between a rank's first and second file."""

    def __init__(self, inner: Any, rank: int, step: int) -> None:
        self.inner, self.rank, self.step, self.files = inner, rank, step, 0

    def __getattr__(self, name: str) -> Any:  # create, commit, makedirs, load: DeepSpeed's engine
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        if self.files:
            faults.maybe("shards", self.rank, self.step)
        self.inner.save(state_dict, path)
        self.files += 1


@contextmanager
def fault_points(engine: Any, step: int) -> Iterator[None]:
    """Route one save's writes through `FaultBetweenFiles` (only when ZCKPT_FAULT is set: no cost otherwise)."""
    if not os.environ.get("ZCKPT_FAULT"):
        yield
        return
    original = engine.checkpoint_engine
    engine.checkpoint_engine = FaultBetweenFiles(original, engine.global_rank, step)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


def save_plain(engine: Any, save_dir: str | Path, tag: str, state: dict[str, Any]) -> SaveOutcome:
    """DeepSpeed's save alone (the benchmark's baseline): no fsync, no hash, no manifest; rank 0 moves `latest`."""
    start = time.perf_counter()
    with fault_points(engine, tag_step(tag)):
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=state)
    seconds = time.perf_counter() - start
    return SaveOutcome(tag, tag_step(tag), True, seconds=seconds, timings={"write": seconds})
