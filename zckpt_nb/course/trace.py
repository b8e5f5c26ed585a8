"""A command's resident memory over time, sampled from outside, with the kernel's exact peak.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Trace:
    """A command's resident memory over time, sampled from outside, and its exact peak from the kernel."""

    command: list[str]
    seconds: list[float]  # sample times since the start
    anon: list[int]  # RssAnon at each sample: memory the process allocated
    file: list[int]  # RssFile + RssShmem: mapped file pages (e.g. memory-mapped checkpoint shards)
    wall: float
    peak_bytes: int  # the kernel's high-water mark of RSS (VmHWM), whatever the sampling missed in between
    returncode: int
    output: str


def rss_parts(pid: int) -> tuple[int, int, int] | None:
    """(anonymous, file-backed, high-water mark) resident bytes of process `pid` from /proc, or None once gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        kib = {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile", "RssShmem", "VmHWM")}
    except (OSError, KeyError, ValueError):
        return None
    return kib["RssAnon"], kib["RssFile"] + kib["RssShmem"], kib["VmHWM"]


def sample(trace: Trace, pid: int, seconds: float) -> bool:
    """Append one sample of process `pid`, taken `seconds` after the start, to `trace`; False once it is gone."""
    if (parts := rss_parts(pid)) is None:
        return False
    trace.seconds.append(seconds)
    trace.anon.append(parts[0])
    trace.file.append(parts[1])
    trace.peak_bytes = max(trace.peak_bytes, parts[2])
    return True


def trace_command(command: list[str], *, interval: float = 0.02, timeout: float = 1800,
                  env: dict[str, str] | None = None) -> Trace:
    """Run `command`, sampling its RSS every `interval` s from this process (so it is not slowed); kill its process
    group after `timeout` s.

    The peak is the kernel's high-water mark of the command's own memory (`VmHWM`, which exec starts afresh), read
    at every sample. Not `ru_maxrss` from `wait4`: Linux carries into it the RSS of the forked copy of this process
    before exec, so a large parent (a Jupyter kernel) would hide a smaller child's peak.
    """
    import os
    import signal
    import subprocess
    import tempfile

    trace = Trace(list(command), [], [], [], 0.0, 0, 0, "")
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while not (done := os.wait4(proc.pid, os.WNOHANG))[0]:
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
            sample(trace, proc.pid, time.perf_counter() - start)
            time.sleep(interval)
        trace.wall = time.perf_counter() - start
        proc.returncode = trace.returncode = os.waitstatus_to_exitcode(done[1])
        log.seek(0)
        trace.output = log.read().decode(errors="replace")
    return trace


@contextmanager
def children(*, interval: float = 0.02) -> Iterator[dict[int, Trace]]:
    """While the block runs, sample from a thread every process this one starts (its direct children, listed in
    /proc/self/task/*/children) as `trace_command` samples its one: RSS parts every `interval` s and the kernel's
    peak. Yields a dict that fills as the block runs: a Trace by pid, its `command` read from /proc/PID/cmdline. A
    child is traced from its exec on (a sample taken before, on the forked copy of this process, is dropped); `wall`,
    `returncode` and `output` are left to whatever ran it."""
    import threading

    traces: dict[int, Trace] = {}
    stop, start = threading.Event(), time.perf_counter()
    own = Path("/proc/self/cmdline").read_bytes()

    def watch() -> None:
        while not stop.is_set():
            pids = set()
            for listing in Path("/proc/self/task").glob("*/children"):
                try:
                    pids.update(int(pid) for pid in listing.read_text().split())
                except OSError:
                    continue
            for pid in pids:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if cmdline == own or not cmdline:  # not exec'd yet
                    continue
                command = cmdline.decode(errors="replace").split("\0")[:-1]
                trace = traces.get(pid)
                fresh = trace is None or trace.command != command
                if fresh:
                    trace = Trace(command, [], [], [], 0.0, 0, 0, "")
                if sample(trace, pid, time.perf_counter() - start) and fresh:
                    traces[pid] = trace
            stop.wait(interval)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield traces
    finally:
        stop.set()
        thread.join()
