"""Run a job on N ranks through the real `torchrun` launcher, in its own session: on a timeout, an error or an
interrupt it and every descendant are killed (torchrun starts each rank in a session of its own). Not
`torch.multiprocessing.spawn`: it cannot pickle functions defined in `__main__`, and GPUs need a real launcher."""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt_nb.errors import LaunchError, LaunchStopped, LaunchTimeout, UsageError
from zckpt_nb.format.disk import check_writable
from zckpt_nb.format.layout import committed_tags
from zckpt_nb.format.records import RunRecord
from zckpt_nb.format.units import counted
from zckpt_nb.run import lifeline, lock
from zckpt_nb.run.devices import CPU_HINT, Placement, gpu_count
from zckpt_nb.run.nodes import ONE_NODE, Nodes
from zckpt_nb.run.options import TrainOptions

_PREFIX = re.compile(r"^\[default(\d+)\]:(?:\[rank\d+\]:)?")
_STEP = re.compile(r"^step (\d+)/(\d+) ")
LEADS = ("rank 0", "node 0 rank 0")  # the label of global rank 0, which prints the `step k/n` lines


@dataclass
class RunResult(RunRecord):
    """A finished training launch: its run.json (a `RunRecord`), where it ran, its output lines and seconds."""

    output_dir: Path = Path()
    log: list[str] = field(default_factory=list, repr=False)
    launch_seconds: float = 0.0

    @classmethod
    def from_dir(cls, output_dir: Path, log: list[str], seconds: float) -> RunResult:
        """Read `output_dir/run.json`, written by rank 0."""
        return cls(**vars(RunRecord.read(output_dir)), output_dir=output_dir, log=log, launch_seconds=seconds)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpus_for(placement: Placement | None) -> int:
    """The GPUs a launch's ranks may use: none for CPU ranks, else every GPU here."""
    return 0 if placement is not None and placement.accelerator == "cpu" else gpu_count()


def check_train_args(nproc: int, opts: TrainOptions, *, timeout: float = 600, nodes: Nodes = ONE_NODE,
                     placement: Placement | None = None) -> None:
    """Reject bad training input with one clear line, before any rank starts."""
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {nproc})")
    if nodes.problem():
        raise UsageError(nodes.problem())
    gpus = gpus_for(placement)
    if gpus and nproc > gpus:
        raise UsageError(f"--nproc {nproc} asks for more GPU ranks than the {counted(gpus, 'GPU')} here (NCCL needs "
                         f"one GPU per rank); use --nproc {gpus}, or set {CPU_HINT}")
    if opts.steps < 1 or opts.save_every < 0 or timeout <= 0:
        raise UsageError(f"--steps must be >= 1, --save_every >= 0 and --timeout > 0 "
                         f"(got {opts.steps}, {opts.save_every}, {timeout})")
    output_dir = Path(opts.output_dir)
    check_writable(output_dir)
    if opts.resume and not committed_tags(output_dir):  # not `latest`: a crash may hit between manifest and latest
        raise UsageError(f"--resume: no committed checkpoint in {output_dir}; "
                         "train with --save_checkpoint first or point --output_dir at a checkpoint folder")


def worker_env(nproc: int, placement: Placement | None = None) -> dict[str, str]:
    """Environment for the ranks: accelerator, lifeline, and the placement's devices."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **lifeline.launcher_env())
    if not gpus_for(placement):  # CPU ranks, asked for or for want of GPUs
        env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Terminate the launcher and every process below it; SIGKILL whatever outlives `grace` seconds."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with suppress(psutil.NoSuchProcess):  # gone meanwhile
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def read_lines(proc: subprocess.Popen, deadline: float, stop: threading.Event | None = None) -> Iterator[str]:
    """Yield the job's output lines as they come; end early once `stop` is set; raise TimeoutError past `deadline`."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        with proc.stdout:  # type: ignore[union-attr]  # closed at the end of the output, which every exit path reaches
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while stop is None or not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            line = lines.get(timeout=min(left, 0.25))
        except queue.Empty:
            continue
        if line is None:
            return
        yield line


def label(line: str, nproc: int = 1, nodes: Nodes = ONE_NODE) -> tuple[str, str]:
    """Split torchrun's `[defaultN]:` prefix (N: local rank) off a line: (`nodes.who`, text) or ('launcher', line)."""
    m = _PREFIX.match(line)
    return (nodes.who(int(m.group(1)), nproc), line[m.end():]) if m else ("launcher", line)


