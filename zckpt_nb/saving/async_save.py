"""Asynchronous saves (`--save_mode async`): training waits for a snapshot of each rank's files, not for the disk.

Every rank runs the same calls, with the same collectives, at the same step boundaries:

1. the save call (`AsyncSaver.save`): the commit protocol's preflight (`commit.agreed_preflight`: folder, tokenizer,
   free space), then DeepSpeed's own `save_checkpoint` with `SnapshotWriter` as its checkpoint engine. DeepSpeed
   builds its usual state dicts and hands each to the engine's `save`; the writer keeps a host copy of it
   (`snapshot.host_copy`): the state DeepSpeed would write, which later optimizer steps can no longer change.
   Training resumes as soon as both of this rank's state dicts are copied;
2. a background thread runs DeepSpeed's own `torch.save` on each copy into its file, exactly as the committed save
   does (`writers.DirectFile`: O_DIRECT, SHA-256 on the side, fsync), then frees it;
3. the same thread then runs the commit protocol's agreement and commit (`commit.agree_and_commit`: manifest, then
   `latest`; then `--keep_last`) on a gloo process group of its own, made for it when training starts: the ranks'
   writer threads meet there as soon as every one is done, while training goes on with its collectives on the
   default group. The checkpoint is durable then, not at a later step. DCP's `async_save` does the same;
4. at each step boundary (`poll`) the training loop picks up a finished save's outcome and reports it.

At most one save is in flight: the next save call, and the end of training, first wait for it (`finish`); that
wait is the next save's stall. Until the commit, `latest` names the previous checkpoint, so a
kill -9 during the background write leaves that one intact and resumable. A failure on any rank (a full disk in
the background write) comes out of the agreement on every rank, as in the synchronous protocol.
On GPUs the copy goes into pinned host memory (`snapshot`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.measure import meters
from zckpt_nb.saving import commit, faults, rotation, snapshot
from zckpt_nb.saving.collective import GROUP


class SnapshotWriter(commit.DeferredErrorWriter):
    """DeepSpeed's checkpoint engine during an asynchronous save: copies each state dict, serialises it later."""

    def __init__(self, inner: Any, rank: int, step: int) -> None:
        super().__init__(inner, rank, step)
        self.snapshots: list[tuple[Path, Any]] = []
        self.snapshot_bytes = 0
        self.pinned_bytes: int | None = None
        self.write_seconds = 0.0

    def write(self, state_dict: Any, path: Path) -> None:
        """A host copy of the file's state, fixed before training changes the tensors; serialised in `write_all`."""
        copied = snapshot.host_copy(state_dict)
        self.snapshots.append((path, copied))
        self.snapshot_bytes += snapshot.storage_bytes(copied)
        if snapshot.pins(state_dict):  # torch's pinned pool, rounded up to powers of two: up to 2x snapshot_bytes
            self.pinned_bytes = meters.pinned_host_bytes()

    def write_all(self) -> None:
        """The background thread: each snapshot to its file, hashed and fsynced; the first error is kept."""
        start = time.perf_counter()
        try:
            for path, state in self.snapshots:
                if self.error:  # an error while snapshotting: nothing of this save is written
                    break
                if self.written:  # "background": killed between this rank's model and optimizer files
                    faults.maybe("background", self.rank, self.step)
                self.write_file(path, state)
        finally:
            self.snapshots.clear()  # the memory goes back as soon as the files are on disk
            self.write_seconds = time.perf_counter() - start

    def write_file(self, path: Path, state: Any) -> None:
        """One file, hashed and fsynced; an error is kept for the agreement and the partial file removed."""
        try:
            # DeferredErrorWriter.write: DeepSpeed's torch.save, O_DIRECT, hash, fsync. Its CRC-32 switch is
            # process-wide; training runs no torch.save while a save is in flight (at most one), so nothing else sees it
            super().write(state, path)
        except Exception as e:
            self.fail(e, path)
            path.unlink(missing_ok=True)


@dataclass
class InFlight:
    """The save being written in the background: what its commit needs."""

    tag: str
    step: int
    start: float
    need: int
    writer: SnapshotWriter
    thread: threading.Thread | None = None
    outcome: SaveOutcome | None = None
    failure: BaseException | None = None  # what the background thread raised (a lost peer): re-raised by `finish`


