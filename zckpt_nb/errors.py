"""The package's exception types and its one-line error messages; every layer imports them from here."""

from __future__ import annotations

import errno
import re
import sys
from pathlib import Path

TIMEOUT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
FIXES = {errno.EACCES: "check its permissions, or choose another folder", errno.EPERM: "check its permissions",
         errno.ENOSPC: "free space on that disk, or choose another folder", errno.EDQUOT: "your disk quota is full",
         errno.EFBIG: "the file system limits a file's size: choose another (export: a smaller --max_shard_size)",
         errno.EROFS: "the file system is read-only: choose a writable folder",
         errno.ENOENT: "check the path", errno.ENOTDIR: "a part of the path is a file, not a folder"}
SOURCE_PATH = re.compile(r"\[/[^\]\s]*/([\w.]+:\d+)\] ")  # gloo's "[/__w/pytorch/.../tcp/pair.cc:553] "


class UsageError(ValueError):
    """Bad input, found before any rank starts."""


class LaunchError(RuntimeError):
    """The job started but failed; the message holds the last lines of every rank."""


class LaunchTimeout(LaunchError):
    """The job ran past its timeout and was killed with all its ranks."""


class LaunchStopped(LaunchError):
    """The job was stopped on request (its `stop` event was set) and killed with all its ranks."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run; the message is one line."""


class CollectiveTimeout(RuntimeError):
    """The ranks lost each other during a save: the process group cannot be trusted again, the job must stop."""


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind `err`: torch's zip writer wraps ENOSPC in a RuntimeError whose context holds it."""
    seen, visited = err, set()
    while seen is not None and id(seen) not in visited:  # `raise e from e` makes a chain that loops
        if isinstance(seen, OSError) and seen.errno:
            return seen
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return None


def os_error_line(err: BaseException) -> str | None:
    """One line for the OSError behind `err`: what failed, on which file, what to do; None without one."""
    cause = os_error_in(err)
    if cause is None:
        return None
    name = errno.errorcode.get(cause.errno, str(cause.errno))
    fix = FIXES.get(cause.errno, "check the file and the disk, then try again")
    return f"{cause.strerror} ({name}) on {cause.filename or 'a file'}: {fix}"


def describe_error(err: BaseException, path: str | Path, rank: int, doing: str = "writing") -> str:
    """One line: which rank, what failed (errno name when there is one) and on which path."""
    cause = os_error_in(err)
    what = f"{errno.errorcode.get(cause.errno, cause.errno)} ({cause.strerror})" if cause else type(err).__name__
    detail = "" if cause else ": " + (str(err).strip().splitlines() or [""])[0][:200]
    return f"rank {rank}: {what} {doing} {path}{detail}"


def is_peer_failure(err: BaseException) -> bool:
    """A collective failed because of the other ranks: a timeout, a lost peer, any torch.distributed error."""
    dist = sys.modules.get("torch.distributed")  # not loaded: no collective can have raised (verify runs without torch)
    # gloo and NCCL name a timeout or lost peer only in the message; NCCL's dead peer is a DistBackendError without one
    timed_out = any(word in str(err).lower() for word in TIMEOUT_WORDS)
    return timed_out or (dist is not None and isinstance(err, dist.DistError))


def short_line(line: str, width: int) -> str:
    """`line` without a C++ source path's folders, cut to `width` at a word boundary in its second half."""
    line = SOURCE_PATH.sub(r"[\1] ", line)
    if len(line) <= width:
        return line
    cut = line[:width - 3]
    space = cut.rfind(" ")
    return (cut[:space] if space > width // 2 else cut) + "..."


def gist(err: BaseException, width: int = 120) -> str:
    """An exception's first sentence of its first line, shortened (`short_line`)."""
    first = (str(err).strip().splitlines() or [""])[0]
    head = first.split(". ", 1)[0]
    return short_line(head if len(head) >= 20 else first, width)


def peer_failure(err: BaseException, rank: int, doing: str, detail: str = "") -> CollectiveTimeout:
    """The one error every rank raises for a lost peer or a timed-out collective, with no further collective."""
    return CollectiveTimeout(f"rank {rank}: {doing} stopped{detail}: a peer rank died or a collective timed out "
                             f"({type(err).__name__}: {gist(err)}); every rank stops, 'latest' was not moved")


class LayoutError(RuntimeError):
    """The output folders the ranks see do not match the storage layout asked for; the message is one line."""


class RunIncomplete(RuntimeError):
    """The run trained to the end but did not write what it was asked to: no save committed, or no run.json."""


def first_line(error: BaseException) -> str:
    """An exception as one short line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]
