"""The manifest (`zckpt_manifest.json`): what makes a tag folder a committed checkpoint, and its text.

A checkpoint tag counts as *committed* only once its manifest is in the tag folder, written last by the commit
protocol (`saving.commit`). It names every rank's files with their sizes and SHA-256, the world size, the step and
the model it came from, and (`shared`) the files beside the tags that every checkpoint depends on: the tokenizer and
`config.json`. With node-local storage (`saving.nodes`) each node's folder holds its own ranks' files and a manifest
listing the whole checkpoint: `node` names the folder's node, each file its holder's. DeepSpeed keeps no such
record (its `latest` only names a folder), so this is written by hand; it needs no torch. The checks live in
`convert.verify`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import MANIFEST, SHARED_FILES

FORMAT = "zckpt-manifest/1"


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (hashlib does the work)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_record(path: Path, tag_dir: Path, rank: int, sha256: str) -> dict[str, Any]:
    """One manifest entry: the path relative to the tag folder, the writing rank, size and hash."""
    return {"path": str(path.relative_to(tag_dir)), "rank": rank, "bytes": path.stat().st_size, "sha256": sha256}


def read_manifest(tag_dir: Path) -> dict[str, Any]:
    """The manifest of one tag folder; CheckpointError when it is absent or unreadable."""
    path = tag_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{tag_dir} has no {MANIFEST}, so it was never committed by zckpt_nb (DeepSpeed's own "
                              "save writes none; a save of this package interrupted before its commit has none "
                              f"either); if it is complete, `python -m zckpt_nb adopt {tag_dir.parent} --tag "
                              f"{tag_dir.name}` checks every file and commits it")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); the checkpoint cannot be trusted") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest")
    return manifest


def elsewhere(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The files a node-local manifest lists that live on other nodes (none in a shared folder)."""
    node = manifest.get("node")
    return [] if node is None else [e for e in manifest["files"] if e.get("node", node) != node]


def shared_records(ckpt_dir: Path) -> list[dict[str, Any]]:
    """Manifest entries (rank 0 writes them) for the `SHARED_FILES` beside the tags."""
    paths = [ckpt_dir / name for name in SHARED_FILES if (ckpt_dir / name).is_file()]
    return [file_record(p, ckpt_dir, 0, sha256_file(p)) for p in paths]


def checkpoint_manifest(ckpt_dir: Path, tag: str, step: int, world: int, identity: dict[str, Any],
                        reports: list[dict[str, Any]], node: int | None = None,
                        adopted: dict[str, Any] | None = None) -> str:
    """The manifest: format, tag, step, world size, model identity, every rank's files and the shared files.

    With node-local storage it also names `node`, the node whose folder it describes; a checkpoint this package did
    not write but checked and committed afterwards (`convert.adopt`) carries what its files record under `adopted`.
    """
    files = sorted((f for r in reports for f in r["files"]), key=lambda f: (f["rank"], f["path"]))
    where = {} if node is None else {"node": node}
    origin = {} if adopted is None else {"adopted": adopted}
    return json.dumps({"format": FORMAT, "tag": tag, "step": step, "world_size": world, "identity": identity,
                       **where, **origin, "files": files, "shared": shared_records(ckpt_dir)}, indent=1)
