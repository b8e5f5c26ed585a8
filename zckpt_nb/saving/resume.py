"""Resuming in the ranks: which checkpoint, verified by every rank, converted when N changed, loaded weights-only."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from zckpt_nb.convert.reshard import describe_conversion, ensure_universal
from zckpt_nb.convert.verify import tag_to_resume, verify_tag
from zckpt_nb.errors import CheckpointError, first_line
from zckpt_nb.format.client_state import CLIENT_KEY, set_rng_state
from zckpt_nb.format.layout import UNIVERSAL, committed_tags
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.saving.collective import gather
from zckpt_nb.saving.engine import install


def agreed_resume_tag(ckpt_dir: str | Path, identity: dict[str, Any] | None,
                      tag: str | None = None) -> tuple[str, str | None]:
    """`tag` (default: the newest committed one) verified by every rank; (tag, note) or CheckpointError."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    note, error = None, None
    everywhere = set.intersection(*(set(t) for t in gather(committed_tags(ckpt_dir))))  # node-local folders
    try:
        if tag is None:
            tag, note = tag_to_resume(ckpt_dir, everywhere)
        verify_tag(ckpt_dir, tag, world_size=world, identity=identity, ranks=[rank])
    except Exception as e:  # a rank's own failure, whatever it is, agreed by every rank below
        error = f"rank {rank}: {e if isinstance(e, CheckpointError) else first_line(e)}"
    errors = [e for e in gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    return tag, note


def resume_source(ckpt_dir: str | Path, identity: dict[str, Any], timeout: float = 600,
                  convert: bool = True) -> tuple[str, str | None, Path, dict[str, Any] | None]:
    """Every rank: (tag, note, folder to load from, the universal manifest or None), the same on all."""
    import torch.distributed as dist

    if not convert:
        tag, note = tag_to_resume(ckpt_dir)
        return tag, note, Path(ckpt_dir), None
    saved = None  # the world size of the checkpoint a resume would pick (None: none, or unreadable)
    if dist.get_rank() == 0:
        with suppress(CheckpointError):
            saved = read_manifest(Path(ckpt_dir) / tag_to_resume(ckpt_dir)[0]).world_size
    if gather(saved)[0] in (None, dist.get_world_size()):
        tag, note = agreed_resume_tag(ckpt_dir, identity)  # it also says why a checkpoint is unusable
        return tag, note, Path(ckpt_dir), None
    tag, note, record = universal_copy(ckpt_dir, identity, timeout)
    return tag, note, Path(ckpt_dir) / UNIVERSAL, record


def universal_copy(ckpt_dir: str | Path, identity: dict[str, Any] | None, timeout: float = 600,
                   tag: str | None = None) -> tuple[str, str | None, dict[str, Any]]:
    """Every rank: rank 0 verifies `tag` and converts it to a universal copy once (or reuses one)."""
    import torch.distributed as dist

    result: dict[str, Any] = {}
    if dist.get_rank() == 0:
        try:
            note = None
            if tag is None:
                tag, note = tag_to_resume(ckpt_dir)
            manifest, reused = ensure_universal(ckpt_dir, tag, identity, timeout)
            line = describe_conversion(manifest, reused, dist.get_world_size())
            result = {"tag": tag, "note": f"{note}; {line}" if note else line, "manifest": manifest, "reused": reused}
        except Exception as e:  # rank 0's failure, whatever it is, is every rank's verdict
            result = {"error": f"rank 0: {e if isinstance(e, CheckpointError) else first_line(e)}"}
    result = gather(result)[0]  # rank 0's verdict on every rank
    if "error" in result:
        raise CheckpointError(result["error"])
    record = {**asdict(result["manifest"]), "reused": result["reused"]}  # what run.json records of the copy
    return result["tag"], result["note"], record


def load_verified(engine: Any, load_dir: str | Path, tag: str, restore_rng: bool = True,
                  strict: bool = True) -> dict[str, Any]:
    """Load model, optimizer, scheduler and client state from verified `tag`; returns the client state."""
    install(engine)  # reads weights-only: a file holding more than tensors and DeepSpeed's types is refused
    path, state = engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=strict)
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint {tag} to load in {load_dir}")
    if restore_rng and CLIENT_KEY in state:
        set_rng_state(state[CLIENT_KEY]["rng"])
    return state
