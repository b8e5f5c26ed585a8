"""Notebook 02: why a launcher and not `torch.multiprocessing.spawn`, run and bounded.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any


def try_spawn(fn: Callable[[int], Any], nprocs: int = 2, timeout: float = 60.0) -> str:
    """Start `fn` on `nprocs` processes with `torch.multiprocessing` (spawn), as a notebook would; say what happened.

    Bounded: the children are killed after `timeout` seconds. The children's stderr (where an error before `fn`
    runs goes) is captured, so the returned line holds their last error line, not only an exit code.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)  # the children inherit this stderr
        try:
            context = mp.start_processes(fn, nprocs=nprocs, join=False, start_method="spawn")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        outcome = wait_for(context, nprocs, timeout)
        err.seek(0)
        errors = [line for line in err.read().decode(errors="replace").splitlines() if "Error" in line]
    return outcome + (f"; the children said: {errors[-1].strip()}" if errors else "")


def wait_for(context: Any, nprocs: int, timeout: float) -> str:
    """Join spawned processes for at most `timeout` seconds, then kill what is left; how they ended, in one line."""
    import torch.multiprocessing as mp

    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                return f"still running after {timeout:.0f} s: killed"
        return f"all {nprocs} processes finished without error"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        return str(e).strip().splitlines()[0]
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
