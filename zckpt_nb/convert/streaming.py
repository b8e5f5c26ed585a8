"""Write a ZeRO-3 checkpoint's weights as safetensors shards in a few MiB of memory, whatever the model's size.

DeepSpeed 0.19.8's `get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)` memory-maps every rank's
optimizer file and returns, for each parameter, a `GatheredTensor`: where its slices lie in the ranks' flat fp32
groups, nothing copied yet. We plan the shards from the shapes alone, then write each shard's safetensors header
and, tensor by tensor, the ranks' slices straight from the mapped files, 1 MiB at a time, releasing each step's
mapped pages once written. No tensor is ever built whole in memory, and the file pages read do not pile up
in the process's resident memory (they stay in the page cache, which the kernel can reclaim).

The output is what transformers' `save_pretrained` writes for the same model: the tied head stored once (under the
embedding's name, as transformers keeps it), `model.safetensors` or `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`, `config.json` and `generation_config.json`. No model is built: names, shapes and tied
weights come from the checkpoint.
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
from zckpt_nb.model import on_meta

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' names: model.safetensors, model-00001-of-00003...


INDEX = "model.safetensors.index.json"


SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                      "torch.float64": "F64", "torch.int64": "I64", "torch.int32": "I32", "torch.bool": "BOOL",
                      "torch.uint8": "U8"}


STEP = 2**20  # bytes written, then released from memory, at a time


AROUND = 2**20  # pages either side of a written range also released (the kernel maps some around each fault)


MADV_DONTNEED = 4  # <sys/mman.h> on Linux


LIBC = ctypes.CDLL(None)  # this process's C library (madvise), loaded once: drop_pages runs for every MiB written


def lazy_state_dict(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """DeepSpeed's lazy fp32 state dict of checkpoint `tag`: a GatheredTensor (or a buffer) per name, tied names
    sharing one object."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:  # DeepSpeed's converter prints progress; the export reports in one line of its own
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag, lazy_mode=True)
    except Exception as e:  # truncated or inconsistent shards: one line naming the checkpoint
        raise UsageError(f"cannot convert checkpoint {ckpt_dir / tag}: {first_line(e)}; a shard file may be "
                         "truncated or corrupt (python -m zckpt_nb inspect lists every rank's files)") from None


def stored_names(lazy: dict[str, Any]) -> dict[str, Any]:
    """The tensors to write, each once, in the checkpoint's order: a tied name (DeepSpeed lists it after the others,
    as the same object) is stored under the first name, as transformers stores the embedding and re-ties the head."""
    seen: set[int] = set()
    kept = {}
    for name, t in lazy.items():
        if id(t) not in seen:
            seen.add(id(t))
            kept[name] = t
    return kept


def check_shapes(config: Any, tensors: dict[str, Any], build: bool) -> None:
    """The model `config` describes has exactly the checkpoint's weights, name for name and shape for shape, or
    UsageError in one line (an export would otherwise load with random or missing weights).

    A config asking for more elements or layers than the checkpoint holds is refused first; with `build` the model
    is then built on the meta device and compared, which imports its class (about 90 MiB of RSS, more than a small
    export needs).
    """
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
    """UsageError in one line, ending with `fix`, unless every name of `tensors` is one of `model`'s weights with
    its shape and every name in `needed` is in `tensors`."""
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


