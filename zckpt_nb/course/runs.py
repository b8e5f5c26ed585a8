"""What starts a lesson's jobs: a command line run as the learner would type it, bounded; several jobs at once.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.errors import LaunchError, LaunchTimeout
from zckpt_nb.run.launch import kill_tree, read_lines
from zckpt_nb.run.logs import EXCEPTION_LINE

# The launchers a learner types, as this kernel's Python runs them (the same programs, whatever PATH holds).
PROGRAMS = {"torchrun": ["-m", "torch.distributed.run"], "deepspeed": ["-m", "deepspeed.launcher.runner"],
            "python": []}
NOISE = ("ChildFailedError", "Traceback")  # torchrun's own report of a failed rank: its ranks' lines say it better


@dataclass
class Job:
    """A finished command: what it printed (stdout and stderr, in order) and how long it ran."""

    command: str
    lines: list[str]
    seconds: float

    def said(self, prefix: str) -> list[str]:
        """The lines that start with `prefix` (what a worker printed on purpose, out of the launchers' noise)."""
        return [line for line in self.lines if line.startswith(prefix)]


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # `NAME=value` before a command, as a shell reads it


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """The `NAME=value` words in front of the command, and the command's words."""
    words = shlex.split(command)
    count = next((i for i, word in enumerate(words) if not ASSIGNMENT.match(word)), len(words))
    return dict(word.split("=", 1) for word in words[:count]), words[count:]


def argv(command: str) -> list[str]:
    """The command line as a list, its first word (`torchrun`, `deepspeed`, `python`) run by this kernel's Python."""
    words = split(command)[1]
    return [sys.executable, *PROGRAMS[words[0]], *words[1:]] if words[0] in PROGRAMS else words


def environment(command: str) -> dict[str, str]:
    """The kernel's environment (`DS_ACCELERATOR=cpu` for CPU ranks) with the command's own `NAME=value` words,
    unbuffered output and one CPU share per rank, so torchrun has no thread count of its own to warn about."""
    ranks = re.search(r"--nproc(?:[_-]per[_-]node)?[ =](\d+)|--num_gpus[ =](\d+)", command)  # torchrun, train
    n = int(next(g for g in ranks.groups() if g)) if ranks else 1
    env = dict(os.environ, PYTHONUNBUFFERED="1", **split(command)[0])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    return env


def failure(job: Job, code: int, log: Path | None) -> str:
    """A failed job in a few lines: the command and exit code, each distinct error line its ranks printed (else its
    last line), and where the log is."""
    errors = [line.strip() for line in job.lines if EXCEPTION_LINE.match(line.strip()) or "error:" in line.lower()]
    errors = [line for line in dict.fromkeys(errors) if not any(word in line for word in NOISE)]
    errors = errors or [line.strip() for line in job.lines if line.strip()][-1:]  # else its last word
    where = f"\n  every line it printed: {log}" if log else ""
    return f"`{job.command}` failed (exit code {code}) after {job.seconds:.1f} s" + "".join(
        f"\n  {line[:200]}" for line in errors[:6]) + where


def run(command: str, *, timeout: float, log: str | Path | None = None, echo: bool = True) -> Job:
    """Run `command` in its own process session; every process of it is killed past `timeout` s or on an interrupt.

    Its output is kept (and written to `log`), not printed; a failure raises a LaunchError of a few lines."""
    if echo:  # one write, line and newline together: jobs run by `together` echo from several threads at once
        sys.stdout.write(f"$ {command}\n")
        sys.stdout.flush()
    log = Path(log) if log else None
    start, lines = time.monotonic(), []
    proc = subprocess.Popen(argv(command), env=environment(command), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    try:
        lines.extend(read_lines(proc, start + timeout))
        proc.wait()
    except TimeoutError:
        raise LaunchTimeout(f"`{command}` ran past {timeout:.0f} s: every process of it was killed") from None
    finally:
        if proc.poll() is None:  # a timeout, an interrupt of the kernel, any error: leave no rank behind
            kill_tree(proc)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("\n".join(lines) + "\n")
    job = Job(command, lines, time.monotonic() - start)
    if proc.returncode:
        raise LaunchError(failure(job, proc.returncode, log))
    return job


def together(calls: dict[Hashable, Callable[[], Any]], keep_failures: bool = False) -> dict[Hashable, Any]:
    """Run every call in its own thread, all at once (small jobs spend most of their time starting up, and started
    together those overlap); their results by key once all have ended. A failure is raised (the first one), or with
    `keep_failures` returned in its key's place.

    Only for jobs whose figures are not seconds: they share the CPU. Each job has its own timeout, so this ends."""
    results: dict[Hashable, Any] = {}

    def one(key: Hashable) -> None:
        try:
            results[key] = calls[key]()
        except Exception as e:  # kept, so one failed job never hides the others' results
            results[key] = e

    threads = [threading.Thread(target=one, args=(key,)) for key in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results.values() if isinstance(r, Exception)]
    if failed and not keep_failures:
        raise failed[0]
    return {key: results[key] for key in calls}
