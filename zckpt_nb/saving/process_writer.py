"""The writer process of `SaveMode.ASYNC_PROCESS`: a long-lived process per rank that makes staged files durable.

The rank hands each file's state, copied into shared host memory, through a `torch.multiprocessing` queue; the
process `torch.save`s it into the hashing writer (`format.writer`) and answers with the hashes or the first error.
It holds no collective and dies with its rank (docs/commit_protocol.md).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
from pathlib import Path
from typing import Any

from zckpt_nb.format.sizes import tensors_in
from zckpt_nb.format.writer import Written, skip_crc32, write_hashed
from zckpt_nb.measure.meters import libc
from zckpt_nb.saving.snapshot import Staging, host_copy

POLL_S = 1.0  # how often each side looks whether the other is still alive
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def serve(jobs: Any, answers: Any, parent: int, zipfile: bool) -> None:
    """The writer process, until orphaned (its rank gone): each job's files written in order up to the first error."""
    import torch

    die_with_parent()
    skip_crc32()  # as in the training process: each file is hashed as it is written
    while os.getppid() == parent:
        try:
            rank, items = jobs.get(timeout=POLL_S)
        except queue.Empty:
            continue
        answer = Written(rank)
        for path, state, attributes in items:
            for i, tensor in enumerate(tensors_in(state)):
                tensor.__dict__.update(attributes.get(i, {}))
            if not write_hashed(answer, Path(path), state,
                                lambda obj, out: torch.save(obj, out, _use_new_zipfile_serialization=zipfile)):
                break
        answers.put(answer)


class ProcessWriter:
    """This rank's writer process and its staging buffers; start it from the main thread."""

    def __init__(self, zipfile: bool = True) -> None:
        import torch.multiprocessing as mp

        self.staging = Staging(shared=True)  # the shared buffers each save copies into
        self.context, self.zipfile = mp.get_context("spawn"), zipfile
        self.start()

    def start(self) -> None:
        """A new writer process, with queues of its own (a dead one may have left half a message in the old)."""
        self.jobs, self.answers = self.context.Queue(), self.context.Queue()
        self.process = self.context.Process(target=serve, args=(self.jobs, self.answers, os.getpid(), self.zipfile),
                                            name="zckpt-writer", daemon=True)
        self.process.start()

    def stage(self, state: Any) -> Any:
        """A copy of `state` in shared host memory; a writer that died is replaced here."""
        if not self.process.is_alive():
            self.start()
        return host_copy(state, self.staging)

    def write_snapshots(self, files: Any) -> None:
        """Have the process write `files`' staged states; record their hashes and timings, or the first error."""
        # the queue sends a tensor as a handle to its memory and drops its attributes (DeepSpeed's ds_id, which the
        # file records): they travel beside it, by the tensor's place in the state
        items = [(str(path), state, {i: t.__dict__ for i, t in enumerate(tensors_in(state)) if t.__dict__})
                 for path, state in files.snapshots]
        answer = None
        self.jobs.put((files.rank, items))
        while answer is None:  # the process's answer; None if it died first
            try:
                answer = self.answers.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    break
        if answer is None:
            files.fail(ChildProcessError(f"the writer process (pid {self.process.pid}) died with exit code "
                                         f"{self.process.exitcode}"), items[0][0] if items else "", "writing")
            return
        files.written += answer.written
        files.fsync_seconds += answer.fsync_seconds
        files.hash_seconds += answer.hash_seconds
        files.error = files.error or answer.error
