"""A ZeRO-3 checkpoint's weights written as safetensors shards in a few MiB of memory, whatever the model's size.

DeepSpeed's lazy fp32 state dict (`get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)`) says where each
parameter's slices lie in the memory-mapped rank files; each shard's header is written from the shapes, then the
slices straight from the mappings, 1 MiB at a time, their pages released once written (docs/consolidation_costs.md).
The output is what transformers' `save_pretrained` writes, the tied head stored once; no model is built.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import shard_paths
from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.zero_shards import check_frozen_kept
from zckpt_nb.errors import UsageError, first_line
from zckpt_nb.format.disk import PAGE
from zckpt_nb.format.units import listed
from zckpt_nb.measure.meters import libc
from zckpt_nb.model import on_meta

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' names: model.safetensors, model-00001-of-00003...
INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                      "torch.float64": "F64", "torch.int64": "I64", "torch.int32": "I32", "torch.bool": "BOOL",
                      "torch.uint8": "U8"}
STEP = 2**20  # bytes written, then released from memory, at a time
AROUND = 2**20  # pages either side of a written range also released (the kernel maps some around each fault)
MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def lazy_state_dict(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """DeepSpeed's lazy fp32 state dict of checkpoint `tag`: a GatheredTensor or buffer per name."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:  # DeepSpeed's converter prints progress; the export reports in one line of its own
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag, lazy_mode=True)
    except Exception as e:  # truncated or inconsistent shards: one line naming the checkpoint
        raise UsageError(f"cannot convert checkpoint {ckpt_dir / tag}: {first_line(e)}; a shard file may be "
                         "truncated or corrupt (python -m zckpt_nb inspect lists every rank's files)") from None


def stored_names(lazy: dict[str, Any]) -> dict[str, Any]:
    """The tensors to write, each once, in order: a tied weight under its first name, as transformers does."""
    first: dict[int, str] = {}
    for name, t in lazy.items():
        first.setdefault(id(t), name)
    return {name: lazy[name] for name in first.values()}


def check_shapes(config: Any, tensors: dict[str, Any], build: bool) -> None:
    """UsageError unless `config`'s model has the checkpoint's weights (sizes; with `build`, every name)."""
    held, count = sum(t.shape.numel() for t in tensors.values()), len(tensors)
    vocab, width, layers = (int(getattr(config, k, 0) or 0) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    if vocab * width > held or layers > count:
        raise UsageError(f"the config describes {layers:,} layers and a {vocab:,} x {width:,} embedding, more than "
                         f"the checkpoint's {held:,} elements in {count} tensors: pass the config the model was "
                         "trained with (--config)")
    if not build:
        return
    try:
        model = on_meta(config)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"cannot build a causal LM from the config: {first_line(e)}") from None
    check_names(model, tensors, {name for name, _ in model.named_parameters()},  # tied weights once, as stored
                "pass the config the model was trained with (--config)")


def check_names(model: Any, tensors: dict[str, Any], needed: set[str], fix: str) -> None:
    """UsageError ending with `fix` unless `tensors` are `model`'s weights, shapes and all, `needed` included."""
    built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    unknown, missing = sorted(set(tensors) - set(built)), sorted(needed - set(tensors))
    if unknown or missing:
        parts = [f"{len(unknown)} of the checkpoint's weights are not the model's ({listed(unknown)})"] * bool(unknown)
        parts += [f"the checkpoint lacks {len(missing)} of its weights ({listed(missing)})"] * bool(missing)
        raise UsageError(f"the checkpoint's weights do not match the {type(model).__name__} its config describes: "
                         f"{'; '.join(parts)}; {fix}")
    for name, t in tensors.items():
        if built[name] != tuple(t.shape):
            raise UsageError(f"the config gives {name} the shape {built[name]}, the checkpoint {tuple(t.shape)}; "
                             "pass the config the model was trained with (--config)")


def rank_slices(t: Any) -> Iterator[Any]:
    """The 1-D views whose concatenation is `t` (a GatheredTensor's rank slices, in order), nothing copied."""
    from deepspeed.utils.zero_to_fp32 import GatheredTensor

    if not isinstance(t, GatheredTensor):  # a buffer, already in memory
        yield t.contiguous().reshape(-1)
        return
    left, end, bounds = t.shape.numel(), t.offset + t.partitioned_numel, t.flat_groups_offset
    for groups in t.flat_groups:
        for g, flat in enumerate(groups):
            lo, hi = max(t.offset, bounds[g]), min(end, bounds[g + 1])
            piece = flat[lo - bounds[g]:hi - bounds[g]][:left] if lo < hi else flat[:0]
            left -= piece.numel()
            if piece.numel():
                yield piece


def header(tensors: dict[str, Any]) -> bytes:
    """The safetensors header of `tensors`, stored in this order: length, then JSON padded to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.shape.numel() * t.dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class MappedFiles:
    """The address ranges this process has mapped from files (from /proc/self/maps), to drop pages only there."""

    def __init__(self) -> None:
        self.ranges = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                self.ranges.append((lo, hi))


def drop_pages(start: int, stop: int, mapped: MappedFiles) -> None:
    """Release the file-backed pages of [start, stop), AROUND bytes either side, from this process's memory."""
    mapping = next(((lo, hi) for lo, hi in mapped.ranges if lo <= start and stop <= hi), None)
    if mapping is None:  # not in a file mapping
        return
    lo = max(mapping[0], start // PAGE * PAGE - AROUND)
    hi = min(mapping[1], -(-stop // PAGE) * PAGE + AROUND)
    libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


def write_safetensors(path: Path, tensors: dict[str, Any], mapped: MappedFiles) -> None:
    """One safetensors file of `tensors`, written piece by piece (synchronously) from the mapped rank files."""
    import torch

    with open(path, "wb") as f:
        f.write(header(tensors))
        for t in tensors.values():
            for piece in rank_slices(t):
                data, base = memoryview(piece.view(torch.uint8).numpy()), piece.data_ptr()
                for i in range(0, len(data), STEP):  # each step's pages dropped once written
                    f.write(data[i:i + STEP])
                    drop_pages(base + i, base + min(i + STEP, len(data)), mapped)


def write_weights(ckpt_dir: Path, tag: str, lazy: dict[str, Any], config: Any, dest: Path, max_shard_size: int,
                  check: bool = False) -> dict[str, Any]:
    """Write `lazy`'s weights in shards of at most `max_shard_size` bytes (huggingface_hub's split; an index if
    several), `config.json` and `generation_config.json` into `dest`; the tensors written."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_frozen_kept(load(shard_paths(ckpt_dir / tag)[0]["model"], mmap=True), lambda: config, set(lazy),
                      ckpt_dir / tag)
    tensors = stored_names(lazy)
    check_shapes(config, tensors, build=check)
    plan = split_state_dict_into_shards_factory(tensors, get_storage_size=lambda t: t.shape.numel() * t.dtype.itemsize,
                                                filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    mapped = MappedFiles()
    for filename, names in plan.filename_to_tensors.items():
        write_safetensors(dest / filename, {n: tensors[n] for n in names}, mapped)
    if plan.is_sharded:
        total = sum(t.shape.numel() for t in tensors.values())
        index = {"metadata": {**plan.metadata, "total_parameters": total}, "weight_map": plan.tensor_to_filename}
        (dest / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # what save_pretrained records: the class that loads the weights, and their dtype (fp32 master weights)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config.save_pretrained(str(dest))
    GenerationConfig.from_model_config(config).save_pretrained(str(dest))
    return tensors
