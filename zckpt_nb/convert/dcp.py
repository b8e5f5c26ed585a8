"""Leave DeepSpeed with the optimizer: a ZeRO-3 checkpoint as a PyTorch DCP checkpoint that FSDP2 loads on any N.

The known way out of DeepSpeed (zero_to_fp32, then safetensors) keeps the weights and drops Adam's moments. Here the
checkpoint's universal copy (`convert.reshard`: one folder per parameter with its fp32 weights and both moments) is
written as a `torch.distributed.checkpoint` (DCP) checkpoint under torchtitan's top-level names:

- "model": what `get_state_dict(model, optimizer)` gives for the same Hugging Face model under FSDP2 (a tied weight
  under each of its names, as `model.state_dict()` lists them);
- "optimizer": what it gives for `torch.optim.AdamW` (per parameter FQN `exp_avg`, `exp_avg_sq`, `step`; the param
  group's lr, betas, eps, weight decay), which continues DeepSpeed's `torch_adam` AdamW exactly: it is the same class;
- "lr_scheduler": DeepSpeed's scheduler state (WarmupDecayLR's `last_batch_iteration`); "train_state": the step, the
  data position (seed, global batch) and the LR horizon.

Full (unsharded) tensors are written; DCP reshards them into DTensors on load, on any world size. The writer streams:
the state dict holds meta-device placeholders and the planner loads one tensor when DCP asks for it, freeing the one
before. DCP's `.metadata` is written last, then the package's manifest over every file, then the folder is renamed
into place: committed like every other checkpoint here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from zckpt_nb.convert.reshard import ensure_universal, file_entries, manifest_hash
from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.verify import newest_committed, read_kind, verify_universal
from zckpt_nb.errors import CheckpointError, UsageError
from zckpt_nb.format.client_state import CLIENT_KEY
from zckpt_nb.format.disk import atomic_write, fsync_dir
from zckpt_nb.format.layout import DCP_KIND, MANIFEST, UNIVERSAL, tag_for, universal_dir
from zckpt_nb.format.manifest import FORMAT, read_manifest
from zckpt_nb.measure import meters
from zckpt_nb.model import model_config

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHTS_FILE = "fp32"  # the universal copy's name for a parameter's fp32 weights


def rss_now() -> int:
    """This process's resident set size now, in bytes (the baseline a peak is compared with)."""
    import psutil

    return psutil.Process().memory_info().rss


def model_states(folder: Path) -> dict[str, Any]:
    """Rank 0's model-states file of a universal copy, read weights-only: names, shapes, ties, scheduler, client."""
    return load(min(folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")), mmap=True)


def adam_state(folder: Path) -> tuple[dict[str, Any], Any]:
    """The universal copy's AdamW param group (without its params) and its step, memory-mapped (its moments are
    rank 0's whole partition; only the step is read)."""
    optim = load(folder / "zero" / "optimizer_state.pt", mmap=True)
    groups, state = optim["param_groups"], optim["optimizer_state_dict"]["state"]
    if len(groups) != 1:
        raise CheckpointError(f"{folder} has {len(groups)} optimizer parameter groups; to-dcp converts one")
    group = {k: v for k, v in groups[0].items() if k != "params"}
    return group, next(iter(state.values()))["step"].clone()


def dcp_state(folder: Path) -> tuple[dict[str, Any], dict[int, tuple[Path, tuple[int, ...]]]]:
    """The DCP state dict with meta placeholders, and each placeholder's source file and shape (keyed by id)."""
    import torch

    states = model_states(folder)
    shapes = {name: tuple(shape) for group in states["param_shapes"] for name, shape in group.items()}
    ties, buffers = states.get("shared_params", {}), set(states.get("buffer_names", []))
    group, step = adam_state(folder)
    sources: dict[int, tuple[Path, tuple[int, ...]]] = {}

    def placeholder(name: str, kind: str) -> Any:
        tensor = torch.empty(shapes[name], dtype=torch.float32, device="meta")
        sources[id(tensor)] = (folder / "zero" / name / f"{kind}.pt", shapes[name])
        return tensor

    # get_state_dict lists a tied weight under each of its names (lm_head.weight is transformer.wte.weight)
    model = {key: states["module"][key] if key in buffers else placeholder(ties.get(key, key), WEIGHTS_FILE)
             for key in states["module"]}
    optim_state = {name: {**{m: placeholder(name, m) for m in MOMENTS}, "step": step.clone()} for name in shapes}
    client = {k: v for k, v in states.get(CLIENT_KEY, {}).items() if k != "rng"}  # RNG is per rank: not carried
    return {"model": model, "optimizer": {"state": optim_state, "param_groups": [{**group, "params": list(shapes)}]},
            "lr_scheduler": dict(states.get("lr_scheduler") or {}), "train_state": client}, sources


def streaming_planner(sources: dict[int, tuple[Path, tuple[int, ...]]]) -> Any:
    """A DCP save planner that loads each placeholder's tensor when the writer asks for it, one at a time.

    DCP's FileSystemWriter keeps a reference to every tensor it wrote into a file until that file is closed (it
    builds a dict of them for its safetensors format), so the tensor before is freed here once it is written: the
    writer asks for the next one only after writing the last. No DCP option bounds this; hence the subclass.
    """
    from torch.distributed.checkpoint import DefaultSavePlanner

    class StreamingPlanner(DefaultSavePlanner):
        last: Any = None

        def resolve_data(self, write_item: Any) -> Any:
            source = sources.get(id(self.lookup_object(write_item.index)))
            if source is None:
                return super().resolve_data(write_item)
            self.release()
            path, shape = source
            self.last = load(path).reshape(shape).clone()  # a storage of its own, which release() can free
            return self.last

        def release(self) -> None:
            if self.last is not None:
                self.last.untyped_storage().resize_(0)
                self.last = None

    return StreamingPlanner()


def write_dcp(folder: Path, out: Path) -> dict[str, Any]:
    """Write universal copy `folder` as a DCP checkpoint into `out` (no process group); seconds and peak RSS."""
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no process group is the point
    meters.reset_rss_high_water()
    baseline, start = rss_now(), time.perf_counter()
    state, sources = dcp_state(folder)
    planner = streaming_planner(sources)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out, sync_files=True), planner=planner, no_dist=True)
    planner.release()
    return {"seconds": time.perf_counter() - start, "baseline_rss_bytes": baseline,
            "peak_rss_bytes": meters.rss_high_water() or 0}


