"""A ZeRO-3 checkpoint as a PyTorch DCP checkpoint with its AdamW state (`to_dcp`), and back (`from_dcp`).

to-dcp streams each parameter's fp32 weights and moments, one tensor at a time, from the rank files
(`convert.zero_shards`) or a universal copy (`convert.reshard`) into the state dict `get_state_dict(model, optimizer)`
gives under FSDP2, with torchtitan's top-level names; every file is hashed as written and the folder committed only
once the rank files' SHA-256 matched. from-dcp reads any DCP checkpoint of a causal LM (`convert.dcp_layout`) without
running code from its bytes and writes DeepSpeed's universal layout. docs/dcp.md describes both.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.convert import export
from zckpt_nb.convert.dcp_layout import (
    Layout,
    ModelNames,
    find_layout,
    global_keys,
    param_group,
    resolve_step,
    saved_step,
)
from zckpt_nb.convert.reshard import ensure_universal, manifest_hash, reusable
from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.verify import check_hashes, check_output, listed_files, newest_committed, verify_folder
from zckpt_nb.convert.zero_shards import MOMENTS, WEIGHTS, ShardReader, check_frozen_kept
from zckpt_nb.errors import CheckpointError, UsageError, first_line, os_error_in
from zckpt_nb.format.client_state import CLIENT_KEY
from zckpt_nb.format.disk import atomic_write, fsync_all, staged
from zckpt_nb.format.layout import DCP_KIND, MANIFEST, UNIVERSAL, tag_for, universal_dir
from zckpt_nb.format.manifest import Manifest, commit, entries_under, read_manifest
from zckpt_nb.format.units import counted, secs
from zckpt_nb.format.writer import DirectFile, skip_crc32
from zckpt_nb.measure import meters
from zckpt_nb.model import model_config, on_meta, tied_names

RANK_FILES, UNIVERSAL_COPY = "rank files", "universal copy"  # to-dcp's two routes (the manifest's conversion.route)
M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD = -3, 128 << 10  # glibc's malloc.h; its default, mallopt(3)
# What DCP's `.metadata` pickles (torch 2.13): its metadata dataclasses and the few types they hold; torch's dtypes too
DCP_TYPES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}
MAX_METADATA_BYTES = 1 << 28
DCP_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@contextmanager
def large_frees_returned() -> Iterator[None]:
    """Within: glibc returns freed blocks of 1 MiB or more to the kernel at once; after: its default, 128 KiB."""
    mallopt = getattr(meters.libc(), "mallopt", None)  # not glibc: its allocator has no such threshold to fix
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)


class Source:
    """Where to-dcp reads each parameter: the tag's rank files (`shards`) or its universal copy (`folder/zero`)."""

    def __init__(self, folder: Path, manifest: Manifest, universal: bool) -> None:
        self.folder, self.universal = folder, universal
        self.shards = ShardReader(folder, [e.path for e in manifest.files])  # frozen weights: in both layouts
        self.states = self.shards.states
        self.shapes = {name: shape for group in self.states["param_shapes"] for name, shape in group.items()}

    def adam(self) -> tuple[dict[str, Any], Any]:
        """The AdamW param group (without its params) and the step, from DeepSpeed's optimizer state dict."""
        where = self.folder / "zero" / "optimizer_state.pt" if self.universal else self.shards.optims.paths[0]
        optim = (load(where, mmap=True) if self.universal else self.shards.optimizer())["optimizer_state_dict"]
        if len(optim["param_groups"]) != 1:
            raise CheckpointError(f"{where} has {len(optim['param_groups'])} optimizer parameter groups; to-dcp "
                                  "converts one")
        group = {k: v for k, v in optim["param_groups"][0].items() if k != "params"}
        return group, next(iter(optim["state"].values()))["step"].clone()

    def read(self, name: str, kind: str) -> Any:
        """Parameter `name`'s `kind` (fp32 weights or a moment), whole, in a storage of its own."""
        if name in self.shards.frozen:
            return self.shards.frozen_weight(name)
        if self.universal:
            return load(self.folder / "zero" / name / f"{kind}.pt", mmap=True).reshape(self.shapes[name]).clone()
        return self.shards.trainable(name, kind)


