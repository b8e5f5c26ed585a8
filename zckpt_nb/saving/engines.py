"""DeepSpeed's own checkpoint engines as save modes, run under this package's launcher (torchrun).

DeepSpeed 0.19.8 picks its checkpoint engine from the config's `"checkpoint": {"writer": {...}}` section
(`create_checkpoint_engine`):
- no section: `TorchCheckpointEngine`, `torch.save` to a path (the `plain` save mode);
- `"type": "python"`: `FastCheckpointEngine` writing through a `PyFileWriter` (buffered Python writes, no fsync);
- `"type": "fast"`: the same engine through DeepNVMe's `FastFileWriter` (async I/O from pinned buffers, one fsync
  per file); it needs the async-I/O op and an accelerator;
- `"decoupled": true`: `DecoupledCheckpointEngine`, a writer process per rank fed through a queue. The save call
  returns once the state is queued; the next optimizer step (`engine.step`) waits until the writer is done, and
  rank 0 then writes `latest`.

Two things stop them under torchrun, and are set here as DeepSpeed's own launcher would:
- the writers read `CROSS_RANK` and `CROSS_SIZE` (node rank and node count), which only `deepspeed.launcher.launch`
  exports: without them every rank fails with `KeyError: 'CROSS_SIZE'`;
- the stall of a decoupled save continues into the next step's wait, which a timer around the save call misses:
  `TimedCommits` wraps the engine's `commit` (a public method of DeepSpeed's `CheckpointEngine`) to measure it.

None of these writes a manifest or makes the folder durable as a whole: a crash can leave `latest` naming files that
are not all on disk (notebook 05 shows what that costs).
"""

from __future__ import annotations

import os
import time
from typing import Any

WRITERS = {"ds_python": {"type": "python", "decoupled": False},
           "ds_decoupled": {"type": "python", "decoupled": True},
           "ds_fast": {"type": "fast", "decoupled": False}}


def writer_section(mode: str) -> dict[str, Any]:
    """What the config's "checkpoint" section needs to select `mode`'s engine ({} for the package's own modes)."""
    return {"writer": dict(WRITERS[mode])} if mode in WRITERS else {}


def launcher_env() -> dict[str, str]:
    """What `deepspeed.launcher.launch` exports and torchrun does not: this node's rank and the node count."""
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return {"CROSS_RANK": os.environ.get("GROUP_RANK", "0"), "CROSS_SIZE": str(max(nodes, 1))}


def set_launcher_env() -> None:
    """Export `launcher_env` in this rank, keeping what DeepSpeed's own launcher already set."""
    for key, value in launcher_env().items():
        os.environ.setdefault(key, value)


class TimedCommits:
    """DeepSpeed's checkpoint engine, each `commit` call's start and seconds recorded (handed out by `take`)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.waits = inner, []

    def __getattr__(self, name: str) -> Any:  # save, create, load, is_decoupled, ...: DeepSpeed's engine
        return getattr(self.inner, name)

    def timed(self, call: Any, *args: Any) -> Any:
        """Run one of the engine's calls, recording when it started and how long it blocked."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.waits.append((start, time.perf_counter() - start))

    def commit(self, info: Any) -> Any:
        return self.timed(self.inner.commit, info)

    def cleanup(self) -> None:
        """The decoupled engine's last commit (its writer finishes and exits), timed like the others."""
        self.timed(self.inner.cleanup)

    def take(self) -> list[tuple[float, float]]:
        """(perf_counter start, seconds) of the commits since the last call."""
        waits, self.waits = self.waits, []
        return waits


def time_commits(engine: Any) -> TimedCommits:
    """Wrap `engine`'s checkpoint engine so that its commits are timed; returns the wrapper."""
    engine.checkpoint_engine = TimedCommits(engine.checkpoint_engine)
    return engine.checkpoint_engine