class AsyncSaver:
    """This rank's asynchronous saves, at most one in flight. Every rank calls `save` and `finish` at the same
    boundaries; `poll` is local (a rank may pick up the outcome one step after another)."""

    def __init__(self, engine: Any, output_dir: str | Path, identity: dict[str, Any], *, keep_last: int,
                 timeout_s: float) -> None:
        """Every rank, at the same point (it makes the commit's process group, a collective)."""
        from datetime import timedelta

        import torch.distributed as dist

        self.engine, self.save_dir, self.identity, self.keep_last = engine, Path(output_dir), identity, keep_last
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.flight: InFlight | None = None

    def save(self, tag: str, state: dict[str, Any], step: int, prepare: Any) -> SaveOutcome:
        """Snapshot and start writing `tag`; returns at once, in flight (neither committed nor failed) unless the
        preflight failed. Call `finish` first: at most one save is in flight."""
        import torch.distributed as dist

        start, rank = time.perf_counter(), dist.get_rank()
        error, need = commit.agreed_preflight(self.engine, self.save_dir, state, step, rank, prepare)
        if error:
            return SaveOutcome(tag, step, False, error, time.perf_counter() - start, estimated_bytes=need)
        faults.maybe("fill", rank, step, self.save_dir)
        writer = SnapshotWriter(self.engine.checkpoint_engine, rank, step)
        commit.run_save(self.engine, writer, self.save_dir, tag, state, start)
        snapshot_seconds = time.perf_counter() - start
        self.flight = InFlight(tag, step, start, need, writer)
        self.flight.thread = threading.Thread(target=self.write_and_commit, args=(self.flight,),
                                              name=f"zckpt-write-{tag}", daemon=True)
        self.flight.thread.start()
        return SaveOutcome(tag, step, False, None, snapshot_seconds, {"snapshot": snapshot_seconds},
                            estimated_bytes=need, snapshot_bytes=writer.snapshot_bytes,
                            pinned_bytes=writer.pinned_bytes)

    def poll(self) -> SaveOutcome | None:
        """At a step boundary: the outcome of the save in flight once its background commit has finished, else None."""
        if self.flight is None or self.flight.thread.is_alive():
            return None
        return self.finish()

    def finish(self) -> SaveOutcome | None:
        """Wait for the save in flight (if any) to be committed or failed; its outcome."""
        if self.flight is None:
            return None
        flight, self.flight = self.flight, None
        flight.thread.join()
        if flight.failure is not None:  # e.g. a collective timed out: the job must stop, as in the synchronous mode
            raise flight.failure
        return flight.outcome

    def write_and_commit(self, flight: InFlight) -> None:
        """The background thread: write, then the agreement and commit on the saver's own group, then rotation."""
        GROUP.set(self.group)  # this thread's protocol collectives (a new thread starts with a fresh context)
        try:
            flight.outcome = self.commit_written(flight)
        except BaseException as e:  # handed to the training thread, which raises it
            flight.failure = e

    def commit_written(self, flight: InFlight) -> SaveOutcome:
        """Write the snapshot, agree and commit, rotate: this rank's outcome of the save."""
        flight.writer.write_all()
        writer, rank = flight.writer, flight.writer.rank
        faults.maybe("before_commit", rank, flight.step)
        commit_start = time.perf_counter()
        node_local = bool(self.engine.use_node_local_storage())
        error = commit.agree_and_commit(self.save_dir, flight.tag, flight.step, writer, self.identity, node_local)
        end = time.perf_counter()
        timings = {"write": writer.write_seconds - writer.fsync_seconds,
                   "fsync": writer.fsync_seconds, "hash": writer.hash_seconds, "protocol": end - commit_start}
        outcome = SaveOutcome(flight.tag, flight.step, error is None, error, end - flight.start, timings,
                               estimated_bytes=flight.need, snapshot_bytes=writer.snapshot_bytes,
                               pinned_bytes=writer.pinned_bytes, durable_at=end)
        if outcome.committed and self.keep_last:

            rotation.after_commit(self.save_dir, self.keep_last, outcome, node_local)
        return outcome
