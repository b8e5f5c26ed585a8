"""Is this checkpoint complete and intact? The checks that resume, export and `verify` run against its manifest:
every file present with its size and SHA-256, nothing unlisted, paths inside the folder, a fitting world size and model.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zckpt_nb.errors import CheckpointError, UsageError
from zckpt_nb.format.disk import read_json
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
from zckpt_nb.format.manifest import FileEntry, Manifest, read_manifest, sha256_file
from zckpt_nb.format.units import listed, noun


def check_paths(folder: Path, entries: list[FileEntry], manifest: Path, nested: bool = False) -> None:
    """Every entry names a file in `folder` (`nested`: below it) that resolves there: no path or symlink leading out."""
    root = folder.resolve()
    for entry in entries:
        if not (root in (folder / entry.path).resolve().parents if nested else
                is_plain_name(entry.path) and (folder / entry.path).resolve().parent == root):
            raise CheckpointError(f"{manifest} names {entry.path!r}, which is not a file of {folder} (a path or a "
                                  "symlink leading out); refusing the checkpoint: restore its files or save it again")


def check_file(folder: Path, entry: FileEntry) -> Path:
    """One file against its manifest entry: present and of the same size; returns its path."""
    path = folder / entry.path
    if not path.is_file():
        whose = "" if entry.rank is None else f" (rank {entry.rank}'s file)"
        raise CheckpointError(f"{path} is missing{whose}")
    size = path.stat().st_size
    if size != entry.bytes:
        raise CheckpointError(f"{path} has {size:,} bytes, the manifest says {entry.bytes:,} (truncated or rewritten)")
    return path


def check_hashes(files: list[tuple[Path, str]], workers: int | None = None) -> float:
    """Each (path, SHA-256) pair, hashed in parallel threads; the first mismatch in list order is the error; seconds."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        digests = list(pool.map(sha256_file, [path for path, _ in files]))
    for (path, expected), digest in zip(files, digests):
        if digest != expected:
            raise CheckpointError(f"{path} does not match its SHA-256 in the manifest (corrupted)")
    return time.perf_counter() - start


def unlisted(folder: Path, paths: list[str]) -> list[Path]:
    """What `folder` holds (below it too) beside the manifest and `paths`: files, and links to folders."""
    listed, extra = {MANIFEST, *paths}, []
    for root, dirs, files in os.walk(folder):
        here = Path(root).relative_to(folder)
        extra += [here / name for name in files if str(here / name) not in listed]
        extra += [here / name for name in dirs if (Path(root) / name).is_symlink()]
    return sorted(extra)


def check_listed(folder: Path, manifest: Manifest) -> None:
    """`folder` holds nothing its manifest does not list (DeepSpeed's readers load every file they find)."""
    extra = unlisted(folder, [e.path for e in manifest.files])
    if extra:
        raise CheckpointError(f"{listed([folder / name for name in extra], 1)} is not listed in {folder / MANIFEST}, "
                              "and DeepSpeed's readers load every checkpoint file they find: refusing the checkpoint; "
                              f"move what the manifest does not list out of {folder}")


