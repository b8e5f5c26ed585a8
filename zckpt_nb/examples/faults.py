"""Real faults on demand, for the tests and the lessons: the package's worker with `ZCKPT_FAULT=point:rank:step[:s]`.

`launch(..., worker="zckpt_nb.examples.faults")` runs the package's training worker with `FaultyEngine`, a subclass
of its checkpoint engine that injects the fault from outside the save path: when rank `rank` reaches `point` of the
save at step `step`, it SIGKILLs itself
(`shards`: between its two files; `background`: the same in an asynchronous save's background write;
`before_commit`: its files written, before the agreement; `latest`: the manifest durable, before `latest` moves;
each after `seconds` if given), stalls like a write to a hung network filesystem (`stall`, for `seconds`), or fills
the target filesystem as a neighbour job's temporary file would (`fill`, removed once a write has met the full
disk). Nothing is mocked: the files, errors and dead processes are real.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from zckpt_nb.format.layout import tag_step
from zckpt_nb.saving.engine import SNAPSHOT, Files, ZckptEngine

KILL_POINTS = ("shards", "before_commit", "latest", "background")
POINTS = (*KILL_POINTS, "stall", "fill")
FILL_LIMIT = 2**30  # refuse to fill a filesystem with more free space than this: only small test mounts
PATIENCE = 60  # seconds KilledMidSave's victim waits at most for the other ranks before its kill


def parse(spec: str) -> tuple[str, int, int, float]:
    """Split `point:rank:step[:seconds]`; ValueError naming the known points otherwise."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in POINTS:
        raise ValueError(f"ZCKPT_FAULT={spec!r}: expected point:rank:step[:seconds] with point in {', '.join(POINTS)}")
    return parts[0], int(parts[1]), int(parts[2]), float(parts[3]) if len(parts) == 4 else 0.0


def armed(point: str, rank: int, step: int) -> float | None:
    """The fault's seconds argument when ZCKPT_FAULT names this point, rank and step; else None."""
    spec = os.environ.get("ZCKPT_FAULT")
    if not spec:
        return None
    name, at_rank, at_step, seconds = parse(spec)
    return seconds if (name, at_rank, at_step) == (point, rank, step) else None


FILLER = ".zckpt_fill"
PROTOCOL_POINTS = {"written": "before_commit", "latest": "latest"}  # ZckptEngine.protocol_point -> fault point


def fill(directory: Path) -> None:
    """Write a filler file into `directory` until its filesystem is full (ENOSPC), as a neighbour job would."""
    if shutil.disk_usage(directory).free > FILL_LIMIT:
        raise RuntimeError(f"ZCKPT_FAULT fill refused: {directory} has more than 1 GiB free; use a small mount")
    block = b"\0" * 2**16
    try:
        with open(directory / FILLER, "ab") as f:
            while True:
                f.write(block)
                f.flush()
    except OSError:
        pass


def maybe(point: str, rank: int, step: int, directory: Path | None = None) -> None:
    """Inject the fault ZCKPT_FAULT asks for at this point, if any."""
    seconds = armed(point, rank, step)
    if seconds is None:
        return
    print(f"ZCKPT_FAULT: rank {rank} injects '{point}' at step {step}", flush=True)
    if point in KILL_POINTS:
        time.sleep(seconds)  # a slow write before the crash: the other ranks get that long to run ahead
        os.kill(os.getpid(), signal.SIGKILL)
    elif point == "stall":
        time.sleep(seconds)
    elif point == "fill" and directory is not None:
        fill(directory)