def plan_shards(tensors: dict[str, Any], max_shard_size: int) -> Any:
    """huggingface_hub's split of `tensors` into shards of at most `max_shard_size` bytes, planned on shapes alone.

    Its generic splitter takes the size function from us: the torch one inspects storages, which imports sympy
    (about 1 s and 40 MiB, more than the rest of a small export).
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(tensors, get_storage_size=lambda t: t.shape.numel() * t.dtype.itemsize,
                                                filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)


def rank_slices(t: Any) -> Iterator[Any]:
    """The 1-D pieces whose concatenation, cut at `t`'s element count, is tensor `t`: views, nothing copied.

    For DeepSpeed's `GatheredTensor` these are each rank's slice of the flat fp32 groups, in rank order, exactly what
    its `contiguous()` concatenates (we intersect the slice with every group instead of copying it out).
    """
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

    def containing(self, start: int, stop: int) -> tuple[int, int] | None:
        """The file mapping that holds [start, stop), or None."""
        return next(((lo, hi) for lo, hi in self.ranges if lo <= start and stop <= hi), None)


def drop_pages(start: int, stop: int, mapped: MappedFiles) -> None:
    """Release from this process's memory the pages of [start, stop) and up to AROUND bytes either side, if a file
    backs them all.

    The rank files are memory-mapped privately and never written: `MADV_DONTNEED` unmaps their pages, which stay in
    the page cache, and a later read maps them again. The margin catches the pages the kernel mapped around each
    fault ("fault-around"), which would otherwise pile up between small tensors. Anonymous memory is never touched.
    """
    if (mapping := mapped.containing(start, stop)) is None:
        return
    lo = max(mapping[0], start // PAGE * PAGE - AROUND)
    hi = min(mapping[1], -(-stop // PAGE) * PAGE + AROUND)
    LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)


def write_piece(f: Any, piece: Any, mapped: MappedFiles) -> None:
    """Write a 1-D tensor's bytes straight from where they lie, STEP bytes at a time, dropping each step's pages."""
    import torch

    data = memoryview(piece.view(torch.uint8).numpy())
    base = piece.data_ptr()
    for i in range(0, len(data), STEP):
        f.write(data[i:i + STEP])
        drop_pages(base + i, base + min(i + STEP, len(data)), mapped)


def write_safetensors(path: Path, tensors: dict[str, Any], mapped: MappedFiles) -> None:
    """One safetensors file of `tensors`, written piece by piece from the rank files: no tensor is built in memory.

    transformers' and safetensors' writers need each tensor whole in memory (DeepSpeed's `contiguous()` copies it
    out first); streaming the slices keeps the export's memory at STEP bytes whatever the shard size. The write is
    synchronous on purpose: each step's pages of the mapped rank files are dropped right after it is written, which a
    writer that copies on another thread (`format.writer.DirectFile`) would read back in after the drop.
    """
    with open(path, "wb") as f:
        f.write(header(tensors))
        for t in tensors.values():
            for piece in rank_slices(t):
                write_piece(f, piece, mapped)


def write_shards(tensors: dict[str, Any], plan: Any, dest: Path) -> None:
    """Write every shard of `plan`; the index when there is more than one."""
    mapped = MappedFiles()
    for filename, names in plan.filename_to_tensors.items():
        write_safetensors(dest / filename, {n: tensors[n] for n in names}, mapped)
    if plan.is_sharded:
        total = sum(t.shape.numel() for t in tensors.values())
        index = {"metadata": {**plan.metadata, "total_parameters": total}, "weight_map": plan.tensor_to_filename}
        (dest / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_weights(ckpt_dir: Path, tag: str, lazy: dict[str, Any], config: Any, dest: Path, max_shard_size: int,
                  check: bool = False) -> dict[str, Any]:
    """Write the weights of `lazy` (checkpoint `tag`'s lazy state dict), `config.json` and `generation_config.json`
    into `dest`; return the tensors written.

    Names, shapes and ties come from the checkpoint (the engine's own module); with `check` they are compared with a
    model built from `config` first (importing a model class costs more than the whole conversion of a small model).
    """
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_frozen_kept(load(shard_paths(ckpt_dir / tag)[0]["model"], mmap=True), lambda: config, set(lazy),
                      ckpt_dir / tag)
    tensors = stored_names(lazy)
    check_shapes(config, tensors, build=check)
    write_shards(tensors, plan_shards(tensors, max_shard_size), dest)
    # what save_pretrained records: the class that loads the weights, and their dtype (fp32 master weights)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config.save_pretrained(str(dest))
    GenerationConfig.from_model_config(config).save_pretrained(str(dest))
    return tensors
