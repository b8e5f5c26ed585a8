"""One job per output folder: `DIR/.zckpt_lock` names the host and pid of the job writing there (two jobs would
rotate each other's checkpoints away). `launch` takes it before anything is written and gives it back however the job
ends; a lock whose process is gone on this host is taken over, saying so. On several nodes each node's launcher takes
its own (`.zckpt_lock.node{K}`) naming the job, so the nodes of one job admit each other and two jobs do not.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from contextlib import suppress
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError
from zckpt_nb.run import lifeline

LOCK = ".zckpt_lock"


class FolderInUse(UsageError):
    """Another job holds the output folder's lock, found before any rank starts; the message is one line naming it."""


def lock_path(output_dir: Path, node: int) -> Path:
    """Node `node`'s lock file in `output_dir`."""
    return output_dir / (f"{LOCK}.node{node}" if node else LOCK)


def owner_of(path: Path) -> dict[str, Any] | None:
    """The lock's holder as written in it; None without a lock file; FolderInUse when it cannot be read."""
    try:
        owner = json.loads(path.read_text())
        return {"host": str(owner["host"]), "pid": int(owner["pid"]), "started": float(owner["started"]),
                "job": str(owner.get("job", "")), "node": int(owner.get("node", 0))}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise FolderInUse(f"{path} is unreadable ({type(e).__name__}); if no job writes to {path.parent}, "
                          "delete it and start again") from None


def stale(owner: dict[str, Any]) -> bool:
    """The holder ran on this host and is no longer running."""
    return owner["host"] == socket.gethostname() and not lifeline.alive(owner["pid"], owner["started"])


def place(path: Path, text: str) -> bool:
    """Create `path` holding `text` only if it does not exist; False when it does. All or nothing, also over NFS."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # fails when `path` exists: a full lock file appears at once, or not at all
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def take(output_dir: Path, job: str = "", node: int = 0) -> dict[str, Any]:
    """Take node `node`'s lock of `output_dir` (an existing folder) for `job`; FolderInUse naming another job."""
    pid, started = lifeline.identity(os.getpid()).split(":")  # what the lock file holds: this process, job, node
    mine = {"host": socket.gethostname(), "pid": int(pid), "started": float(started), "job": job, "node": node}
    path = lock_path(output_dir, node)
    fd = os.open(output_dir, os.O_RDONLY)
    try:
        with suppress(OSError):  # some network filesystems refuse flock; `place` alone still admits one job
            fcntl.flock(fd, fcntl.LOCK_EX)  # jobs on this host take over a stale lock one at a time, never two at once
        owner = owner_of(path)
        if owner and stale(owner):
            print(f"{output_dir}: taking over the stale lock of pid {owner['pid']} on {owner['host']} "
                  "(that job is no longer running)", flush=True)
            path.unlink()
        if not place(path, json.dumps(mine)):
            raise in_use(output_dir, owner_of(path))
        for other in sorted(output_dir.glob(f"{LOCK}*")):  # another node's live lock naming another job
            owner = None if other.suffix == ".tmp" or other == path else owner_of(other)
            if owner and owner["job"] != mine["job"] and not stale(owner):
                path.unlink()
                raise in_use(output_dir, owner)
    finally:
        os.close(fd)  # also releases the flock
    return mine


def in_use(output_dir: Path, owner: dict[str, Any] | None) -> FolderInUse:
    """The one-line refusal naming the job that holds `output_dir`."""
    owner = owner or {"host": "?", "pid": "?"}
    return FolderInUse(f"{output_dir} is in use by another job (host {owner['host']}, pid {owner['pid']}); "
                       "wait for it to end or choose another --output_dir")


def release(output_dir: Path, mine: dict[str, Any]) -> None:
    """Remove our lock if it is still ours (never another job's that took over meanwhile)."""
    path = lock_path(output_dir, mine["node"])
    with suppress(FolderInUse):  # an unreadable lock is not ours to judge: the next job reports it
        if owner_of(path) == mine:
            path.unlink()
