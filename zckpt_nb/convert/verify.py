"""Is this checkpoint complete and intact? The checks that resume, export and `verify` run against its manifest.

The manifest itself (what it holds, how it is written) is `format.manifest`; this module only checks: every file
present with its size and SHA-256, every rank's files listed, paths that stay inside the folder, a world size and a
model that fit the run. It needs no torch.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CheckpointError, UsageError
from zckpt_nb.format.layout import (
    ARCHITECTURE,
    MANIFEST,
    RANK_FILE,
    committed_tags,
    incomplete_tags,
    is_plain_name,
    latest_name,
    tag_step,
)
from zckpt_nb.format.manifest import elsewhere, read_manifest, sha256_file
from zckpt_nb.format.units import noun


def inside(folder: Path, name: Any, nested: bool) -> bool:
    """`name` is a relative path to a file in `folder` (or, with `nested`, below it) that resolves there too."""
    if not nested:
        return is_plain_name(name) and (folder / name).resolve().parent == folder.resolve()
    return (isinstance(name, str) and not Path(name).is_absolute() and ".." not in Path(name).parts
            and folder.resolve() in (folder / name).resolve().parents)


def check_paths(folder: Path, entries: list[dict[str, Any]], manifest: Path, nested: bool = False) -> None:
    """Every entry names a file in `folder` (no `../x`, no absolute path, no symlink leading out).

    An edited or foreign manifest must not make verify, resume or export read (hash) files elsewhere.
    """
    for entry in entries:
        name = entry.get("path")
        if not inside(folder, name, nested):
            raise CheckpointError(f"{manifest} names {name!r}, which is not a file of {folder} (a path or "
                                  "a symlink leading out); refusing the checkpoint: restore its files or save it again")


def check_file(tag_dir: Path, entry: dict[str, Any]) -> Path:
    """One file against its manifest entry: present and of the same size; returns its path."""
    path = tag_dir / entry["path"]
    if not path.is_file():
        whose = "" if entry["rank"] is None else f" (rank {entry['rank']}'s file)"
        raise CheckpointError(f"{path} is missing{whose}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} has {size:,} bytes, the manifest says {entry['bytes']:,} "
                              "(truncated or rewritten)")
    return path


def check_hashes(files: list[tuple[Path, str]], workers: int | None = None) -> None:
    """Each (path, SHA-256) pair, hashed in parallel; the first mismatch in list order is the error.

    hashlib releases the GIL while it hashes, so one file per thread runs on all cores (`workers`, default the
    CPU count); the files are only read, nothing is unpickled.
    """
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        digests = list(pool.map(sha256_file, [path for path, _ in files]))
    for (path, expected), digest in zip(files, digests):
        if digest != expected:
            raise CheckpointError(f"{path} does not match its SHA-256 in the manifest (corrupted)")


def check_ranks(tag_dir: Path, manifest: dict[str, Any]) -> None:
    """Every rank 0..W-1 has its model and optimizer file listed."""
    world = manifest["world_size"]
    listed = {(int(m.group(1)), m.group(2)) for e in manifest["files"] if (m := RANK_FILE.search(e["path"]))}
    for rank in range(world):
        for kind in ("model", "optim"):
            if (rank, kind) not in listed:
                raise CheckpointError(f"{tag_dir}: the manifest lists no {kind} file for rank {rank} of {world}")


def unlisted(folder: Path, entries: list[dict[str, Any]]) -> list[Path]:
    """What `folder` holds (below it too) that the manifest entries do not list: files, and links to folders."""
    listed, extra = {MANIFEST, *(e["path"] for e in entries)}, []
    for root, dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        extra += [here / name for name in files if str(here / name) not in listed]
        extra += [here / name for name in dirs if (Path(root) / name).is_symlink()]
    return sorted(extra)


def check_listed(folder: Path, entries: list[dict[str, Any]], manifest: Path) -> None:
    """`folder` holds nothing the manifest does not list.

    DeepSpeed's readers take every checkpoint file they find (zero_to_fp32 globs the tag folder, ds_to_universal
    walks it) and unpickle it with weights_only=False: a checkpoint is exactly its listed files.
    """
    extra = unlisted(folder, entries)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{folder / extra[0]}{more} is not listed in {manifest}, and DeepSpeed's readers load "
                              f"every checkpoint file they find: refusing the checkpoint; move what the manifest "
                              f"does not list out of {folder}")


def check_output(out: Path, kind: str | None = None) -> None:
    """UsageError unless `out` is a new or empty folder, or (with `kind`) an earlier output of that kind holding
    only the files its manifest lists: nothing else is ever replaced."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{out} is a {'symbolic link' if out.is_symlink() else 'file'}; name a new or empty folder")
    if not out.exists() or not any(out.iterdir()):
        return
    own = kind is not None and read_kind(out) == kind
    extra = unlisted(out, read_manifest(out)["files"]) if own else sorted(p.relative_to(out) for p in out.iterdir())
    if extra:
        found = ", ".join(map(str, extra[:3])) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        if kind is None:
            raise UsageError(f"{out} is not empty (it holds {found}); name a new or empty folder")
        raise UsageError(f"{out} holds {found}, which zckpt_nb did not write; it replaces only its own earlier {kind} "
                         "output: name a new or empty folder, or move those files out")


