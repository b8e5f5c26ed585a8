"""Run a job on N ranks from a notebook cell (or the shell) through the real `torchrun` launcher.

Why a subprocess and not `torch.multiprocessing.spawn`: spawn cannot pickle functions defined in a
notebook, and a multi-GPU DeepSpeed job needs a real launcher anyway. The launcher runs in its own
session; on a timeout, an error or a kernel interrupt we kill it *and every descendant* (torchrun
starts each worker in a session of its own, so killing one process group is not enough).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt_nb import lifeline, lock
from zckpt_nb.model import get_preset
from zckpt_nb.nodes import ONE_NODE, Nodes
from zckpt_nb.verify import committed_tags

_PREFIX = re.compile(r"^\[default(\d+)\]:(?:\[rank\d+\]:)?")
_STEP = re.compile(r"^step (\d+)/(\d+) ")
LEADS = ("rank 0", "node 0 rank 0")  # the label of global rank 0, which prints the `step k/n` lines


class UsageError(ValueError):
    """Bad input, found before any rank starts."""


class LaunchError(RuntimeError):
    """The job started but failed; the message holds the last lines of every rank."""


class LaunchTimeout(LaunchError):
    """The job ran past its timeout and was killed with all its ranks."""


class LaunchStopped(LaunchError):
    """The job was stopped on request (its `stop` event was set) and killed with all its ranks."""


@dataclass
class RunResult:
    """What a training launch measured: `run.json` as an object, plus the launcher's own view."""

    output_dir: Path
    world_size: int
    backend: str
    device: str
    num_params: int
    vocab_size: int
    steps: list[int]
    losses: list[float]
    ranks: list[dict[str, Any]]
    data: dict[str, Any]
    log: list[str] = field(repr=False)
    launch_seconds: float

    @classmethod
    def from_dir(cls, output_dir: Path, log: list[str], seconds: float) -> RunResult:
        """Read `output_dir/run.json` written by rank 0."""
        data = json.loads((output_dir / "run.json").read_text())
        keys = ["world_size", "backend", "device", "num_params", "vocab_size", "steps", "losses", "ranks"]
        return cls(output_dir, **{k: data[k] for k in keys}, data=data, log=log, launch_seconds=seconds)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 on CPU-only machines or with DS_ACCELERATOR=cpu)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_writable(output_dir: Path) -> None:
    """Raise UsageError unless `output_dir` exists as a writable folder or can be created."""
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"output dir {output_dir} cannot be created: {probe} is a file; choose another --output_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"output dir {output_dir} cannot be written ({probe} is read-only or not yours); "
                         "choose another --output_dir")