def check_output(out: Path, kind: str | None = None) -> None:
    """UsageError unless `out` is new, empty, or (with `kind`) an earlier output of that kind, nothing more."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"{out} is a {'symbolic link' if out.is_symlink() else 'file'}; name a new or empty folder")
    if not out.exists() or not any(out.iterdir()):
        return
    own = kind is not None and read_kind(out) == kind
    extra = unlisted(out, [e.path for e in read_manifest(out).files]) if own else \
        sorted(p.relative_to(out) for p in out.iterdir())
    if extra:
        found = listed(extra)
        if kind is None:
            raise UsageError(f"{out} is not empty (it holds {found}); name a new or empty folder")
        raise UsageError(f"{out} holds {found}, which zckpt_nb did not write; it replaces only its own earlier {kind} "
                         "output: name a new or empty folder, or move those files out")


def check_fit(manifest: Manifest, tag_dir: Path, world_size: int | None, identity: dict[str, Any] | None) -> None:
    """The checkpoint was written by this many ranks and by this model, or say what differs."""
    if world_size is not None and manifest.world_size != world_size:
        raise CheckpointError(
            f"{tag_dir} was saved by {manifest.world_size} ranks; this run has {world_size}. Resume with "
            f"--nproc {manifest.world_size}, or load it on any number of ranks: `train --resume` converts it, and "
            "zckpt_nb.resume does for an engine built with DeepSpeed's \"checkpoint\": {\"load_universal\": true}")
    if identity is not None and manifest.adopted:
        kind = (manifest.identity or {}).get("model_type", "causal LM")
        raise CheckpointError(f"{tag_dir} holds a `{kind}` model trained outside zckpt_nb (adopted); `train` builds "
                              "only the package's presets (--model tiny, small, ...): resume it in your own training "
                              "loop with zckpt_nb.resume(engine, output_dir) (docs/api.md)")
    if identity is not None and manifest.identity != identity:
        saved = manifest.identity or {}
        differ = "; ".join(f"{k} {saved.get(k)!r} (this run: {identity.get(k)!r})"
                           for k in sorted({*saved, *identity}) if saved.get(k) != identity.get(k))
        raise CheckpointError(f"{tag_dir} was saved with {differ}. Resume with the same --model and "
                              "--global_batch, or use another --output_dir")


def listed_files(ckpt_dir: str | Path, tag: str, world_size: int | None = None,
                 identity: dict[str, Any] | None = None) -> tuple[Manifest, list[tuple[Path, FileEntry]]]:
    """Every check on checkpoint `tag` but the hashes: its manifest and each file here with its entry."""
    if not is_plain_name(tag):  # `latest` or --tag naming `../elsewhere`
        raise CheckpointError(f"checkpoint tag {tag[:60]!r} is not a folder name inside {ckpt_dir}; pass a tag "
                              "like global_step40")
    tag_dir = Path(ckpt_dir) / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"no checkpoint folder {tag_dir}")
    manifest = read_manifest(tag_dir)
    if manifest.kind is not None or manifest.tag != tag:
        raise CheckpointError(f"{tag_dir / MANIFEST} describes {manifest.kind or 'tag'} {manifest.tag!r}, not the "
                              f"save {tag!r}")
    check_fit(manifest, tag_dir, world_size, identity)
    check_paths(tag_dir, manifest.files, tag_dir / MANIFEST)
    check_paths(tag_dir.parent, manifest.shared, tag_dir / MANIFEST)
    check_listed(tag_dir, manifest)
    ranks = {(int(m.group(1)), m.group(2)) for e in manifest.files if (m := RANK_FILE.search(e.path))}
    missing = [(rank, kind) for rank in range(manifest.world_size or 0) for kind in ("model", "optim")
               if (rank, kind) not in ranks]  # every rank 0..W-1 has its model and optimizer file listed
    if missing:
        rank, kind = missing[0]
        raise CheckpointError(f"{tag_dir}: the manifest lists no {kind} file for rank {rank} of {manifest.world_size}")
    here = [e for e in manifest.files if e not in manifest.elsewhere()]  # node-local: other nodes hold the rest
    entries = [(tag_dir, e) for e in here] + [(tag_dir.parent, e) for e in manifest.shared]
    return manifest, [(check_file(folder, e), e) for folder, e in entries]  # every presence and size first


def verify_tag(ckpt_dir: str | Path, tag: str, *, world_size: int | None = None,
               identity: dict[str, Any] | None = None, ranks: list[int] | None = None) -> Manifest:
    """Run every check on checkpoint `tag`; hash only the files of `ranks` (all when None). Returns the manifest."""
    manifest, files = listed_files(ckpt_dir, tag, world_size, identity)
    check_hashes([(path, e.sha256) for path, e in files if ranks is None or e.rank in ranks])
    return manifest


def verify_folder(folder: str | Path, kind: str) -> Manifest:
    """Check a folder of `kind` against its manifest: nothing unlisted, every file's size and SHA-256."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.kind != kind:
        raise CheckpointError(f"{folder / MANIFEST} is not the manifest of a {kind} checkpoint")
    check_paths(folder, manifest.files, folder / MANIFEST, nested=True)
    check_listed(folder, manifest)
    check_hashes([(check_file(folder, e), e.sha256) for e in manifest.files])
    return manifest


