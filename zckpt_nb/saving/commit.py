"""The commit protocol: a checkpoint counts only once every rank's files are on disk and every rank agrees.

DeepSpeed's `save_checkpoint` writes `latest` on rank 0 before its final barrier (so before the other
ranks' shards are known to be complete) and never fsyncs. A crash then leaves `latest` naming a
half-written checkpoint. Here every rank runs the same sequence of steps and collectives:

1. preflight: rank 0 creates the folder and writes the tokenizer (once, atomically); every rank
   predicts the bytes of its files (the cost model, `zckpt_nb.format.sizes`); one `all_gather_object` shares
   problems and free space, and no rank enters DeepSpeed's save unless every rank can;
2. `engine.save_checkpoint(..., save_latest=False)` on every rank, through `DeferredErrorWriter`: each
   file is hashed while written and fsynced, and a write error is *kept*, not raised, so every rank
   still runs DeepSpeed's own barriers to the end (a rank raising there would leave the others waiting);
3. agreement: one `all_gather_object` of every rank's files (size, SHA-256) and error;
4. commit, by the rank that writes the folder (rank 0 when every rank writes to one shared folder;
   `zckpt_nb.saving.nodes` says who otherwise): the manifest by temporary file + fsync + rename, then `latest`
   the same way, each followed by an fsync of the folder;
5. one `all_gather_object` of the committers' errors, so every rank returns the same `SaveOutcome`.

`--keep_last` rotation follows a committed save, outside this protocol (`zckpt_nb.saving.rotation`): it can fail
without touching the new checkpoint or `latest`.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from zckpt_nb.errors import describe_error, is_peer_failure, peer_failure
from zckpt_nb.format.disk import atomic_write, fsync_dir, nearest_existing, write_once
from zckpt_nb.format.layout import MANIFEST, committed_tags, node_rank, writes_folder
from zckpt_nb.format.manifest import checkpoint_manifest, file_record
from zckpt_nb.format.records import SaveOutcome
from zckpt_nb.format.sizes import engine_file_bytes
from zckpt_nb.saving import faults, writers
from zckpt_nb.saving.collective import gather


class DeferredErrorWriter:
    """Stands in for DeepSpeed's checkpoint engine during one save: hashes and fsyncs every file, keeps errors.

    DeepSpeed runs barriers between and after its file writes. If one rank raised out of a write, the
    others would wait in the next barrier for a rank that never comes. So the first error is kept and
    every later write of this save skipped; the ranks compare errors afterwards, in step 3.
    """

    def __init__(self, inner: Any, rank: int, step: int) -> None:
        self.inner, self.rank, self.step = inner, rank, step
        self.written: list[tuple[Path, str]] = []
        self.error: str | None = None
        self.fsync_seconds = self.hash_seconds = 0.0

    def __getattr__(self, name: str) -> Any:  # create, commit, load, ...: DeepSpeed's own engine
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        if self.error:
            return
        faults.maybe("stall", self.rank, self.step)
        if self.written:  # "shards": killed between its model and optimizer files
            faults.maybe("shards", self.rank, self.step)
        try:
            self.write(state_dict, Path(path))
        except Exception as e:  # any failure, kept for the agreement; the partial file is removed
            self.fail(e, path)
            with suppress(OSError):
                Path(path).unlink(missing_ok=True)

    def write(self, state_dict: Any, path: Path) -> None:
        """DeepSpeed's own save (torch.save, without its CRC-32) into a file that hashes on a thread of its own and
        writes with O_DIRECT, then fsync (`writers.DirectFile`)."""
        with writers.without_crc32(), writers.DirectFile(path) as out:
            self.inner.save(state_dict, out)
        self.fsync_seconds += out.fsync_seconds
        self.hash_seconds += out.hash_seconds
        self.written.append((path, out.hexdigest()))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.fail(e, path, "creating")

    def fail(self, err: BaseException, path: str | Path, doing: str = "writing") -> None:
        if self.error is None:
            self.error = describe_error(err, path, self.rank, doing)

    def records(self, tag_dir: Path) -> list[dict[str, Any]]:
        """Manifest entries for the files this rank wrote."""
        return [file_record(p, tag_dir, self.rank, sha) | {"node": node_rank()} for p, sha in self.written]


@contextmanager
def deferred_errors(engine: Any, writer: DeferredErrorWriter) -> Iterator[None]:
    """Route DeepSpeed's writes through `writer` for one save, including rank 0's copy of zero_to_fp32.py."""
    original_engine, original_copy = engine.checkpoint_engine, engine._copy_recovery_script

    def copy_recovery_script(save_path: str) -> None:
        try:
            original_copy(save_path)
        except OSError as e:
            writer.fail(e, save_path, "copying zero_to_fp32.py into")

    engine.checkpoint_engine, engine._copy_recovery_script = writer, copy_recovery_script
    try:
        yield
    finally:
        engine.checkpoint_engine = original_engine
        del engine._copy_recovery_script  # back to the class's method


def prepare_folder(save_dir: str | Path, tag: str, write_shared: Callable[[str], Any] | None = None,
                   shared: tuple[str, ...] = ("tokenizer.json",)) -> None:
    """Rank 0 before a save: the folder, the `shared` files (once), no stale files of an uncommitted try of `tag`."""
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


def preflight(save_dir: Path, need: int, rank: int, prepare: Callable[[], None] | None,
              error: str | None = None) -> dict[str, Any]:
    """This rank's view before writing: an error line (or None), the bytes it needs, the free bytes it sees.

    Any exception while preparing (a full disk, a tokenizer that cannot be saved) becomes this rank's error line:
    every rank then learns it in the agreement, and none is left waiting for a rank that raised.
    """
    if prepare and error is None:
        try:
            prepare()
        except Exception as e:
            error = describe_error(e, getattr(e, "filename", None) or save_dir, rank, "preparing")
    free = shutil.disk_usage(nearest_existing(save_dir)).free
    return {"rank": rank, "error": error, "need": need, "free": free}


def space_problem(reports: list[dict[str, Any]], save_dir: Path) -> str | None:
    """Refuse when the ranks' estimated bytes together exceed the free space a rank sees (a shared filesystem)."""
    need = sum(r["need"] for r in reports)
    for r in reports:
        if need > r["free"]:
            return (f"rank {r['rank']}: not enough free space in {save_dir}: the save needs about {need / 2**20:,.1f} "
                    f"MiB, {r['free'] / 2**20:,.1f} MiB free; free space or use --keep_last")
    return None