class Progress:
    """A tqdm.auto bar that follows rank 0's `step k/n` lines and prints every line above it."""

    def __init__(self, name: str, show_lines: bool, show_bar: bool) -> None:
        from tqdm.auto import tqdm

        self._tqdm, self.bar, self.show_lines, self.show_bar, self.name = tqdm, None, show_lines, show_bar, name

    def line(self, who: str, text: str) -> None:
        step = _STEP.match(text) if who in LEADS else None  # a rank's `step k/n` line
        quiet_step = False
        if step:
            done, total = int(step.group(1)), int(step.group(2))
            quiet_step = done % max(1, total // 10) != 0 and done not in (1, total)  # the bar shows every step
            if self.show_bar:
                if self.bar is None:
                    self.bar = self._tqdm(total=total, initial=done - 1, desc=self.name, unit="step")
                self.bar.update(done - self.bar.n)
        if self.show_lines and not quiet_step:
            self._tqdm.write(f"[{who}] {text}", file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tails(per_rank: dict[str, deque]) -> str:
    """The last lines of every rank, for an error message."""
    return "\n".join(f"--- last lines of {who} ---\n" + "\n".join(lines) for who, lines in sorted(per_rank.items()))


def keep_log(path: Path, log: list[str]) -> None:
    """Write the job's output to `path`; a full or read-only disk is reported, never hides the job's own outcome."""
    try:
        path.write_text("\n".join(log) + "\n")
    except OSError as e:
        print(f"zckpt_nb: could not write the job's log to {path}: {e}", file=sys.stderr)


def launch_module(module: str, args: list[str], *, nproc: int, timeout: float, name: str,
                  log_path: Path | None = None, verbose: bool = True, progress: bool = True,
                  on_line: Callable[[str, str], None] | None = None,
                  stop: threading.Event | None = None, nodes: Nodes = ONE_NODE,
                  placement: Placement | None = None) -> tuple[list[str], float]:
    """Run `python -m module args` on `nproc` ranks; (output lines, seconds). Never hangs."""
    log: list[str] = []
    per_rank: dict[str, deque] = defaultdict(lambda: deque(maxlen=12))
    shown = Progress(name, verbose, progress)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zckpt_torchrun_") as log_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   *nodes.torchrun_flags(free_port()), "--tee", "3",  # --tee 3: every line prefixed by its local rank
                   "--log-dir", log_dir, "-m", module, *args]
        proc = subprocess.Popen(command, env=worker_env(nproc, placement), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        try:
            for raw in read_lines(proc, start + timeout, stop):
                who, text = label(raw, nproc, nodes)
                log.append(f"[{who}] {text}")
                per_rank[who].append(text)
                shown.line(who, text)
                if on_line:
                    on_line(who, text)
            if stop is not None and stop.is_set():
                kill_tree(proc)
                raise LaunchStopped(f"job '{name}' was stopped; all ranks were killed")
            proc.wait()
        except TimeoutError:
            kill_tree(proc)
            raise LaunchTimeout(f"job '{name}' timed out after {timeout:.0f} s; all ranks were killed\n"
                                + tails(per_rank)) from None
        finally:
            shown.close()
            if proc.poll() is None:  # KeyboardInterrupt or any other exit path: leave no orphan rank
                kill_tree(proc)
            if log_path is not None and log_path.parent.is_dir():
                keep_log(log_path, log)
    if proc.returncode != 0:
        raise LaunchError(f"job '{name}' failed (exit code {proc.returncode})\n" + tails(per_rank))
    return log, time.monotonic() - start


def launch(nproc: int = 2, steps: int = 150, output_dir: str | Path = "runs/tiny", *, timeout: float | None = None,
           verbose: bool = True, progress: bool = True, on_line: Callable[[str, str], None] | None = None,
           stop: threading.Event | None = None, nodes: Nodes = ONE_NODE, placement: Placement | None = None,
           worker: str = "zckpt_nb.train", **options: Any) -> RunResult:
    """Train on `nproc` ranks (GPUs if present, else CPU) and return its run.json as a `RunResult`."""
    try:  # where `python -m worker` finds no module (a missing parent package raises)
        found = importlib.util.find_spec(worker) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UsageError(f"--worker {worker}: no such module; give zckpt_nb.train, zckpt_nb.train_fsdp or a module "
                         "that takes the worker's flags")
    output_dir = Path(output_dir).resolve()
    opts = TrainOptions.build(steps=steps, output_dir=str(output_dir), **options)
    if not timeout:  # a generous bound: start-up plus the preset's step time, scaled by ranks per core
        per_step = {"tiny": 0.2, "small": 1.5, "medium": 15.0, "large": 60.0}.get(opts.model, 60.0)
        timeout = 300 + max(1.0, nproc / (os.cpu_count() or 1)) * (60 * nproc + per_step * steps * 3)
    check_train_args(nproc, opts, timeout=timeout, nodes=nodes, placement=placement)
    output_dir.mkdir(parents=True, exist_ok=True)
    where = f" of node {nodes.node_rank} ({nodes.nnodes} nodes)" if nodes.nnodes > 1 else ""
    name = f"train {opts.model} on {counted(nproc, 'rank')}{where} -> {output_dir}"
    mine = lock.take(output_dir, nodes.job(), nodes.node_rank)  # after the checks, before any write (a UsageError)
    log_name = f"launch.node{nodes.node_rank}.log" if nodes.node_rank else "launch.log"  # one per node's launcher
    try:
        (output_dir / "run.json").unlink(missing_ok=True)  # never report a previous launch's figures
        log, seconds = launch_module(worker, opts.argv(), nproc=nproc, timeout=timeout, name=name,
                                     log_path=output_dir / log_name, verbose=verbose, progress=progress,
                                     on_line=on_line, stop=stop, nodes=nodes, placement=placement)
    finally:
        lock.release(output_dir, mine)
    return RunResult.from_dir(output_dir, log, seconds)
