"""Files that survive a crash: fsync, atomic replace, write-once, and whether a folder can be written.
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError

PAGE = mmap.PAGESIZE


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a new or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def nearest_existing(path: Path) -> Path:
    """`path` or its closest existing ancestor (for disk_usage before the folder exists)."""
    while not path.exists():
        path = path.parent
    return path


def write_once(save_dir: Path, write: Callable[[str], Any]) -> None:
    """Run `write(folder)` into a temporary folder and move its files into `save_dir` atomically.

    Used for the tokenizer and config: written on the first save only, so a later full disk cannot truncate them.
    """
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
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"output dir {output_dir} cannot be created: {probe} is a file; choose another --output_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"output dir {output_dir} cannot be written ({probe} is read-only or not yours); "
                         "choose another --output_dir")
