"""The one hashing file writer: O_DIRECT blocks, SHA-256 on a thread beside the writer, fsync at close.

By hand because Python's file objects cannot write O_DIRECT, and the page cache made durable saves CPU-bound here.
A closed file's two block buffers serve the next file (`Blocks`): a conversion writing hundreds of files pays their
page faults once, not once a file (docs/performance.md).
`skip_crc32` turns off torch.save's per-record CRC-32, which the SHA-256 makes redundant (docs/save_stall.md).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt_nb.errors import describe_error
from zckpt_nb.format.disk import PAGE

BLOCK = 8 * 2**20  # bytes per O_DIRECT write: a multiple of the page size, as O_DIRECT requires


class Blocks:
    """Pairs of page-aligned BLOCK buffers (anonymous maps), handed to a file and taken back at its close; at most
    `keep` pairs wait for the next files (one: files written one after another hold no more than one file did)."""

    def __init__(self, keep: int = 1) -> None:
        self.keep, self.spare, self.lock = keep, [], threading.Lock()

    def take(self) -> list[mmap.mmap]:
        with self.lock:
            if self.spare:
                return self.spare.pop()
        return [mmap.mmap(-1, BLOCK), mmap.mmap(-1, BLOCK)]

    def give(self, buffers: list[mmap.mmap]) -> None:
        """Keep `buffers` for the next file (no worker may still be writing from them), or drop them (unmapped once no
        view of them is left)."""
        with self.lock:
            if len(self.spare) < self.keep:
                self.spare.append(buffers)

    def reset(self) -> None:
        """Forget every pair (in a forked child: a lock held in the parent at the fork would stay held)."""
        self.spare, self.lock = [], threading.Lock()


BLOCKS = Blocks()
os.register_at_fork(after_in_child=BLOCKS.reset)


def skip_crc32() -> None:
    """`torch.save` skips its per-record CRC-32 from now on, here and in threads started in a copy of this context."""
    import torch.serialization

    torch.serialization.set_crc32_options(False)


class DirectFile:
    """A write-only O_DIRECT file that hashes (SHA-256) and writes on a worker thread, fsynced at close unless `sync`
    is False (the caller fsyncs it before its commit: from-dcp makes its ~270 files durable together, `fsync_all`)."""

    def __init__(self, path: str | Path, sync: bool = True) -> None:
        self.fd, self.direct, self.sync = *open_direct(path), sync
        self.buffers = BLOCKS.take()  # anonymous maps are page-aligned
        self.fill, self.written, self.sha, self.pending = 0, 0, hashlib.sha256(), None
        self.closed = False
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="zckpt-direct")
        self.hash_seconds = self.fsync_seconds = 0.0

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, error_type: Any, *rest: Any) -> None:
        if error_type is None:
            self.close()
        elif not self.closed:  # the save failed: stop the worker, close the descriptor, keep the first error
            self.closed = True
            self.release()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(BLOCK - self.fill, len(view) - done)
            self.buffers[0][self.fill:self.fill + n] = view[done:done + n]
            self.fill, done = self.fill + n, done + n
            if self.fill == BLOCK:
                self.submit()
        self.written += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes accepted so far: where the next byte goes (DCP records each item's offset)."""
        return self.written

    def fileno(self) -> int:
        """The descriptor; an fsync of it (DCP's) covers the blocks written so far, `close` fsyncs the rest."""
        return self.fd

    def flush(self) -> None:  # torch.save may call it; blocks go out when full, the rest at close
        pass

    def submit(self) -> None:
        """Hand the full buffer to the worker (after the one it is writing, if any) and fill the other one."""
        self.wait()
        self.pending = self.worker.submit(self.hash_and_write, self.buffers[0], self.fill)
        self.buffers.reverse()
        self.fill = 0

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # the worker's OSError, raised here

    def hash_and_write(self, buffer: mmap.mmap, size: int) -> None:
        view = memoryview(buffer)[:size]
        start = time.perf_counter()
        self.sha.update(view)  # hashlib releases the GIL: this runs beside torch.save's serialising
        self.hash_seconds += time.perf_counter() - start
        write_all(self.fd, view)

    def close(self) -> None:
        """Write the tail, fsync (if `sync`), close; always closes the descriptor and stops the worker; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait()
            aligned = self.fill // PAGE * PAGE
            self.hash_and_write(self.buffers[0], aligned)
            if self.fill > aligned:  # O_DIRECT writes whole pages only: the last partial one goes buffered
                if self.direct:
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                tail = memoryview(self.buffers[0])[aligned:self.fill]
                self.sha.update(tail)
                write_all(self.fd, tail)
            start = time.perf_counter()
            if self.sync:
                os.fsync(self.fd)
            self.fsync_seconds += time.perf_counter() - start
        finally:
            self.release()

    def release(self) -> None:
        """Stop the worker (after its last block), close the descriptor, hand the buffers on to the next file."""
        self.worker.shutdown(wait=True)
        os.close(self.fd)
        BLOCKS.give(self.buffers)
        self.buffers = []  # another file's now: a write after close fails here, not in its bytes

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def open_direct(path: str | Path) -> tuple[int, bool]:
    """`path` opened for writing with O_DIRECT, or without it where the filesystem refuses it; (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | os.O_DIRECT, 0o666), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(path, flags, 0o666), False


def write_all(fd: int, view: memoryview) -> None:
    """os.write until every byte of `view` is written (a short write can happen on any filesystem)."""
    while len(view):
        view = view[os.write(fd, view):]


@dataclass
class Written:
    """Files written on rank `rank` by `write_hashed`: path and SHA-256 of each, their seconds, the first error."""

    rank: int
    written: list[tuple[Path, str]] = field(default_factory=list)
    error: str | None = None
    fsync_seconds: float = 0.0
    hash_seconds: float = 0.0

    def fail(self, err: BaseException, path: str | Path, doing: str = "writing") -> None:
        """Keep the first error, as one line naming this rank, what failed and where."""
        if self.error is None:
            self.error = describe_error(err, path, self.rank, doing)


def write_hashed(into: Written, path: Path, state: Any, serialise: Callable[[Any, DirectFile], Any]) -> bool:
    """`serialise(state, out)` into a DirectFile at `path`, recorded in `into`; False, the first error kept, if not."""
    try:
        with DirectFile(path) as out:
            serialise(state, out)
    except Exception as e:  # kept for the agreement, not raised; the partial file goes
        into.fail(e, path)
        path.unlink(missing_ok=True)
        return False
    into.written.append((path, out.hexdigest()))
    into.fsync_seconds += out.fsync_seconds
    into.hash_seconds += out.hash_seconds
    return True
