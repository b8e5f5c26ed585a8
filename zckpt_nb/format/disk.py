"""Files that survive a crash: fsync, atomic replace, write-once, and whether a folder can be written."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CheckpointError, UsageError, os_error_in

PAGE = mmap.PAGESIZE


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a new or renamed file) durable, or a file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: list[Path]) -> None:
    """fsync every file and folder of `paths` on threads, the first error raised: the filesystem makes them durable
    together, in fewer journal commits than one after another (docs/performance.md, "From-dcp's fsyncs together")."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(paths)))) as pool:
        list(pool.map(fsync_dir, paths))


def atomic_write(path: Path, text: str, before_rename: Callable[[], None] | None = None) -> None:
    """Replace `path` with `text` so a crash leaves the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if before_rename:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path, limit: int = 64 << 20) -> Any:
    """A JSON file of at most `limit` bytes (checked before it is read); CheckpointError in one line otherwise."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise ValueError(f"it is larger than {limit >> 20} MiB")
            return json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"cannot read {path}: {e}") from None


def nearest_existing(path: Path) -> Path:
    """`path` or its closest existing ancestor (for disk_usage before the folder exists)."""
    while not path.exists():
        path = path.parent
    return path


def write_once(save_dir: Path, write: Callable[[str], Any]) -> None:
    """Run `write(folder)` into a temporary folder and move its files into `save_dir` atomically."""
    tmp = save_dir / ".zckpt_tmp_shared"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(str(tmp))
    for path in sorted(tmp.iterdir()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(path, save_dir / path.name)
    tmp.rmdir()
    fsync_dir(save_dir)


def check_writable(output_dir: Path) -> None:
    """Raise UsageError unless `output_dir` exists as a writable folder or can be created."""
    probe = nearest_existing(output_dir)
    if not probe.is_dir():
        raise UsageError(f"output dir {output_dir} cannot be created: {probe} is a file; choose another --output_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"output dir {output_dir} cannot be written ({probe} is read-only or not yours); "
                         "choose another --output_dir")


def umask() -> int:
    """This process's umask (reading it means setting it: it is put straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def replace_folder(new: Path, target: Path) -> None:
    """Move the finished folder `new` to `target`, replacing what was there only once `new` is complete."""
    if target.is_dir() and any(target.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(new, target)
        shutil.rmtree(old)
    else:
        os.replace(new, target)  # rename() replaces an empty folder atomically
    fsync_dir(target.parent)


@contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A folder of this command's own beside `target`, moved into place on success and removed otherwise."""
    if target.is_symlink():
        raise UsageError(f"{target} is a symbolic link; name a real folder for the output")
    made = [p for p in [*reversed(target.parents)] if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private (0700); the output gets the modes of any new folder
    try:
        yield tmp
        replace_folder(tmp, target)
    except BaseException as error:
        cause = os_error_in(error)
        if cause is not None and not cause.filename:  # a write's ENOSPC names no file: name the output
            cause.filename = str(target)
        shutil.rmtree(tmp, ignore_errors=True)
        for path in reversed(made):  # folders made for target's parents: the tree is left as it was
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise
