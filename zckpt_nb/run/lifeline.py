"""Ranks die with their launcher, whatever kills it; the CLI treats SIGTERM and SIGHUP like Ctrl-C.

torchrun starts each rank in a session of its own: a signal to the launcher's group never reaches them, and a
launcher killed by SIGKILL cannot clean up. So every rank (`arm`) asks the kernel to kill it with its parent
(`PR_SET_PDEATHSIG`) and runs a watchdog that ends it once its parent or the process that called `launch`
(`ZCKPT_LAUNCHER`) is gone. A finished rank leaves without the interpreter's teardown (`leave`), where a gloo thread
can still abort it (SIGABRT, "terminate called without an active exception").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from zckpt_nb.saving.process_writer import die_with_parent

LAUNCHER_ENV = "ZCKPT_LAUNCHER"


def identity(pid: int) -> str:
    """`pid:start_time`: names one process even after its pid is reused."""
    import psutil

    return f"{pid}:{psutil.Process(pid).create_time()}"


def alive(pid: int, started: float) -> bool:
    """Is process `pid`, started at `started`, still running (a zombie or a reused pid counts as gone)?"""
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launcher_env() -> dict[str, str]:
    """What `launch` adds to the ranks' environment: the identity of the calling process."""
    return {LAUNCHER_ENV: identity(os.getpid())}


def watch(parent: int, launcher: tuple[int, float] | None, period: float) -> None:
    """The watchdog's loop: end this rank with one line once its parent or the launcher is gone."""
    while os.getppid() == parent and not (launcher and not alive(*launcher)):
        time.sleep(period)
    why = f"its parent (torchrun, pid {parent}) is gone" if os.getppid() != parent else \
        f"the launching process (pid {launcher[0]}) is gone"
    print(f"rank {os.environ.get('RANK', '?')}: stopping: {why}; no rank may train on alone", file=sys.stderr,
          flush=True)
    os._exit(1)  # from a thread: sys.exit would end only the watchdog


def arm(period: float = 1.0) -> None:
    """Make this rank die with torchrun (kernel) and with the launching process (watchdog thread)."""
    parent = os.getppid()
    die_with_parent()
    spec = os.environ.get(LAUNCHER_ENV)
    launcher = (int(spec.split(":")[0]), float(spec.split(":")[1])) if spec else None
    threading.Thread(target=watch, args=(parent, launcher, period), name="zckpt-lifeline", daemon=True).start()


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the launcher: unwound like Ctrl-C, so `launch` stops every rank."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def signals_interrupt(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block (main thread only), `signums` raise `Stopped` instead of ending the process at once."""

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def leave(code: int = 0) -> NoReturn:
    """End this rank now with `code`, its output flushed, skipping the teardown where gloo can abort a finished job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