def first_errors(reports: list[dict[str, Any]]) -> str | None:
    """Every rank's error line joined into one line, or None when all succeeded."""
    lines = [r["error"] for r in reports if r["error"]]
    return "; ".join(lines) if lines else None


def commit_folder(save_dir: Path, tag: str, step: int, manifest: str, rank: int) -> None:
    """Step 4 (rank 0, or each node's writer): manifest, then `latest`, each by temporary file + fsync + rename."""
    tag_dir = save_dir / tag
    fsync_dir(tag_dir)  # every rank's file entries are durable before the manifest names them
    atomic_write(tag_dir / MANIFEST, manifest)
    fsync_dir(save_dir)
    atomic_write(save_dir / "latest", tag, before_rename=lambda: faults.maybe("latest", rank, step))


def discard(save_dir: Path, tag: str, writes: bool) -> None:
    """The folder's writer removes the files of a save that failed (every rank has finished writing by now)."""
    if writes:
        shutil.rmtree(save_dir / tag, ignore_errors=True)


def agreed_preflight(engine: Any, save_dir: Path, state: dict[str, Any], step: int, rank: int,
                     prepare: Callable[[], None] | None) -> tuple[str | None, int]:
    """Step 1 on every rank: (the error every rank agrees on, or None; this rank's predicted bytes)."""
    error, need = None, 0
    try:
        need = engine_file_bytes(engine, state, step)
    except Exception as e:  # agreed below like any other problem, never raised on one rank alone
        error = describe_error(e, save_dir, rank, "predicting the size of")
    reports = gather(preflight(save_dir, need, rank, prepare, error))
    return first_errors(reports) or space_problem(reports, save_dir), need


