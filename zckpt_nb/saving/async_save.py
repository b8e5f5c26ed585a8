"""Asynchronous saves (`SaveMode.ASYNC`): training waits for a host copy of each rank's files, not for the disk.

A background thread writes the copies as a committed save writes its files, then agrees, commits and rotates on a
gloo group of its own, as DCP's `async_save` does; at most one save is in flight. With a `ProcessWriter`
(`SaveMode.ASYNC_PROCESS`) a writer process writes them and the thread only agrees and commits
(docs/commit_protocol.md).
"""

from __future__ import annotations

import contextvars
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.saving import commit, rotation
from zckpt_nb.saving.collective import GROUP
from zckpt_nb.saving.engine import SNAPSHOT, Files, install
from zckpt_nb.saving.process_writer import ProcessWriter
from zckpt_nb.saving.snapshot import Staging, host_copy


@dataclass
class InFlight:
    """The save being written in the background, and what its thread leaves for `finish`."""

    tag: str
    step: int
    start: float
    need: int
    files: Files
    thread: threading.Thread | None = None
    outcome: SaveOutcome | None = None
    failure: BaseException | None = None  # what the background thread raised (a lost peer): raised by `finish`


class AsyncSaver:
    """This rank's asynchronous saves, at most one in flight."""

    def __init__(self, engine: Any, output_dir: str | Path, identity: dict[str, Any], *, keep_last: int,
                 timeout_s: float, process: ProcessWriter | None = None) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.engine, self.save_dir, self.identity, self.keep_last = engine, Path(output_dir), identity, keep_last
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.flight: InFlight | None = None
        self.process = process
        self.staging = process.staging if process else Staging()  # the host buffers each save copies into

    def save(self, tag: str, state: dict[str, Any], step: int, prepare: Any) -> SaveOutcome:
        """Copy and start writing `tag`; returns in flight unless the preflight failed."""
        import torch.distributed as dist

        start, rank = time.perf_counter(), dist.get_rank()
        error, need = commit.agreed_preflight(self.engine, self.save_dir, state, rank, prepare)
        if error:
            return SaveOutcome(tag, step, False, error, time.perf_counter() - start, estimated_bytes=need)
        self.staging.next_save()  # the save before this one is written: its buffers are free
        files = Files(rank, SNAPSHOT, self.process.stage if self.process else partial(host_copy, staging=self.staging))
        commit.run_save(self.engine, files, self.save_dir, tag, state, start)
        copied = time.perf_counter() - start
        self.flight = InFlight(tag, step, start, need, files)
        context = contextvars.copy_context()  # torch keeps its options per context: the thread saves as the caller
        self.flight.thread = threading.Thread(target=context.run, args=(self.write_and_commit, self.flight),
                                              name=f"zckpt-write-{tag}", daemon=True)
        self.flight.thread.start()
        return SaveOutcome(tag, step, False, None, copied, {"snapshot": copied}, estimated_bytes=need,
                           snapshot_bytes=files.snapshot_bytes, pinned_bytes=files.pinned_bytes)

    def poll(self) -> SaveOutcome | None:
        """At a step boundary: the outcome of the save in flight once its background commit is done, else None."""
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
        """The background thread: write the copies, agree and commit on the saver's own group, rotate."""
        GROUP.set(self.group)  # this thread's protocol collectives (in its own copy of the caller's context)
        try:
            writer, files, write_start = install(self.engine), flight.files, time.perf_counter()
            (self.process or writer).write_snapshots(files)
            files.snapshots.clear()  # the memory goes back as soon as the files are on disk
            commit_start = time.perf_counter()
            node_local = bool(self.engine.use_node_local_storage())
            error = commit.agree_and_commit(writer, self.save_dir, flight.tag, flight.step, files, self.identity,
                                            node_local)
            end = time.perf_counter()
            flight.outcome = SaveOutcome(flight.tag, flight.step, error is None, error, end - flight.start,
                                         files.timings(commit_start - write_start, end - commit_start),
                                         estimated_bytes=flight.need, snapshot_bytes=files.snapshot_bytes,
                                         pinned_bytes=files.pinned_bytes, durable_at=end)
            if flight.outcome.committed and self.keep_last:
                rotation.after_commit(self.save_dir, self.keep_last, flight.outcome, node_local)
        except BaseException as e:  # handed to the training thread, which raises it
            flight.failure = e