class FaultyEngine(ZckptEngine):
    """The package's checkpoint engine with the fault ZCKPT_FAULT names; the rank is torchrun's RANK, the step the
    one of the tag DeepSpeed is saving."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.rank, self.step, self.saved = int(os.environ.get("RANK", 0)), -1, 0

    def create(self, info: Any) -> Any:
        self.step, self.saved = tag_step(info.tag), 0  # DeepSpeed's first call of every save
        return super().create(info)

    def save(self, state_dict: Any, path: str) -> None:
        maybe("stall", self.rank, self.step)
        if self.saved:
            maybe("shards", self.rank, self.step)
        else:
            maybe("fill", self.rank, self.step, Path(path).parent.parent)
        self.saved += 1
        super().save(state_dict, path)

    def write_file(self, state_dict: Any, path: Path, files: Files) -> None:
        if files.written and files.how == SNAPSHOT:
            maybe("background", self.rank, self.step)
        try:
            super().write_file(state_dict, path, files)
        finally:  # the neighbour's file goes once a write has met the full disk: later saves and run.json fit
            if armed("fill", self.rank, self.step) is not None:
                (path.parent.parent / FILLER).unlink(missing_ok=True)

    def protocol_point(self, point: str) -> None:
        maybe(PROTOCOL_POINTS[point], self.rank, self.step)


@contextmanager
def injected(spec: str | None) -> Iterator[None]:
    """Set ZCKPT_FAULT for the launches inside the block (ranks inherit it), then clear it. None: no fault."""
    if spec is None:
        yield
        return
    parse(spec)
    os.environ["ZCKPT_FAULT"] = spec
    try:
        yield
    finally:
        del os.environ["ZCKPT_FAULT"]


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[str | None]:
    """Mount a real tmpfs (a small disk) at `path` for the block; yields None, or why it could not (needs root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        yield f"cannot mount a tmpfs at {path} (needs root): {done.stderr.strip() or done.returncode}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# Notebook 05's harness for its hand-written jobs (first_job.py, saves_job.py): real failures, made to happen on
# purpose, and a failed write kept for the notebook's `commit` rather than raised. Not for copying into a real job.


class FullOnRank(TorchCheckpointEngine):
    """DeepSpeed's default writer (one torch.save per file), but rank `victim` writes into /dev/full, where every
    write fails (ENOSPC). The first error is kept in `error` for `commit`, not raised: the rank still runs
    DeepSpeed's save to its end, through its closing barrier."""

    def __init__(self, serialization: bool, rank: int, victim: int) -> None:
        super().__init__()  # no config: the one setting it reads is passed in
        self.zipfile_serialization = serialization  # as DeepSpeed's own engine has it
        self.rank, self.victim, self.error = rank, victim, None

    def save(self, state_dict: Any, path: str) -> None:
        try:
            if self.rank == self.victim:
                with open("/dev/full", "wb") as f:  # every write to it fails: ENOSPC
                    torch.save(state_dict, f)
            else:
                super().save(state_dict, path)
        except Exception as e:  # the first error, for commit()
            self.error = self.error or f"{type(e).__name__} writing {os.path.basename(path)}: {e}"


class KilledMidSave(TorchCheckpointEngine):
    """DeepSpeed's default writer (one torch.save per file); in the save whose path holds `/{tag}/`, rank `victim`
    writes its first file, waits until the other ranks have finished theirs (and, with `until_latest`, until rank 0
    has moved `latest` to the tag), at most PATIENCE s, then kills itself: kill -9, no Python cleanup."""

    def __init__(self, serialization: bool, rank: int, victim: int, tag: str, until_latest: bool) -> None:
        super().__init__()
        self.zipfile_serialization = serialization  # as DeepSpeed's own engine has it
        self.rank, self.victim, self.tag, self.until_latest = rank, victim, tag, until_latest

    def save(self, state_dict: Any, path: str) -> None:
        super().save(state_dict, path)
        if self.rank == self.victim and f"/{self.tag}/" in path:
            deadline = time.monotonic() + PATIENCE  # polled, not a fixed sleep: a busy machine slows the others
            while not self.others_done(Path(path).parent) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    def others_done(self, folder: Path) -> bool:
        """Whether every other rank's two files in `folder` are whole (a zip's directory, which torch.save writes
        last, is there) and, with `until_latest`, `latest` beside `folder` names the tag."""
        others = [r for r in range(dist.get_world_size()) if r != self.victim]
        whole = all(any(zipfile.is_zipfile(p) for p in folder.glob(f"*zero_pp_rank_{r}_mp_rank_*_{kind}.pt"))
                    for r in others for kind in ("model_states", "optim_states"))
        try:
            latest = (folder.parent / "latest").read_text().strip()
        except OSError:
            latest = None
        return whole and (latest == self.tag or not self.until_latest)


class KeepErrors(TorchCheckpointEngine):
    """DeepSpeed's default writer; a failed folder or write is kept in `error` for `commit`, not raised, so the rank
    runs DeepSpeed's save to its end, through its closing barrier (a rank that raised would skip it, and the others
    would wait there)."""

    def __init__(self, serialization: bool) -> None:
        super().__init__()
        self.zipfile_serialization, self.error = serialization, None

    def keep(self, e: BaseException, path: str) -> None:
        while not isinstance(e, OSError) and e.__context__ is not None:  # the OSError under what torch raised over it
            e = e.__context__
        what = f"{errno.errorcode.get(e.errno, '?')} ({e.strerror})" if isinstance(e, OSError) else repr(e)
        self.error = self.error or f"{what} at {os.path.basename(path)}"

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            super().makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.keep(e, path)

    def save(self, state_dict: Any, path: str) -> None:
        try:
            with open(path, "wb") as f:  # a file object: a full disk raises OSError (ENOSPC)
                torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
        except Exception as e:  # mid-write, torch's zip writer raises a RuntimeError over the ENOSPC as it closes
            self.keep(e, path)


def keep_copy_errors(engine: Any) -> None:
    """Rank 0's copy of zero_to_fp32.py, after its files, fails on a full disk too: kept alike. Wraps
    `engine._copy_recovery_script`, a private DeepSpeed method another version may rename; `del
    engine._copy_recovery_script` puts DeepSpeed's back."""
    copy_scripts = engine._copy_recovery_script

    def keep_copy_error(save_path: str) -> None:
        try:
            copy_scripts(save_path)
        except OSError as e:
            engine.checkpoint_engine.keep(e, e.filename or save_path)

    engine._copy_recovery_script = keep_copy_error


if __name__ == "__main__":
    from zckpt_nb import train

    train.main(engine_kind=FaultyEngine)