def check_out_dir(out: Path) -> None:
    """Refuse to replace a folder that is not an earlier DCP conversion (nothing of the user's is deleted)."""
    if out.exists() and any(out.iterdir()) and read_kind(out) != DCP_KIND:
        raise UsageError(f"{out} exists and is not a DCP checkpoint written by to-dcp; name a new or empty folder")


def to_dcp(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """Convert committed checkpoint `tag` (default: the newest) of `ckpt_dir` into a committed DCP folder `out_dir`."""
    ckpt_dir, out = Path(ckpt_dir), Path(out_dir).resolve()
    check_out_dir(out)
    tag = tag or newest_committed(ckpt_dir, "converting to DCP")
    universal, reused = ensure_universal(ckpt_dir, tag)
    tmp = out.with_name(f"{out.name}.converting")
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion that crashed earlier: never loaded
    cost = write_dcp(universal_dir(ckpt_dir, tag), tmp)
    cost["universal"] = {**universal["conversion"], "reused": reused}
    files = file_entries(tmp)
    cost["bytes"] = sum(f["bytes"] for f in files)
    atomic_write(tmp / MANIFEST, json.dumps({
        "format": FORMAT, "kind": DCP_KIND, "tag": tag, "step": universal["step"],
        "source_world_size": universal["source_world_size"], "identity": universal.get("identity"),
        "source_manifest_sha256": manifest_hash(ckpt_dir, tag), "conversion": cost, "files": files}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return read_manifest(out)


def largest_state_bytes(ckpt_dir: str | Path, tag: str) -> int:
    """The bound's unit: the largest parameter's fp32 state (weights and both Adam moments), in bytes."""
    states = model_states(universal_dir(ckpt_dir, tag))
    largest = max(int(s.numel()) for group in states["param_shapes"] for s in group.values())
    return 3 * 4 * largest


def describe_to_dcp(manifest: dict[str, Any]) -> str:
    """One line: what was converted, its bytes, seconds and peak memory above the baseline."""
    c = manifest["conversion"]
    extra = (c["peak_rss_bytes"] - c["baseline_rss_bytes"]) / 2**20
    return (f"{manifest['tag']} (saved by {manifest['source_world_size']} rank(s), step {manifest['step']}) is now a "
            f"DCP checkpoint of {c['bytes'] / 2**20:.1f} MiB in {len(manifest['files'])} files, written in "
            f"{c['seconds']:.1f} s with a peak of {extra:.0f} MiB above the converter's baseline; FSDP2 loads it on "
            "any number of ranks with dcp.load and set_state_dict")


def read_dcp(folder: Path, keys: dict[str, Any]) -> dict[str, Any]:
    """Load the flat DCP `keys` (fqn -> an empty tensor or a placeholder value) from `folder`, no process group."""
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.load(keys, checkpoint_id=folder, no_dist=True)
    return keys


def dcp_globals(folder: Path) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """A DCP checkpoint's parameter FQNs (the optimizer's order), its AdamW param group, and everything else that
    is not a tensor (lr_scheduler.*, train_state.*), read from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    values = read_dcp(folder, {k: None for k, v in meta.items() if isinstance(v, BytesStorageMetadata)})
    prefix = "optimizer.param_groups.0."
    group = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
    if any(k.startswith("optimizer.param_groups.1.") for k in values):
        raise CheckpointError(f"{folder} has more than one optimizer parameter group; from-dcp converts one")
    return group.pop("params"), group, values


def write_param(folder: Path, zero: Path, name: str, shape: Any) -> Any:
    """One parameter's fp32 weights and both moments from the DCP checkpoint into zero/<name>/ (flat, as
    ds_to_universal writes them); returns its step."""
    import torch

    optim = f"optimizer.state.{name}"
    keys = {f"model.{name}": torch.empty(shape), **{f"{optim}.{m}": torch.empty(shape) for m in MOMENTS},
            f"{optim}.step": torch.zeros(())}
    got = read_dcp(folder, keys)
    (zero / name).mkdir(parents=True)
    torch.save(got[f"model.{name}"].flatten(), zero / name / f"{WEIGHTS_FILE}.pt")
    for m in MOMENTS:
        torch.save(got[f"optimizer.state.{name}.{m}"].flatten(), zero / name / f"{m}.pt")
    return got[f"{optim}.step"]


def tied_names(config: str) -> dict[str, str]:
    """Each tied weight's other names -> its first name, from the model `config` builds on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(config))
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name}


def zero_states(params: dict[str, Any], ties: dict[str, str], values: dict[str, Any], world: int) -> dict[str, Any]:
    """The model-states file DeepSpeed's universal load reads (rank 0's): names, shapes, ties, scheduler, client."""
    from collections import OrderedDict

    import deepspeed
    import torch

    train = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("train_state.")}
    scheduler = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("lr_scheduler.")}
    names = [*params, *ties]
    return {"module": OrderedDict((n, torch.empty(0)) for n in names), "buffer_names": [], "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in params.items())],
            "frozen_param_shapes": OrderedDict(), "shared_params": ties, "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": scheduler, "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
            "global_steps": train["step"], "global_samples": train["step"] * train["global_batch"],
            "dp_world_size": world, "mp_world_size": 1, "ds_version": deepspeed.__version__,
            CLIENT_KEY: train}


