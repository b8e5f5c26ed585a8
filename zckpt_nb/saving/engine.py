"""The package's DeepSpeed checkpoint engine: one `CheckpointEngine` subclass, given to a DeepSpeed engine once.

`ZckptEngine` wraps the engine DeepSpeed built from its config: it saves each file as the save in progress asks
(hashed and fsynced now, or copied to host memory for a later write; a write error kept, not raised, so no rank
leaves the others in DeepSpeed's barriers), loads every file weights-only, and times DeepSpeed's `commit` and `cleanup`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from zckpt_nb.convert.safeload import load
from zckpt_nb.format.records import SaveMode
from zckpt_nb.format.writer import Written, write_hashed
from zckpt_nb.measure.meters import pinned_host_bytes
from zckpt_nb.saving import snapshot

HASHED, SNAPSHOT = "hashed", "snapshot"  # how the save in progress wants its files
WRITERS = {SaveMode.DS_PYTHON: {"type": "python", "decoupled": False},  # DeepSpeed's config: "checkpoint.writer"
           SaveMode.DS_DECOUPLED: {"type": "python", "decoupled": True},
           SaveMode.DS_FAST: {"type": "fast", "decoupled": False}}


def writer_section(mode: str) -> dict[str, Any]:
    """What DeepSpeed's "checkpoint" config section needs to select `mode`'s engine ({} for the package's own)."""
    return {"writer": dict(WRITERS[mode])} if mode in WRITERS else {}


def launcher_env() -> dict[str, str]:
    """What DeepSpeed's launcher exports and torchrun does not (its writers need them): node rank and node count."""
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return {"CROSS_RANK": os.environ.get("GROUP_RANK", "0"), "CROSS_SIZE": str(max(nodes, 1))}


class Files(Written):
    """One save's files on this rank (`Written`), how the save wants them, and the host copies still to write."""

    def __init__(self, rank: int, how: str, stage: Callable[[Any], Any] = snapshot.host_copy) -> None:
        super().__init__(rank)
        self.how, self.stage = how, stage
        self.snapshots: list[tuple[Path, Any]] = []
        self.snapshot_bytes, self.pinned_bytes = 0, None

    def keep(self, state: Any, path: Path) -> None:
        """A host copy of a file's state, fixed before training changes the tensors."""
        copied = self.stage(state)
        self.snapshots.append((path, copied))
        self.snapshot_bytes += snapshot.storage_bytes(copied)
        if snapshot.pins(state):  # torch's pinned pool rounds up to powers of two: up to 2x snapshot_bytes
            self.pinned_bytes = pinned_host_bytes()

    def timings(self, write_seconds: float, protocol_seconds: float) -> dict[str, float]:
        """A save's stages in seconds (the hash runs beside the write, inside "write")."""
        return {"write": write_seconds - self.fsync_seconds, "fsync": self.fsync_seconds, "hash": self.hash_seconds,
                "protocol": protocol_seconds}


class ZckptEngine(CheckpointEngine):
    """The package's checkpoint engine (module docstring); `install` gives it to a DeepSpeed engine."""

    def __init__(self, inner: CheckpointEngine) -> None:
        super().__init__()
        self.inner, self.name = inner, inner.name
        self.files: Files | None = None  # the save in progress; None: DeepSpeed's own way
        self.waits: list[float] = []  # seconds of each commit and cleanup

    def save(self, state_dict: Any, path: str) -> None:
        files = self.files
        if files is None:
            self.inner.save(state_dict, path)
        elif files.error is not None:  # after an error, nothing more of this save is written
            return
        elif files.how == SNAPSHOT:
            try:
                files.keep(state_dict, Path(path))
            except Exception as e:  # kept for the agreement
                files.fail(e, path)
        else:
            self.write_file(state_dict, Path(path), files)

    def write_file(self, state_dict: Any, path: Path, files: Files) -> None:
        """One file: DeepSpeed's own serialisation into the hashing writer (O_DIRECT, SHA-256, fsync)."""
        write_hashed(files, path, state_dict, self.inner.save)

    def write_snapshots(self, files: Files) -> None:
        """The host copies of an asynchronous save to their files (the background thread); the first error is kept."""
        for path, state in files.snapshots:
            if files.error:
                break
            self.write_file(state, path, files)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            if self.files is None:
                raise
            self.files.fail(e, path, "creating")

    def protocol_point(self, point: str) -> None:
        """The commit protocol reached `point` ("written", "latest"); a subclass may act here."""

    def load(self, path: str, map_location: Any = None) -> Any:
        return load(path, map_location=map_location)

    def timed(self, call: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.waits.append(time.perf_counter() - start)

    def take_waits(self) -> list[float]:
        """Seconds of the commits and cleanups since the last call."""
        waits, self.waits = self.waits, []
        return waits

    def create(self, info: Any) -> Any:
        return self.inner.create(info)

    def commit(self, info: Any) -> Any:
        return self.timed(self.inner.commit, info)

    def cleanup(self) -> None:
        self.timed(self.inner.cleanup)

    def is_decoupled(self) -> bool:
        return self.inner.is_decoupled()

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.inner.is_data_parallel_writer(dp_rank)

    def set_commit_info(self, info: Any) -> None:
        self.inner.set_commit_info(info)

    def get_commit_info(self) -> Any:
        return self.inner.get_commit_info()

    def preserves_storage_sharing(self) -> bool:
        return self.inner.preserves_storage_sharing()


def install(engine: Any, kind: type[ZckptEngine] = ZckptEngine) -> ZckptEngine:
    """`engine`'s checkpoint engine as a `ZckptEngine`: made once, around the one DeepSpeed built; the same after."""
    if not isinstance(engine.checkpoint_engine, ZckptEngine):
        engine.checkpoint_engine = kind(engine.checkpoint_engine)
    return engine.checkpoint_engine