def dcp_state(source: Source) -> tuple[dict[str, Any], dict[int, tuple[str, str]]]:
    """The DCP state dict with meta placeholders, and each placeholder's parameter and kind (keyed by id)."""
    import torch

    states, trainable = source.states, source.shapes
    shapes = {**source.shards.frozen, **trainable}
    ties, buffers = states.get("shared_params", {}), set(states.get("buffer_names", []))
    group, step = source.adam()
    sources: dict[int, tuple[str, str]] = {}

    def placeholder(name: str, kind: str) -> Any:
        tensor = torch.empty(shapes[name], dtype=torch.float32, device="meta")
        sources[id(tensor)] = (name, kind)
        return tensor

    # get_state_dict lists a tied weight under each of its names (lm_head.weight is transformer.wte.weight)
    model = {key: states["module"][key] if key in buffers else placeholder(ties.get(key, key), WEIGHTS)
             for key in states["module"]}
    optim_state = {name: {**{m: placeholder(name, m) for m in MOMENTS}, "step": step.clone()} for name in trainable}
    client = {k: v for k, v in states.get(CLIENT_KEY, {}).items() if k != "rng"}  # RNG is per rank: not carried
    client = {"step": states.get("global_steps", 0), **client}  # an adopted save has no client state of ours
    return {"model": model, "optimizer": {"state": optim_state, "param_groups": [{**group, "params": list(trainable)}]},
            "lr_scheduler": dict(states.get("lr_scheduler") or {}), "train_state": client}, sources


def streaming_planner(source: Source, sources: dict[int, tuple[str, str]]) -> Any:
    """A DCP save planner that reads each tensor in a thread and frees the one before it (docs/dcp.md)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from zckpt_nb.convert.prefetch import Prefetch

    class StreamingPlanner(DefaultSavePlanner):
        last: Any = None
        reader: Prefetch | None = None

        def finish_plan(self, new_plan: Any) -> Any:
            plan = super().finish_plan(new_plan)
            wanted = [sources.get(id(self.lookup_object(item.index))) for item in plan.items
                      if item.type != WriteItemType.BYTE_IO]
            self.reader = Prefetch(lambda w: source.read(*w), [w for w in wanted if w is not None])
            return plan

        def resolve_data(self, write_item: Any) -> Any:
            wanted = sources.get(id(self.lookup_object(write_item.index)))
            if wanted is None:
                return super().resolve_data(write_item)
            self.release()
            self.last = self.reader.get(wanted)
            return self.last

        def release(self) -> None:
            if self.last is not None:
                self.last.untyped_storage().resize_(0)
                self.last = None

        def close(self) -> None:
            self.release()
            if self.reader is not None:
                self.reader.close()

    return StreamingPlanner()


def hashing_writer(out: Path) -> Any:
    """DCP's FileSystemWriter through `DirectFile` (fsynced); `digests`: SHA-256 by final file name."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    digests: dict[str, str] = {}

    class HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with DirectFile(path) as stream:
                yield stream
            digests[Path(path).name] = stream.hexdigest()

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)
            digests[Path(new_path).name] = digests.pop(Path(path).name)

    writer = FileSystemWriter(out, sync_files=True)
    writer.fs, writer.digests = HashingFileSystem(), digests  # fs: the one the writer opens every file through
    return writer


