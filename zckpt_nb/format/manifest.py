"""The manifest (`zckpt_manifest.json`): what makes a folder a committed checkpoint: its record, checks and commit.

Written last by `commit`, it lists every file with its size and SHA-256 (in a save, the rank and node that wrote it),
the step and the folder's kind: a save's tag, a universal copy, a DCP checkpoint or an export (docs/checkpoints.md).
DeepSpeed keeps no such record, so it is written by hand, as DCP's `FileSystemWriter.finish` writes `.metadata`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.disk import atomic_write, fsync_all, fsync_dir, read_json
from zckpt_nb.format.layout import DCP_KIND, EXPORT_KIND, MANIFEST, SHARED_FILES, UNIVERSAL

FORMAT, VERSION = "zckpt-manifest/", 1  # the one version field: "zckpt-manifest/1"
MAX_BYTES = 16 << 20  # a manifest larger than this is refused before it is read (about 100,000 files)
MAX_FILE_BYTES = 1 << 50  # no file of a checkpoint is larger (1 PiB): a bigger size is a damaged entry
SHA256 = re.compile(r"[0-9a-f]{64}")
KINDS = (None, UNIVERSAL, DCP_KIND, EXPORT_KIND)  # a save's tag folder, DeepSpeed's universal copy, convert.dcp, export
# The JSON type of every field (int excludes bool); the required ones first
FIELDS = {"tag": str, "step": int, "files": list, "kind": str, "world_size": int, "identity": dict, "shared": list,
          "node": int, "adopted": dict, "source_world_size": int, "source_manifest_sha256": str, "conversion": dict,
          "from_dcp": str}
ENTRY = {"path": str, "bytes": int, "sha256": str, "rank": int, "node": int}


@dataclass(frozen=True)
class FileEntry:
    """One file: its path relative to the folder, size, SHA-256, and the rank (and node) that wrote it."""

    path: str
    bytes: int
    sha256: str
    rank: int | None = None
    node: int | None = None


@dataclass
class Manifest:
    """One committed folder: a save's tag (`kind` None), a universal copy, a DCP checkpoint or an export."""

    tag: str
    step: int
    files: list[FileEntry]
    kind: str | None = None
    world_size: int | None = None  # a save: the ranks that wrote it (0: converted back from DCP, no rank files)
    identity: dict[str, Any] | None = None  # what the run records of its model, compared on resume
    shared: list[FileEntry] = field(default_factory=list)
    node: int | None = None  # node-local storage: the node whose folder this is
    adopted: dict[str, Any] | None = None  # what the files of a checkpoint written without zckpt_nb record
    source_world_size: int | None = None  # a conversion: the ranks that wrote its source
    source_manifest_sha256: str | None = None  # a conversion: the manifest of the bytes it was converted from
    conversion: dict[str, Any] | None = None  # a conversion's measurements (seconds, bytes, peak RSS, route)
    from_dcp: str | None = None  # a save converted back from this DCP checkpoint

    def to_json(self) -> str:
        """The manifest's text: the version first, then every field that is set."""
        record = {"format": f"{FORMAT}{VERSION}", **{k: v for k, v in asdict(self).items() if v is not None}}
        for key in ("files", "shared"):
            record[key] = [{k: v for k, v in e.items() if v is not None} for e in record[key]]
        if not record["shared"]:  # a save lists the files beside the tags; a converted folder has none
            del record["shared"]
        return json.dumps(record, indent=1)

    def elsewhere(self) -> list[FileEntry]:
        """The files a node-local manifest lists that live on other nodes (none in a shared folder)."""
        return [] if self.node is None else [e for e in self.files if e.node is not None and e.node != self.node]

    def total_bytes(self) -> int:
        """Bytes of every file listed."""
        return sum(e.bytes for e in self.files)


def typed(record: Any, types: dict[str, type], required: int, what: str) -> dict[str, Any]:
    """`record`'s values for `types`' keys, each of its type or absent; the first `required` keys must be there."""
    if not isinstance(record, dict):
        raise ValueError(f"{what} is a JSON {type(record).__name__}, not an object")
    for key, kind in types.items():
        value = record.get(key)
        if value is None and key in list(types)[:required]:
            raise ValueError(f"{what} has no {key!r}")
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise ValueError(f"{what}'s {key!r} is {json.dumps(value)[:40]}, not a JSON {kind.__name__}")
    return {key: record.get(key) for key in types}


