"""Read the next items in a thread while the caller writes the one before: conversions overlap their reads and writes.

At most `slots` items are in memory at once (the one being written and those read ahead). Memory-mapped reads and
the hashing writer release the GIL for their long parts, so they overlap even on few cores.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any


class Prefetch:
    """`read(key)` for each of `keys` in a thread; `get(key)` hands them out in order, releasing the one before."""

    def __init__(self, read: Callable[[Any], Any], keys: Iterable[Any], slots: int = 2) -> None:
        self.ready: queue.Queue[tuple[Any, Any, BaseException | None]] = queue.Queue()
        self.free = threading.Semaphore(slots - 1)  # the caller holds one slot: the item it writes
        self.stop, self.holding = threading.Event(), False
        self.thread = threading.Thread(target=self.run, args=(read, list(keys)), daemon=True,
                                       name="zckpt-prefetch")
        self.thread.start()

    def run(self, read: Callable[[Any], Any], keys: list[Any]) -> None:
        for key in keys:
            while not self.free.acquire(timeout=0.1):
                if self.stop.is_set():
                    return
            if self.stop.is_set():
                return
            try:
                self.ready.put((key, read(key), None))
            except BaseException as error:  # handed to the caller's get
                self.ready.put((key, None, error))
                return

    def get(self, key: Any) -> Any:
        """The item read for `key` (the next in order); the item before is released."""
        if self.holding:
            self.free.release()
        got, value, error = self.ready.get()
        self.holding = True
        if error is not None:
            raise error
        if got != key:
            raise RuntimeError(f"prefetch order: asked for {key!r}, read {got!r}")
        return value

    def close(self) -> None:
        """Stop the reader and drop what it read ahead."""
        self.stop.set()
        self.free.release()  # a reader waiting for a slot wakes and sees `stop`
        self.thread.join()
        while not self.ready.empty():
            self.ready.get_nowait()
