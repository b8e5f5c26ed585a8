"""Two save patterns the lessons compare with the commit protocol: DeepSpeed's save alone, and the seed's snippet.

Neither is safe; both exist so that notebooks 02 and 06 and the benchmarks can *run* what goes wrong with them
instead of describing it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CollectiveTimeout, is_timeout
from zckpt_nb.format.layout import tag_step
from zckpt_nb.saving import faults
from zckpt_nb.saving.commit import SaveOutcome


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


def save_rank0_only(engine: Any, tokenizer: Any, save_dir: str | Path, tag: str, state: dict[str, Any],
                    timeout: float) -> SaveOutcome:
    """The seed's snippet, for notebook 05: `if rank == 0:` around the whole, collective, save. It cannot finish.

    Rank 0 waits in DeepSpeed's first barrier for ranks that went on training; the collective timeout ends the
    wait with an error, turned into one line. The other ranks do what the snippet tells them: nothing, and they
    train on until their next collective waits for rank 0 (what they print then is their own, real, error).
    """
    import torch.distributed as dist

    start = time.perf_counter()
    if dist.get_rank() != 0:
        return SaveOutcome(tag, tag_step(tag), False, None, time.perf_counter() - start, skipped=True)
    try:
        os.makedirs(save_dir, exist_ok=True)
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=state)
        tokenizer.save_pretrained(str(save_dir))
    except Exception as e:
        if not is_timeout(e):
            raise
        raise CollectiveTimeout(
            f"rank 0: under ZeRO-3 every rank must call save_checkpoint; it was called on rank 0 only (--save_mode "
            f"rank0_only) for {tag} and gave up after {time.perf_counter() - start:.0f} s (collective timeout "
            f"{timeout:.0f} s) waiting for ranks that never joined") from None
    return SaveOutcome(tag, tag_step(tag), True, None, time.perf_counter() - start)
