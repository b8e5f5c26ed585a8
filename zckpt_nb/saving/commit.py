"""The commit protocol: a checkpoint counts only once every rank's files are on disk and every rank agrees.

Every rank: an agreed preflight (bytes bounded, free space, no rank enters DeepSpeed's save unless all can), then
`save_checkpoint(..., save_latest=False)` through the package's checkpoint engine (hashed, fsynced, errors kept), an
agreement on every rank's files, the commit by the folder's writer (the manifest, then `latest`, each atomically) and
one gather of its errors, so every rank returns the same `SaveOutcome`. docs/commit_protocol.md tells the whole story.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.errors import describe_error, is_peer_failure, peer_failure
from zckpt_nb.format.disk import atomic_write, nearest_existing, write_once
from zckpt_nb.format.layout import MANIFEST, committed_tags, node_rank, writes_folder
from zckpt_nb.format.manifest import Manifest, commit, file_entry, shared_entries
from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.format.sizes import save_bytes
from zckpt_nb.format.units import mib
from zckpt_nb.saving.collective import gather
from zckpt_nb.saving.engine import HASHED, Files, ZckptEngine, install

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed's rank 0 copies them after its last file


def prepare_folder(save_dir: str | Path, tag: str, write_shared: Callable[[str], Any] | None = None,
                   shared: tuple[str, ...] = ("tokenizer.json",)) -> None:
    """Before a save, the folder's writer: the folder, the `shared` files (once), no files of an uncommitted try."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    if tag in committed_tags(save_dir):
        raise FileExistsError(errno.EEXIST, f"checkpoint {tag} is already committed; refusing to overwrite it",
                              str(save_dir / tag))
    if (save_dir / tag).is_symlink():  # emptying it would delete files outside the output folder
        raise FileExistsError(errno.EEXIST, "the tag folder is a symbolic link; refusing to save through it",
                              str(save_dir / tag))
    if (save_dir / tag).is_dir():  # debris of a crashed save of the same tag
        for path in (save_dir / tag).iterdir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if write_shared and not all((save_dir / name).is_file() for name in shared):
        write_once(save_dir, write_shared)


def space_problem(reports: list[dict[str, Any]], save_dir: Path) -> str | None:
    """Refuse when the ranks' predicted bytes together exceed the free space a rank sees (a shared filesystem)."""
    need = sum(r["need"] for r in reports)
    for r in reports:
        if need > r["free"]:
            return (f"rank {r['rank']}: not enough free space in {save_dir}: the save needs about {mib(need)}, "
                    f"{mib(r['free'])} free; free space or use --keep_last")
    return None


def first_errors(reports: list[dict[str, Any]]) -> str | None:
    """Every rank's error line joined into one line, or None when all succeeded."""
    lines = [r["error"] for r in reports if r["error"]]
    return "; ".join(lines) if lines else None


def agreed_preflight(engine: Any, save_dir: Path, state: dict[str, Any], rank: int,
                     prepare: Callable[[], None] | None) -> tuple[str | None, int]:
    """Step 1 on every rank: (the error every rank agrees on, or None; this rank's predicted bytes)."""
    error, need = None, 0
    try:
        need = save_bytes(engine, state)
    except Exception as e:  # agreed below like any other problem, never raised on one rank alone
        error = describe_error(e, save_dir, rank, "predicting the size of")
    if prepare and error is None:  # the folder's writer prepares the folder; a failure is agreed like the rest
        try:
            prepare()
        except Exception as e:
            error = describe_error(e, getattr(e, "filename", None) or save_dir, rank, "preparing")
    free = shutil.disk_usage(nearest_existing(save_dir)).free
    reports = gather({"rank": rank, "error": error, "need": need, "free": free})  # this rank's view before writing
    return first_errors(reports) or space_problem(reports, save_dir), need


def run_save(engine: Any, files: Files, save_dir: Path, tag: str, state: dict[str, Any], start: float) -> None:
    """Step 2: DeepSpeed's save, its files captured into `files`, which keeps write errors; a lost peer raises."""
    writer = install(engine)
    writer.files = files  # until it returns, every file DeepSpeed saves goes to `files` as `files.how` says
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=state, save_latest=False)
    except Exception as e:  # not a file write (those are kept): a collective, or rank 0's copy of the scripts
        if is_peer_failure(e):  # the agreement's collectives would fail or hang next
            after = f" after {time.perf_counter() - start:.0f} s"
            raise peer_failure(e, files.rank, f"save of {tag}", after) from None
        where = getattr(e, "filename", None) or save_dir / tag
        files.fail(e, where, "saving")
        if Path(where).name in RECOVERY_SCRIPTS:  # rank 0's copy failed: the rest of DeepSpeed's save_checkpoint
            import torch.distributed as dist

            epilogue = getattr(engine.optimizer, "checkpoint_event_epilogue", None)
            if epilogue is not None:
                epilogue()
            dist.barrier()
    finally:
        writer.files = None


def agree_and_commit(writer: ZckptEngine, save_dir: Path, tag: str, step: int, files: Files,
                     identity: dict[str, Any], node_local: bool) -> str | None:
    """Steps 3 to 5 on every rank once its files are written: the error every rank agrees on, or None (committed)."""
    import torch.distributed as dist

    writes = writes_folder(node_local)
    writer.protocol_point("written")
    entries = [file_entry(path, save_dir / tag, sha, files.rank, node_rank()) for path, sha in files.written]
    reports = gather({"rank": files.rank, "error": files.error, "files": entries})
    error, commit_error = first_errors(reports), None
    if not error and writes:
        try:
            entries = sorted((f for r in reports for f in r["files"]), key=lambda f: (f.rank, f.path))
            manifest = Manifest(tag, step, entries, world_size=dist.get_world_size(), identity=identity,
                                shared=shared_entries(save_dir), node=node_rank() if node_local else None)
            commit(save_dir / tag, manifest, synced=True)  # step 4: the manifest, then `latest`, each atomically
            atomic_write(save_dir / "latest", tag, before_rename=lambda: writer.protocol_point("latest"))
        except OSError as e:
            commit_error = describe_error(e, e.filename or save_dir / tag, files.rank, "committing")
            (save_dir / tag / MANIFEST).unlink(missing_ok=True)
    if (error or commit_error) and writes:  # every rank has finished writing by now
        shutil.rmtree(save_dir / tag, ignore_errors=True)
    return error or first_errors(gather({"error": commit_error}))  # alike on all ranks: all gather or none


def save_committed(engine: Any, save_dir: str | Path, tag: str, state: dict[str, Any], *, step: int,
                   identity: dict[str, Any], prepare: Callable[[], None] | None = None) -> SaveOutcome:
    """Save checkpoint `tag` with the commit protocol; every rank must call it. Never raises for a failed save."""
    import torch.distributed as dist

    start, rank, save_dir = time.perf_counter(), dist.get_rank(), Path(save_dir)
    error, need = agreed_preflight(engine, save_dir, state, rank, prepare)
    if error:
        return SaveOutcome(tag, step, False, error, time.perf_counter() - start, estimated_bytes=need)
    files, write_start = Files(rank, HASHED), time.perf_counter()
    run_save(engine, files, save_dir, tag, state, start)
    write_seconds = time.perf_counter() - write_start
    error = agree_and_commit(install(engine), save_dir, tag, step, files, identity,
                             bool(engine.use_node_local_storage()))
    seconds = time.perf_counter() - start
    return SaveOutcome(tag, step, error is None, error, seconds, files.timings(write_seconds, seconds - write_seconds),
                       estimated_bytes=need)
