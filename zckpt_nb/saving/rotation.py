"""`--keep_last K`: once a save has committed, delete checkpoints beyond the newest K. A checkpoint that cannot be
deleted is reported in one line on every rank (run.json's `rotation_errors`); the new commit stands."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from zckpt_nb.errors import describe_error
from zckpt_nb.format.disk import fsync_dir
from zckpt_nb.format.layout import MANIFEST, committed_tags, incomplete_tags, tag_step, universal_dir, writes_folder
from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.saving.collective import gather


def doomed_tags(save_dir: Path, keep_last: int) -> list[str]:
    """Committed tags beyond the newest `keep_last` and incomplete ones older than the newest committed."""
    committed = committed_tags(save_dir)
    if keep_last < 1 or not committed:
        return []
    newest = tag_step(committed[-1])
    return committed[:-keep_last] + [t for t in incomplete_tags(save_dir) if tag_step(t) < newest]


def delete_tag(save_dir: Path, tag: str) -> str | None:
    """Delete one checkpoint, its manifest first; None, or one line saying what failed."""
    tag_dir = save_dir / tag
    try:
        (tag_dir / MANIFEST).unlink(missing_ok=True)  # stopped part-way: an incomplete folder, never a committed one
        fsync_dir(tag_dir)
    except OSError as e:
        return f"{describe_error(e, e.filename or tag_dir, 0, 'deleting')}; {tag} is left whole"
    try:
        shutil.rmtree(tag_dir, onerror=full_path)
    except OSError as e:
        return (f"{describe_error(e, e.filename or tag_dir, 0, 'deleting')}; {tag} lost its manifest first, "
                "so it is incomplete and never resumed from; delete it by hand")
    shutil.rmtree(universal_dir(save_dir, tag), ignore_errors=True)  # its copy for other world sizes goes with it
    return None


def full_path(_func: Any, path: str, exc_info: Any) -> None:
    """rmtree's error handler: raise again with the full path (rmtree's own error names only the base name)."""
    err = exc_info[1]
    raise OSError(err.errno, err.strerror, path) from err


def rotate(save_dir: Path, keep_last: int) -> tuple[list[str], str | None]:
    """Rank 0: delete what `doomed_tags` names; returns (deleted tags, one line joining the failures or None)."""
    deleted, errors = [], []
    for tag in doomed_tags(save_dir, keep_last):
        error = delete_tag(save_dir, tag)
        errors += [error] if error else []
        deleted += [] if error else [tag]
    return deleted, "; ".join(errors) or None


def after_commit(save_dir: str | Path, keep_last: int, outcome: SaveOutcome, node_local: bool = False) -> None:
    """Every rank, after a committed save: each folder's writer rotates."""
    results = gather(rotate(Path(save_dir), keep_last) if writes_folder(node_local) else ([], None))
    outcome.deleted = results[0][0]
    outcome.rotation_error = "; ".join(error for _, error in results if error) or None