def check_fit(manifest: dict[str, Any], tag_dir: Path, world_size: int | None,
              identity: dict[str, Any] | None) -> None:
    """The checkpoint was written by this many ranks and by this model, or say what differs."""
    if world_size is not None and manifest["world_size"] != world_size:
        raise CheckpointError(
            f"{tag_dir} was saved by {manifest['world_size']} ranks; this run has {world_size}. Resume with "
            f"--nproc {manifest['world_size']}, or convert it (DeepSpeed's ds_to_universal) to change the world size")
    if identity is not None and manifest.get("adopted"):
        kind = (manifest.get("identity") or {}).get("model_type", "causal LM")
        raise CheckpointError(f"{tag_dir} holds a `{kind}` model trained outside zckpt_nb (adopted); `train` builds "
                              "only the package's presets (--model tiny, small, ...): resume it in your own training "
                              "loop with zckpt_nb.resume(engine, output_dir) (README: Your own training loop)")
    if identity is not None and manifest.get("identity") != identity:
        saved = manifest.get("identity") if isinstance(manifest.get("identity"), dict) else {}
        differ = "; ".join(f"{k} {saved.get(k)!r} (this run: {identity.get(k)!r})"
                           for k in sorted({*saved, *identity}) if saved.get(k) != identity.get(k))
        raise CheckpointError(f"{tag_dir} was saved with {differ}. Resume with the same --model and "
                              "--global_batch, or use another --output_dir")


def verify_tag(ckpt_dir: str | Path, tag: str, *, world_size: int | None = None,
               identity: dict[str, Any] | None = None, ranks: list[int] | None = None) -> dict[str, Any]:
    """Run every check on checkpoint `tag`; hash only the files of `ranks` (all when None). Returns the manifest."""
    if not is_plain_name(tag):  # `latest` or --tag naming `../elsewhere`
        raise CheckpointError(f"checkpoint tag {tag!r} is not a folder name inside {ckpt_dir}; pass a tag like "
                              "global_step40")
    tag_dir = Path(ckpt_dir) / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"no checkpoint folder {tag_dir}")
    manifest = read_manifest(tag_dir)
    if manifest.get("tag") != tag:
        raise CheckpointError(f"{tag_dir / MANIFEST} describes tag {manifest.get('tag')!r}, not {tag!r}")
    check_fit(manifest, tag_dir, world_size, identity)
    shared = manifest.get("shared", [])  # absent in manifests written before the shared files were listed
    check_paths(tag_dir, manifest["files"], tag_dir / MANIFEST)
    check_paths(tag_dir.parent, shared, tag_dir / MANIFEST)
    check_listed(tag_dir, manifest["files"], tag_dir / MANIFEST)
    check_ranks(tag_dir, manifest)
    here = [e for e in manifest["files"] if e not in elsewhere(manifest)]  # node-local: other nodes hold the rest
    entries = [(tag_dir, e) for e in here] + [(tag_dir.parent, e) for e in shared]
    paths = [check_file(folder, entry) for folder, entry in entries]  # every presence and size before any hash
    check_hashes([(path, entry["sha256"]) for path, (_, entry) in zip(paths, entries)
                  if ranks is None or entry["rank"] in ranks])
    return manifest