def entry(record: Any, what: str) -> FileEntry:
    """One file's entry, checked: a relative path without NUL or '..', a size a file can have, a SHA-256."""
    found = FileEntry(**typed(record, ENTRY, 3, what))
    if "\0" in found.path or found.path.startswith("/") or ".." in found.path.split("/") or found.path in ("", "."):
        raise ValueError(f"{what} names {found.path!r}, which is not a relative path of a file")
    if not 0 <= found.bytes <= MAX_FILE_BYTES:
        raise ValueError(f"{what} ({found.path}) claims {found.bytes:,} bytes")
    if not SHA256.fullmatch(found.sha256):
        raise ValueError(f"{what} ({found.path}) has no SHA-256 (64 hex digits) but {found.sha256[:70]!r}")
    return found


def parse(record: Any) -> Manifest:
    """A manifest from its JSON value, every defect a ValueError of one line."""
    version = record.get("format") if isinstance(record, dict) else None
    if not (isinstance(version, str) and version.startswith(FORMAT)):
        raise ValueError("it is not a zckpt_nb manifest (no 'format': 'zckpt-manifest/1')")
    if version != f"{FORMAT}{VERSION}":
        raise ValueError(f"it is version {version.removeprefix(FORMAT)!r} of the format, and this zckpt_nb reads "
                         f"version {VERSION}: upgrade zckpt_nb to read it")
    values = typed(record, FIELDS, 3, "the manifest")
    if values["kind"] not in KINDS or (values["kind"] is None and values["world_size"] is None):
        raise ValueError(f"it describes a {values['kind']!r} folder" if values["kind"] not in KINDS else
                         "the manifest has no 'world_size'")
    for key in ("files", "shared"):
        values[key] = [entry(e, f"{key}[{i}]") for i, e in enumerate(values[key] or [])]
        paths = [e.path for e in values[key]]
        if len(set(paths)) < len(paths):
            raise ValueError(f"{key} lists {next(p for p in paths if paths.count(p) > 1)!r} twice")
    return Manifest(**values)


def read_manifest(folder: Path) -> Manifest:
    """The manifest of `folder`; every defect a CheckpointError of one line."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}, so it was never committed by zckpt_nb (DeepSpeed's own "
                              "save writes none; a save of this package interrupted before its commit has none "
                              f"either); if it is complete, `python -m zckpt_nb adopt {folder.parent} --tag "
                              f"{folder.name}` checks every file and commits it")
    try:
        return parse(read_json(path, MAX_BYTES))
    except (CheckpointError, ValueError) as e:
        raise CheckpointError(f"{path} is unusable ({str(e).removeprefix(f'cannot read {path}: ')}); restore the "
                              "checkpoint from a trusted copy, or save it again") from None


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (hashlib does the work)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path, folder: Path, sha256: str | None = None, rank: int | None = None,
               node: int | None = None) -> FileEntry:
    """The entry of file `path` of `folder`: its size, and its SHA-256 (read now unless the writer hashed it)."""
    return FileEntry(str(path.relative_to(folder)), path.stat().st_size, sha256 or sha256_file(path), rank, node)


def entries_under(folder: Path, digests: dict[str, str] | None = None) -> list[FileEntry]:
    """An entry for every file below `folder` but its manifest, by path (SHA-256 from `digests` where known)."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)
    return [file_entry(p, folder, (digests or {}).get(str(p.relative_to(folder)))) for p in paths]


def shared_entries(ckpt_dir: Path) -> list[FileEntry]:
    """Entries (rank 0 writes them) for the `SHARED_FILES` beside the tags."""
    return [file_entry(ckpt_dir / name, ckpt_dir, rank=0) for name in SHARED_FILES if (ckpt_dir / name).is_file()]


def commit(folder: Path, manifest: Manifest, synced: bool = False) -> None:
    """Commit `folder`: files and folder entries fsynced, then `manifest` written last and atomically."""
    here = [folder / e.path for e in manifest.files if e not in manifest.elsewhere()]
    files = [] if synced else here + [folder.parent / e.path for e in manifest.shared]
    fsync_all(files + sorted({folder, *(path.parent for path in here)}))  # together, on threads
    atomic_write(folder / MANIFEST, manifest.to_json())
    fsync_dir(folder.parent)
