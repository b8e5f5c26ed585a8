"""Read the next item in a thread while the caller writes the one before: conversions overlap their reads and writes.

At most two items are in memory at once: the one the caller writes and the one read ahead (the caller drops an item
before it asks for the next). Memory-mapped reads and the hashing writer release the GIL for their long parts, so they
overlap even on few cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

END = object()  # no key left


class Prefetch:
    """`read(key)` for each of `keys` in a thread, one ahead of the caller; `get(key)` hands them out in order."""

    def __init__(self, read: Callable[[Any], Any], keys: Iterable[Any]) -> None:
        self.read, self.keys = read, iter(keys)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zckpt-prefetch")
        self.ahead = self.start_next()

    def start_next(self) -> tuple[Any, Future[Any]] | None:
        """Start reading the next key, if there is one."""
        key = next(self.keys, END)
        return None if key is END else (key, self.pool.submit(self.read, key))

    def get(self, key: Any) -> Any:
        """The item read for `key`, the next in order (its read's error is raised here); the next read starts."""
        if self.ahead is None or self.ahead[0] != key:
            raise RuntimeError(f"prefetch order: asked for {key!r}, the next read is {self.ahead and self.ahead[0]!r}")
        value = self.ahead[1].result()
        self.ahead = self.start_next()
        return value

    def close(self) -> None:
        """Wait for the read in flight, drop it and stop the thread."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ahead = None