def verify_universal(folder: str | Path, kind: str = "universal") -> dict[str, Any]:
    """Check a converted folder (universal copy, DCP checkpoint) against its manifest: every file, size and SHA-256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("kind") != kind:
        raise CheckpointError(f"{folder / MANIFEST} is not the manifest of a {kind} checkpoint")
    check_paths(folder, manifest["files"], folder / MANIFEST, nested=True)
    check_listed(folder, manifest["files"], folder / MANIFEST)
    paths = [check_file(folder, entry) for entry in manifest["files"]]
    check_hashes([(path, entry["sha256"]) for path, entry in zip(paths, manifest["files"])])
    return manifest


def check_config(ckpt_dir: str | Path, expected: dict[str, Any], model: str) -> None:
    """`config.json` beside the checkpoint has the shape of the model this run builds, or name both."""
    path = Path(ckpt_dir) / "config.json"
    if path.is_file():
        saved, ours = ({k: c.get(k) for k in ARCHITECTURE} for c in (json.loads(path.read_text()), expected))
        if saved != ours:
            raise CheckpointError(f"{path} describes {saved}, but this run's --model {model} is {ours}; resume "
                                  "with the --model that config.json describes, or use another --output_dir")


def verify(ckpt_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """`python -m zckpt_nb verify`: check `tag` (default: what `latest` names) completely."""
    tag = tag or latest_name(ckpt_dir)
    if tag is None:
        raise CheckpointError(f"{ckpt_dir} has no 'latest' file; pass --tag or point at a checkpoint folder")
    if is_plain_name(tag) and read_kind(Path(ckpt_dir) / tag) == "universal":
        return verify_universal(Path(ckpt_dir) / tag)
    return verify_tag(ckpt_dir, tag)


def read_kind(tag_dir: Path) -> str | None:
    """The `kind` a folder's manifest names (None for a save, or without a readable manifest)."""
    try:
        return read_manifest(tag_dir).get("kind")
    except CheckpointError:
        return None


def tag_to_resume(ckpt_dir: str | Path, among: set[str] | None = None) -> tuple[str, str | None]:
    """The newest committed tag (of `among`, when given), and one line saying what was skipped.

    Skipped: newer incomplete saves, newer tags not in `among` (not committed on every node), a stale `latest`.
    """
    committed = [t for t in committed_tags(ckpt_dir) if among is None or t in among]
    if not committed:
        raise CheckpointError(f"no committed checkpoint in {ckpt_dir} (no tag folder holds {MANIFEST}"
                              f"{'' if among is None else ' on every node'})")
    tag = committed[-1]
    newer = [t for t in incomplete_tags(ckpt_dir) if tag_step(t) > tag_step(tag)]
    partial = [t for t in committed_tags(ckpt_dir) if tag_step(t) > tag_step(tag)]  # committed here, not everywhere
    notes = [f"ignoring incomplete {noun(len(newer), 'checkpoint')} {', '.join(newer)} (no manifest: the save never "
             "committed)"] if newer else []
    notes += [f"ignoring {', '.join(partial)} (not committed on every node)"] if partial else []
    if latest_name(ckpt_dir) != tag:
        notes.append(f"'latest' names {latest_name(ckpt_dir)}, the newest committed is {tag}")
    return tag, ("; ".join(notes) + f"; resuming from {tag}") if notes else None


def newest_committed(ckpt_dir: str | Path, doing: str) -> str:
    """`tag_to_resume`'s tag, printing what it skipped in terms of what is `doing` it ('converting', ...)."""
    tag, note = tag_to_resume(ckpt_dir)
    if note:
        print(note.replace("resuming", doing), flush=True)
    return tag


def describe_manifest(manifest: dict[str, Any]) -> str:
    """One line for a checkpoint that passed every check."""
    total, away = sum(e["bytes"] for e in manifest["files"]), elsewhere(manifest)
    if manifest.get("kind") == "universal":
        return (f"ok: universal copy of {manifest['tag']} (step {manifest['step']}, converted from "
                f"{manifest['source_world_size']} ranks, loads on any number; {len(manifest['files'])} files, "
                f"{total:,} bytes, every size and SHA-256 matches)")
    ok = (f"ok: {manifest['tag']} (step {manifest['step']}, {manifest['world_size']} ranks, "
          f"{len(manifest['files'])} files, {total:,} bytes, every size and SHA-256 matches)")
    if not away:
        return ok
    nodes = sorted({e["node"] for e in away})
    return (ok.replace("every size", f"node {manifest['node']}'s part checked here: every size") +
            f"; {len(away)} files live on node(s) {', '.join(map(str, nodes))} ({', '.join(e['path'] for e in away)}): "
            "run verify there, or collect the parts (python -m zckpt_nb collect)")