def from_dcp(dcp_dir: str | Path, out_dir: str | Path, config: str) -> dict[str, Any]:
    """Convert a committed DCP checkpoint (to-dcp's or the FSDP2 worker's) into a ZeRO-3 checkpoint folder
    `out_dir` whose universal copy `train --resume` loads on any number of ranks; returns the universal manifest."""
    import torch

    folder, out = Path(dcp_dir), Path(out_dir).resolve()
    source = verify_universal(folder, kind=DCP_KIND)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} is not empty; name a new or empty folder for from-dcp")
    start, ties, hf_config = time.perf_counter(), tied_names(config), model_config(config)  # a bad --config: now
    names, group, values = dcp_globals(folder)
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    params = {n: tuple(meta[f"model.{n}"].size) for n in names}
    tag, train = tag_for(source["step"]), {k: v for k, v in values.items() if k.startswith("train_state.")}
    uni = universal_dir(out, tag)
    steps = [write_param(folder, uni / "zero", n, s) for n, s in params.items()]
    torch.save({"optimizer_state_dict": {"state": {0: {"step": steps[0]}}, "param_groups": [{**group, "params": [0]}]},
                "param_groups": [{**group, "params": [0]}]}, uni / "zero" / "optimizer_state.pt")
    states = zero_states(params, ties, values, source["source_world_size"])
    torch.save(states, uni / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    identity = {"model": (source.get("identity") or {}).get("model"), "num_params": sum(
        math.prod(s) for s in params.values()), "global_batch": train["train_state.global_batch"]}
    atomic_write(out / "config.json", hf_config.to_json_string())
    (out / tag).mkdir()
    atomic_write(out / tag / MANIFEST, json.dumps({"format": FORMAT, "tag": tag, "step": source["step"],
                                                   "world_size": 0, "identity": identity, "from_dcp": str(folder),
                                                   "files": []}, indent=1))  # no rank files: load the universal copy
    files = file_entries(uni)
    cost = {"seconds": time.perf_counter() - start, "peak_rss_bytes": meters.rss_high_water() or 0,
            "bytes": sum(f["bytes"] for f in files), "source_bytes": sum(f["bytes"] for f in source["files"])}
    atomic_write(uni / MANIFEST, json.dumps({
        "format": FORMAT, "kind": UNIVERSAL, "tag": tag, "step": source["step"],
        "source_world_size": source["source_world_size"], "identity": identity,
        "source_manifest_sha256": manifest_hash(out, tag), "conversion": cost, "files": files}, indent=1))
    atomic_write(out / "latest", tag)
    fsync_dir(out)
    return read_manifest(uni)