def check_config(ckpt_dir: str | Path, expected: dict[str, Any], model: str) -> None:
    """`config.json` beside the checkpoint has the shape of the model this run builds, or name both."""
    path = Path(ckpt_dir) / "config.json"
    if path.is_file():
        saved, ours = ({k: c.get(k) for k in ARCHITECTURE} for c in (read_json(path), expected))
        if saved != ours:
            raise CheckpointError(f"{path} describes {saved}, but this run's --model {model} is {ours}; resume "
                                  "with the --model that config.json describes, or use another --output_dir")


def verify(ckpt_dir: str | Path, tag: str | None = None) -> Manifest:
    """`python -m zckpt_nb verify`: check `tag` (default: what `latest` names) completely."""
    tag = tag or latest_name(ckpt_dir)
    if tag is None:
        raise CheckpointError(f"{ckpt_dir} has no 'latest' file; pass --tag or point at a checkpoint folder")
    kind = read_kind(Path(ckpt_dir) / tag) if is_plain_name(tag) else None
    return verify_folder(Path(ckpt_dir) / tag, kind) if kind else verify_tag(ckpt_dir, tag)


def read_kind(folder: Path) -> str | None:
    """The `kind` a folder's manifest names (None for a save, or without a readable manifest)."""
    try:
        return read_manifest(folder).kind
    except CheckpointError:
        return None


def tag_to_resume(ckpt_dir: str | Path, among: set[str] | None = None) -> tuple[str, str | None]:
    """The newest committed tag (of `among`, when given), and one line saying what was skipped."""
    committed = [t for t in committed_tags(ckpt_dir) if among is None or t in among]
    if not committed:
        uncommitted = incomplete_tags(ckpt_dir)
        adopt = f"; if {uncommitted[-1]} is a complete save another tool wrote (DeepSpeed's own save_checkpoint " \
            f"writes no manifest), `python -m zckpt_nb adopt {ckpt_dir}` checks and commits it" if uncommitted else ""
        raise CheckpointError(f"no committed checkpoint in {ckpt_dir} (no tag folder holds {MANIFEST}"
                              f"{'' if among is None else ' on every node'}){adopt}")
    tag = committed[-1]
    newer = [t for t in incomplete_tags(ckpt_dir) if tag_step(t) > tag_step(tag)]
    partial = [t for t in committed_tags(ckpt_dir) if tag_step(t) > tag_step(tag)]  # committed here, not everywhere
    notes = [f"ignoring incomplete {noun(len(newer), 'checkpoint')} {', '.join(newer)} (no manifest: the save never "
             "committed)"] if newer else []
    notes += [f"ignoring {', '.join(partial)} (not committed on every node)"] if partial else []
    if latest_name(ckpt_dir) != tag:
        notes.append(f"'latest' names {str(latest_name(ckpt_dir))[:60]!r}, the newest committed is {tag}")
    return tag, ("; ".join(notes) + f"; resuming from {tag}") if notes else None


def newest_committed(ckpt_dir: str | Path, doing: str) -> str:
    """`tag_to_resume`'s tag, printing what it skipped in terms of what is `doing` it ('converting', ...)."""
    tag, note = tag_to_resume(ckpt_dir)
    if note:
        print(note.replace("resuming", doing), flush=True)
    return tag


def describe_manifest(manifest: Manifest) -> str:
    """One line for a checkpoint that passed every check."""
    total, away, m = manifest.total_bytes(), manifest.elsewhere(), manifest
    if m.kind == "universal":
        return (f"ok: universal copy of {m.tag} (step {m.step}, converted from {m.source_world_size} ranks, loads "
                f"on any number; {len(m.files)} files, {total:,} bytes, every size and SHA-256 matches)")
    ok = (f"ok: {m.tag} (step {m.step}, {m.world_size} ranks, {len(m.files)} files, {total:,} bytes, every size and "
          "SHA-256 matches)")
    if not away:
        return ok
    nodes = sorted({e.node for e in away})
    return (ok.replace("every size", f"node {m.node}'s part checked here: every size") +
            f"; {len(away)} files live on node(s) {', '.join(map(str, nodes))} ({', '.join(e.path for e in away)}): "
            "run verify there, or collect the parts (python -m zckpt_nb collect)")
