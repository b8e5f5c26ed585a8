"""None
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
        raise CheckpointError(f"{tag_dir} has no {MANIFEST}: the save never committed (incomplete checkpoint)")
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
                  reports: list[dict[str, Any]], node: int | None = None) -> str:
    """The manifest: format, tag, step, world size, model identity, every rank's files and the shared files.

    With node-local storage it also names `node`, the node whose folder it describes.
    """
    files = sorted((f for r in reports for f in r["files"]), key=lambda f: (f["rank"], f["path"]))
    where = {} if node is None else {"node": node}
    return json.dumps({"format": FORMAT, "tag": tag, "step": step, "world_size": world, "identity": identity,
                       **where, "files": files, "shared": shared_records(ckpt_dir)}, indent=1)