def write_dcp(source: Source, out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Write `source` as a DCP checkpoint into `out`, durably; its seconds and RSS, each file's SHA-256."""
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no process group is the point
    import psutil

    meters.reset_rss_high_water()
    baseline, start = psutil.Process().memory_info().rss, time.perf_counter()
    state, sources = dcp_state(source)
    planner, writer = streaming_planner(source, sources), hashing_writer(out)
    skip_crc32()  # torch.save's per-record CRC-32: every file's SHA-256 goes in the manifest (format.writer)
    with large_frees_returned():
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        finally:
            planner.close()
    source.shards.drop()
    return {"seconds": time.perf_counter() - start, "baseline_rss_bytes": baseline,
            "peak_rss_bytes": meters.rss_high_water() or 0}, writer.digests


def plain_source(folder: Path, manifest: Manifest) -> Source | None:
    """A tag folder's rank files as the source, indexed, where they hold the plain ZeRO-3 layout; else None."""
    source = Source(folder, manifest, universal=False)
    if not source.shards.plain():
        return None
    source.shards.index(source.shapes)
    return source


def open_source(ckpt_dir: Path, tag: str, route: str | None, pool: Any) -> tuple[Source, dict[str, Any], Any]:
    """The source to-dcp reads (rank files or universal copy), its facts, and the rank files' hash check."""
    reuse = route == UNIVERSAL_COPY or (route is None and reusable(ckpt_dir, tag) is not None)
    manifest, files = (None, []) if reuse else listed_files(ckpt_dir, tag)  # nothing unlisted, every size: first
    if manifest and manifest.world_size and not manifest.elsewhere():  # else from-dcp's output, a node's part
        check = pool.submit(check_hashes, [(path, e.sha256) for path, e in files])  # while they are read, written
        try:
            source = plain_source(ckpt_dir / tag, manifest)
        except Exception as error:
            raise checked_first(check, error) from error
        if source is not None:
            skipped = {"seconds": 0.0, "peak_rss_bytes": 0, "bytes": 0, "source_bytes": 0, "reused": False}
            return source, {"route": RANK_FILES, "universal": skipped, "manifest": manifest}, check
        check.result()  # a CheckpointError now rather than from the universal route's check
    if route == RANK_FILES:
        raise CheckpointError(f"{ckpt_dir / tag} has no plain ZeRO-3 rank files here to read; convert it through "
                              "its universal copy")
    universal, reused = ensure_universal(ckpt_dir, tag)
    facts = {"route": UNIVERSAL_COPY, "universal": {**universal.conversion, "reused": reused}, "manifest": universal}
    return Source(universal_dir(ckpt_dir, tag), universal, universal=True), facts, None


def dcp_cause(error: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (which wraps every failure), else `error`."""
    failures = getattr(error, "failures", None)
    return next(iter(failures.values()))[0] if failures else error


def checked_first(check: Any, error: BaseException) -> BaseException:
    """The rank files' failed check (waited for), else `error` unwrapped from DCP's exception."""
    failed = check.exception() if check is not None else None
    cause = dcp_cause(error)
    return failed or os_error_in(cause) or cause  # a full disk is said as such, not as torch's zip writer's words


def to_dcp(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None,
           route: str | None = None) -> Manifest:
    """Convert committed checkpoint `tag` of `ckpt_dir` into a committed DCP folder `out_dir` (docs/dcp.md)."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.checkpoint import CheckpointException  # DCP's, a BaseException: caught by name

    ckpt_dir, out = Path(ckpt_dir), Path(out_dir).absolute()
    if route not in (None, RANK_FILES, UNIVERSAL_COPY):
        raise UsageError(f"route {route!r}: pass None, {RANK_FILES!r} or {UNIVERSAL_COPY!r}")
    check_output(out, DCP_KIND)
    tag = tag or newest_committed(ckpt_dir, "converting to DCP")
    with ThreadPoolExecutor(max_workers=1) as pool:
        source, facts, check = open_source(ckpt_dir, tag, route, pool)
        beside = (lambda: export.model_config(ckpt_dir)) if (ckpt_dir / "config.json").is_file() else lambda: None
        check_frozen_kept(source.states, beside, set(source.states["module"]), ckpt_dir / tag)
        with staged(out) as tmp:
            try:
                cost, digests = write_dcp(source, tmp)
                waited = time.perf_counter()
                seconds = check.result() if check else 0.0  # the rank files' hashes (CheckpointError where one differs)
                cost.update(check_seconds=seconds, check_wait_seconds=time.perf_counter() - waited if check else 0.0,
                            route=facts["route"], universal=facts["universal"])
            except (Exception, CheckpointException) as error:
                raise checked_first(check, error) from error
            known, files = facts["manifest"], entries_under(tmp, digests)
            commit(tmp, Manifest(tag, known.step, files, kind=DCP_KIND, identity=known.identity,
                                 source_world_size=known.source_world_size or known.world_size,
                                 source_manifest_sha256=manifest_hash(ckpt_dir, tag),
                                 conversion=cost | {"bytes": sum(e.bytes for e in files)}), synced=True)
    return read_manifest(out)


def describe_to_dcp(manifest: Manifest) -> str:
    """One line: what was converted, its bytes, seconds and peak memory above the baseline."""
    c = manifest.conversion or {}
    extra = (c["peak_rss_bytes"] - c["baseline_rss_bytes"]) / 2**20
    ranks = counted(manifest.source_world_size, "rank")
    return (f"{manifest.tag} (saved by {ranks}, step {manifest.step}) is now a "
            f"DCP checkpoint of {c['bytes'] / 2**20:.1f} MiB in {len(manifest.files)} files, read from its "
            f"{c.get('route', UNIVERSAL_COPY)} and written in "
            f"{secs(c['seconds'])} s with a peak of {extra:.0f} MiB above the converter's baseline; FSDP2 loads it on "
            "any number of ranks with dcp.load and set_state_dict")


class MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` unpickled building only `DCP_TYPES` and dtypes (DCP's own reader is a plain pickle.load)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in DCP_TYPES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a type of DCP's metadata")


def dcp_metadata(folder: Path) -> Any:
    """`folder`'s DCP metadata, unpickled by `MetadataUnpickler` and checked; CheckpointError in one line otherwise."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_METADATA_BYTES:
                raise CheckpointError(f"{path} is larger than {MAX_METADATA_BYTES >> 20} MiB: not DCP's metadata")
            metadata = MetadataUnpickler(f).load()
        check_metadata(metadata, folder)
    except CheckpointError:
        raise
    except Exception as e:  # refused types, truncated or garbled pickles, fields of the wrong type: bad input
        raise CheckpointError(f"cannot read {path} ({first_line(e)}); refusing it (it could run code): restore the "
                              "checkpoint from a trusted copy") from None
    return metadata


def check_metadata(metadata: Any, folder: Path) -> None:
    """Every item of `metadata` lies inside a file of `folder`, and no tensor is larger than the files."""
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for index, info in metadata.storage_data.items():
        where = (getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None))
        if not (where[0] in files and all(type(n) is int and n >= 0 for n in where[1:])
                and where[1] + where[2] <= files[where[0]] and not getattr(info, "transform_descriptors", None)):
            raise ValueError(f"it places {getattr(index, 'fqn', index)!r} at {where}, outside the files of {folder}")
    for fqn, item in dict(metadata.state_dict_metadata).items():
        if isinstance(item, TensorStorageMetadata) and (not isinstance(item.properties.dtype, torch.dtype) or math.prod(
                item.size) * item.properties.dtype.itemsize > sum(files.values())):
            raise ValueError(f"it gives {fqn!r} a shape of {tuple(item.size)}, more than the files hold")


def read_dcp(folder: Path, keys: dict[str, Any], no_dist: bool = True) -> dict[str, Any]:
    """Load `keys` (fqn -> empty tensor) from DCP folder `folder` running no code from it: metadata checked first."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as DCP's own reader does
            return metadata

    class WeightsOnlyPlanner(dcp.DefaultLoadPlanner):  # before DCP's own unpickling, with weights_only=False
        def load_bytes(self, read_item: Any, value: Any) -> None:
            load(value, name=f"item {read_item.dest_index.fqn!r} of a DCP checkpoint")
            value.seek(0)
            super().load_bytes(read_item, value)

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        metadata = dcp_metadata(folder)  # refused here, before DCP's own machinery runs
        dcp.load(keys, storage_reader=VerifiedReader(folder), planner=WeightsOnlyPlanner(), no_dist=no_dist)
    except dcp.CheckpointException as error:
        cause = dcp_cause(error)
        if isinstance(cause, CheckpointError | OSError):
            raise cause from None
        raise CheckpointError(f"cannot read the DCP checkpoint {folder}: {first_line(cause)}") from None
    return keys


@dataclass(frozen=True)
class DcpSource:
    """A DCP checkpoint from-dcp reads: its manifest (or none), model, layout, param group, other values, step."""

    folder: Path
    manifest: Manifest | None
    names: ModelNames
    layout: Layout
    group: dict[str, Any]
    values: dict[str, Any]
    step: int
    world_size: int

    def under(self, top: str) -> dict[str, Any]:
        """The values saved under `top` ("train_state", "lr_scheduler"), by their key below it."""
        return {k.split(".", 1)[1]: v for k, v in self.values.items() if k.startswith(f"{top}.")}


def dcp_manifest(folder: Path) -> Manifest | None:
    """The package's manifest of a DCP checkpoint, verified; None for one it did not write (DCP's `.metadata`)."""
    if (folder / MANIFEST).is_file():
        return verify_folder(folder, DCP_KIND)
    if (folder / ".metadata").is_file():
        return None
    inside = sorted(p.parent.name for p in folder.glob("*/.metadata")) if folder.is_dir() else []
    hint = f" (it holds {', '.join(inside[:3])}: name one)" if inside else ""
    raise CheckpointError(f"{folder} is not a DCP checkpoint: it has neither DCP's .metadata (dcp.save writes it "
                          f"last) nor {MANIFEST}; name the folder dcp.save wrote{hint}")


def param_batches(params: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """The parameters in order, in groups whose fp32 state stays within the largest parameter's (one dcp.load each)."""
    limit, groups, size = 12 * max(math.prod(s) for s in params.values()), [[]], 0
    for name, shape in params.items():
        if groups[-1] and size + 12 * math.prod(shape) > limit:
            groups, size = [*groups, []], 0
        groups[-1].append(name)
        size += 12 * math.prod(shape)
    return groups


def read_params(source: DcpSource, names: list[str]) -> dict[str, Any]:
    """Parameters `names`' fp32 weights, moments and Adam steps in one dcp.load, by their keys there."""
    import torch

    keys: dict[str, Any] = {}
    at, shapes = source.layout, source.names.params
    for name in names:
        keys |= {at.weight(name): torch.empty(shapes[name]), at.state(name, "step"): torch.zeros(()),
                 **{at.state(name, m): torch.empty(shapes[name]) for m in MOMENTS}}
    return read_dcp(source.folder, keys)


def written_params(source: DcpSource, zero: Path, digests: dict[str, str]) -> list[Any]:
    """Every parameter into zero/<name>/ as ds_to_universal writes it (next batch read meanwhile); Adam's steps."""
    from zckpt_nb.convert.prefetch import Prefetch

    at, batches, steps = source.layout, param_batches(source.names.params), []
    reader = Prefetch(lambda names: read_params(source, names), map(tuple, batches))
    try:
        for names in batches:
            got = reader.get(tuple(names))
            for name in names:
                (zero / name).mkdir(parents=True)
                for kind, key in ((WEIGHTS, at.weight(name)), *((m, at.state(name, m)) for m in MOMENTS)):
                    path = zero / name / f"{kind}.pt"
                    digests[str(path.relative_to(zero.parent))] = save(got.pop(key).flatten(), path)  # popped: freed
                steps.append(got[at.state(name, "step")])
        return steps
    finally:
        reader.close()


def save(obj: Any, path: Path) -> str:
    """torch.save through `format.writer.DirectFile`, not fsynced (`write_zero` fsyncs every file together; a full disk
    raises its OSError); the file's SHA-256."""
    import torch

    with DirectFile(path, sync=False) as f:
        torch.save(obj, f)
    return f.hexdigest()


def zero_states(source: DcpSource) -> dict[str, Any]:
    """The model-states file DeepSpeed's universal load reads (rank 0's), the train state as client state."""
    from collections import OrderedDict

    import deepspeed
    import torch

    params, ties = source.names.params, source.names.ties
    train = {**source.under("train_state"), "step": source.step}
    samples = {"global_samples": source.step * train["global_batch"]} if train.get("global_batch") else {}
    return {"module": OrderedDict((n, torch.empty(0)) for n in [*params, *ties]), "buffer_names": [],
            "optimizer": None, "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in params.items())],
            "frozen_param_shapes": OrderedDict(), "shared_params": ties, "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": source.under("lr_scheduler"), "data_sampler": None, "random_ltd": None,
            "skipped_steps": 0, "global_steps": source.step, **samples, "dp_world_size": source.world_size,
            "mp_world_size": 1, "ds_version": deepspeed.__version__, CLIENT_KEY: train}


def from_dcp(dcp_dir: str | Path, out_dir: str | Path, config: str, step: int | None = None) -> Manifest:
    """Convert a DCP checkpoint of a causal LM into a ZeRO-3 folder holding a universal copy; its manifest."""
    folder, out = Path(dcp_dir), Path(out_dir).absolute()
    manifest = dcp_manifest(folder)
    check_output(out)
    hf_config = model_config(config)  # a bad --config: now
    model, metadata = on_meta(hf_config), dcp_metadata(folder)  # a tied parameter once, by its first name
    names = ModelNames({name: tuple(p.shape) for name, p in model.named_parameters()}, tied_names(model),
                       frozenset(model.state_dict()))
    layout = find_layout(folder, metadata.state_dict_metadata, names)  # then its param group, scheduler, train state
    values = read_dcp(folder, global_keys(metadata.state_dict_metadata, layout))
    saved = saved_step(folder, values)
    step = resolve_step(folder, manifest.step if saved is None and manifest else saved, step)
    # the ranks that wrote it, else as DCP's FileSystemWriter names each rank's files: __<rank>_<n>.distcp
    world = manifest.source_world_size if manifest and manifest.source_world_size else len({
        int(m[1]) for info in metadata.storage_data.values()
        if (m := DCP_RANK_FILE.match(str(getattr(info, "relative_path", ""))))}) or 1
    source = DcpSource(folder, manifest, names, layout, param_group(folder, values, layout, names), values, step, world)
    with staged(out) as tmp:
        tag = write_zero(tmp, source, hf_config)
    return read_manifest(universal_dir(out, tag))


def write_zero(out: Path, source: DcpSource, hf_config: Any) -> str:
    """Write the DCP checkpoint `source` into `out` as a ZeRO-3 checkpoint folder of one universal copy; its tag."""
    start = time.perf_counter()
    tag, params, group = tag_for(source.step), source.names.params, source.group
    uni, known = universal_dir(out, tag), source.manifest
    skip_crc32()  # as in write_dcp
    digests: dict[str, str] = {}
    with large_frees_returned():
        steps = written_params(source, uni / "zero", digests)
    if len(found := sorted({int(s) for s in steps})) > 1:
        raise CheckpointError(f"{source.folder}: Adam's step differs between parameters ({found}); DeepSpeed keeps "
                              "one step per parameter group")
    groups = [{**group, "params": [0]}]
    optim = {"optimizer_state_dict": {"state": {0: {"step": steps[0]}}, "param_groups": groups},
             "param_groups": groups}
    digests["zero/optimizer_state.pt"] = save(optim, uni / "zero" / "optimizer_state.pt")
    states = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    digests[states] = save(zero_states(source), uni / states)
    count = {"num_params": sum(math.prod(s) for s in params.values())}
    identity = {"model": (known.identity or {}).get("model"), **count, "global_batch": source.under(
        "train_state").get("global_batch")} if known else {"model_type": hf_config.model_type, **count}
    atomic_write(out / "config.json", hf_config.to_json_string())
    (out / tag).mkdir()
    commit(out / tag, Manifest(tag, source.step, [], world_size=0, identity=identity, from_dcp=str(source.folder)))
    files = entries_under(uni, digests)  # no rank files in the tag: DeepSpeed loads the universal copy
    fsync_all([uni / e.path for e in files])  # durable together, timed, before the manifest
    source_bytes = known.total_bytes() if known else sum(p.stat().st_size for p in source.folder.iterdir())
    cost = {"seconds": time.perf_counter() - start, "peak_rss_bytes": meters.rss_high_water() or 0,
            "bytes": sum(e.bytes for e in files), "source_bytes": source_bytes}
    commit(uni, Manifest(tag, source.step, files, kind=UNIVERSAL, identity=identity,
                         source_world_size=source.world_size, source_manifest_sha256=manifest_hash(out, tag),
                         conversion=cost), synced=True)
    atomic_write(out / "latest", tag)
    return tag