def check_train_args(nproc: int, steps: int, output_dir: Path, *, resume: bool, model: str,
                     save_every: int = 0, timeout: float = 600, nodes: Nodes = ONE_NODE) -> None:
    """Reject bad training input with one clear line, before any rank starts."""
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {nproc})")
    if nodes.problem():
        raise UsageError(nodes.problem())
    gpus = gpu_count()
    if gpus and nproc > gpus:
        raise UsageError(f"--nproc {nproc} asks for more GPU ranks than the {gpus} GPU(s) here; use --nproc {gpus}")
    if steps < 1 or save_every < 0 or timeout <= 0:
        raise UsageError(f"--steps must be >= 1, --save_every >= 0 and --timeout > 0 "
                         f"(got {steps}, {save_every}, {timeout})")
    try:
        get_preset(model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_writable(output_dir)
    if resume and not committed_tags(output_dir):  # not `latest`: a crash may hit between manifest and latest
        raise UsageError(f"--resume: no committed checkpoint in {output_dir}; "
                         "train with --save_checkpoint first or point --output_dir at a checkpoint folder")


def worker_env(nproc: int) -> dict[str, str]:
    """Environment for the ranks: CPU ranks use DeepSpeed's CPU accelerator (gloo); who launched them (lifeline)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **lifeline.launcher_env())
    if not gpu_count():
        env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def torchrun_command(module: str, args: list[str], nproc: int, log_dir: str, nodes: Nodes = ONE_NODE) -> list[str]:
    """The torchrun command line for this node; `--tee 3` makes it prefix every line with the local rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            *nodes.torchrun_flags(free_port()), "--tee", "3", "--log-dir", log_dir, "-m", module, *args]


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Terminate the launcher and every process below it; SIGKILL whatever outlives `grace` seconds."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def read_lines(proc: subprocess.Popen, deadline: float, stop: threading.Event | None = None) -> Iterator[str]:
    """Yield the job's output lines as they come; end early once `stop` is set; raise TimeoutError past `deadline`."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
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


def step_of(text: str) -> tuple[int, int] | None:
    """(done, total) from a rank's `step k/n` line, else None."""
    m = _STEP.match(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


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
        step = step_of(text) if who in LEADS else None
        quiet_step = False
        if step:
            done, total = step
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
                  stop: threading.Event | None = None, nodes: Nodes = ONE_NODE) -> tuple[list[str], float]:
    """Run `python -m module args` on `nproc` ranks (of this node); return (all output lines, seconds). Never hangs.

    `on_line(who, text)` sees every line; setting `stop` (from any thread) kills every rank and raises LaunchStopped.
    """
    log: list[str] = []
    per_rank: dict[str, deque] = defaultdict(lambda: deque(maxlen=12))
    shown = Progress(name, verbose, progress)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zckpt_torchrun_") as log_dir:
        proc = subprocess.Popen(torchrun_command(module, args, nproc, log_dir, nodes), env=worker_env(nproc),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
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


def train_args(steps: int, output_dir: Path, *, save_checkpoint: bool, save_every: int, resume: bool,
               model: str, seed: int, extra: list[str]) -> list[str]:
    """The worker's command-line flags for one training launch."""
    args = ["--steps", str(steps), "--output_dir", str(output_dir), "--model", model, "--seed", str(seed),
            "--save_every", str(save_every)]
    args += ["--save_checkpoint"] if save_checkpoint else []
    args += ["--resume"] if resume else []
    return args + extra


def default_timeout(model: str, nproc: int, steps: int) -> float:
    """A generous bound for one launch: start-up plus the preset's step time, scaled by ranks per CPU core.

    Only a bound (a hung job must end); it is no performance claim. On GPUs it is far more than needed.
    """
    per_step = {"tiny": 0.2, "small": 1.5, "medium": 15.0, "large": 60.0}.get(model, 60.0)
    crowding = max(1.0, nproc / (os.cpu_count() or 1))
    return 300 + crowding * (60 * nproc + per_step * steps * 3)


def launch(nproc: int = 2, steps: int = 150, output_dir: str | Path = "runs/tiny", *, save_checkpoint: bool = False,
           save_every: int = 0, resume: bool = False, model: str = "tiny", seed: int = 0,
           timeout: float | None = None, persistence_threshold: int = 0, extra: list[str] | None = None,
           verbose: bool = True, progress: bool = True, on_line: Callable[[str, str], None] | None = None,
           stop: threading.Event | None = None, nodes: Nodes = ONE_NODE) -> RunResult:
    """Train `model` with ZeRO-3 on `nproc` ranks (GPUs if present, else CPU) and return its measurements.

    `timeout=None` scales the bound with the preset, the steps and the ranks (`default_timeout`). `on_line` and
    `stop` go to `launch_module`: every output line, and an event that stops the job from any thread. On several
    nodes, call it once per node with its `nodes` (`zckpt_nb.nodes`); `nproc` is the ranks of each node.
    """
    timeout = timeout or default_timeout(model, nproc, steps)
    extra = [*(extra or []), "--persistence_threshold", str(persistence_threshold)]
    output_dir = Path(output_dir).resolve()
    check_train_args(nproc, steps, output_dir, resume=resume, model=model, save_every=save_every, timeout=timeout,
                     nodes=nodes)
    output_dir.mkdir(parents=True, exist_ok=True)
    args = train_args(steps, output_dir, save_checkpoint=save_checkpoint, save_every=save_every,
                      resume=resume, model=model, seed=seed, extra=extra)
    where = f" of node {nodes.node_rank} ({nodes.nnodes} nodes)" if nodes.nnodes > 1 else ""
    name = f"train {model} on {nproc} rank(s){where} -> {output_dir}"
    try:
        mine = lock.take(output_dir, nodes.job(), nodes.node_rank)  # after the checks, before any write
    except lock.FolderInUse as e:
        raise UsageError(str(e)) from None
    try:
        (output_dir / "run.json").unlink(missing_ok=True)  # never report a previous launch's figures
        log, seconds = launch_module("zckpt_nb.train", args, nproc=nproc, timeout=timeout, name=name,
                                     log_path=output_dir / log_name(nodes), verbose=verbose, progress=progress,
                                     on_line=on_line, stop=stop, nodes=nodes)
    finally:
        lock.release(output_dir, mine)
    return RunResult.from_dir(output_dir, log, seconds)


def log_name(nodes: Nodes) -> str:
    """The launcher's log in the output folder: `launch.log`, `launch.node{K}.log` for the other nodes' launchers."""
    return f"launch.node{nodes.node_rank}.log" if nodes.node_rank else "launch.log"


def fresh_dir(path: str | Path) -> Path:
    """Empty (or create) `path` so a notebook re-run starts from nothing; returns it resolved."""
    path = Path(path).resolve()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def rank_lines(output_dir: str | Path, last: int = 3, skip: str = r"^step \d+/") -> dict[str, list[str]]:
    """What each rank really printed (from DIR/launch.log): its last `last` lines, progress lines skipped."""
    import re

    lines: dict[str, list[str]] = {}
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        m = re.match(r"\[((?:node \d+ )?rank \d+)\] (.*)", line)
        if m and not re.match(skip, m.group(2)):
            lines.setdefault(m.group(1), []).append(m.group(2))
    return {who: found[-last:] for who, found in sorted(lines.items())}


def worker_error(err: LaunchError) -> str:
    """The one line a rank printed for a refused job (`zckpt_nb.train: error: ...`), out of the launch's message."""
    lines = [line.strip() for line in str(err).splitlines() if "zckpt_nb.train: error:" in line]
    return lines[0] if lines else str(err).splitlines()[0]


def rank_errors(output_dir: str | Path) -> dict[str, str]:
    """The last exception line each rank printed (from DIR/launch.log): what a failed job said, rank by rank."""
    pattern = re.compile(r"^[\w.]*(Error|Exception)\b")  # a traceback's last line, not its `raise ...` lines
    found = {who: [line.strip() for line in lines] for who, lines in rank_lines(output_dir, last=10**6).items()}
    return {who: next((line for line in reversed(lines) if pattern.match(line)), "(no exception)")
            for who, lines in found.items()}


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
