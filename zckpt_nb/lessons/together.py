"""Jobs started at once: a small job spends most of its time starting up, and started together those overlap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


def together(calls: dict[Hashable, Callable[[], Any]]) -> dict[Hashable, Any]:
    """Run every call in its own thread, all at once; each one's result, or the exception it raised, by key.

    Only for jobs whose figures are not seconds: they share the CPU. Every job has its own timeout (`launch`), so
    joining the threads cannot hang."""
    results: dict[Hashable, Any] = {}

    def one(key: Hashable) -> None:
        try:
            results[key] = calls[key]()
        except Exception as e:  # handed back, so one failed job never hides the others' results
            results[key] = e

    threads = [threading.Thread(target=one, args=(key,)) for key in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {key: results[key] for key in calls}


def all_done(results: dict[Hashable, Any], *keys: Hashable) -> dict[Hashable, Any]:
    """The results of `together` under `keys` (every key when none is named) when none of them failed; the first
    failure's exception raised otherwise."""
    chosen = {key: results[key] for key in keys or results}
    failed = [r for r in chosen.values() if isinstance(r, Exception)]
    if failed:
        raise failed[0]
    return chosen