def agree_and_commit(save_dir: Path, tag: str, step: int, writer: DeferredErrorWriter, identity: dict[str, Any],
                     node_local: bool) -> str | None:
    """Steps 3 to 5 on every rank once its files are written: the error every rank agrees on, or None (committed)."""
    import torch.distributed as dist

    writes = writes_folder(node_local)
    reports = gather({"rank": writer.rank, "error": writer.error, "files": writer.records(save_dir / tag)})
    faults.release(writer.rank, step, save_dir)
    error, commit_error = first_errors(reports), None
    if error:
        discard(save_dir, tag, writes)
    elif writes:
        try:
            manifest = checkpoint_manifest(save_dir, tag, step, dist.get_world_size(), identity, reports,
                                     node=node_rank() if node_local else None)
            commit_folder(save_dir, tag, step, manifest, writer.rank)
        except OSError as e:
            commit_error = describe_error(e, e.filename or save_dir / tag, writer.rank, "committing")
            (save_dir / tag / MANIFEST).unlink(missing_ok=True)
            discard(save_dir, tag, writes)
    return error or first_errors(gather({"error": commit_error}))  # alike on all ranks: all gather or none


def save_committed(engine: Any, save_dir: str | Path, tag: str, state: dict[str, Any], *, step: int,
         identity: dict[str, Any], prepare: Callable[[], None] | None = None) -> SaveOutcome:
    """Save checkpoint `tag` with the commit protocol; every rank must call it. Never raises for a failed save."""
    import torch.distributed as dist

    start, rank, save_dir = time.perf_counter(), dist.get_rank(), Path(save_dir)
    error, need = agreed_preflight(engine, save_dir, state, step, rank, prepare)
    if error:
        return SaveOutcome(tag, step, False, error, time.perf_counter() - start, estimated_bytes=need)

    faults.maybe("fill", rank, step, save_dir)
    writer = DeferredErrorWriter(engine.checkpoint_engine, rank, step)
    write_start = time.perf_counter()
    run_save(engine, writer, save_dir, tag, state, start)
    write_seconds = time.perf_counter() - write_start
    faults.maybe("before_commit", rank, step)
    error = agree_and_commit(save_dir, tag, step, writer, identity, bool(engine.use_node_local_storage()))
    seconds = time.perf_counter() - start
    # the hash runs on the writer's thread, beside the write: its seconds are part of "write", shown apart
    timings = {"write": write_seconds - writer.fsync_seconds, "fsync": writer.fsync_seconds,
               "hash": writer.hash_seconds, "protocol": seconds - write_seconds}
    return SaveOutcome(tag, step, error is None, error, seconds, timings, estimated_bytes=need)


def run_save(engine: Any, writer: DeferredErrorWriter, save_dir: Path, tag: str, state: dict[str, Any],
             start: float) -> None:
    """Step 2: DeepSpeed's save through `writer`, which keeps write errors; a lost collective raises."""
    try:
        with deferred_errors(engine, writer):
            engine.save_checkpoint(str(save_dir), tag=tag, client_state=state, save_latest=False)
    except Exception as e:  # outside a file write: the ranks' collectives may no longer line up
        if is_peer_failure(e):  # never a write error: the agreement's collectives would fail or hang next
            after = f" after {time.perf_counter() - start:.0f} s"
            raise peer_failure(e, writer.rank, f"save of {tag}", after) from None
        writer.fail(e, save_dir / tag, "saving")
