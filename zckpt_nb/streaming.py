"""Write a ZeRO-3 checkpoint's weights as safetensors shards, one output shard in memory at a time.

DeepSpeed 0.19.8's `get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)` memory-maps every rank's
optimizer file and returns, for each parameter, a `GatheredTensor`: where its slices lie in the ranks' flat fp32
groups, nothing copied yet. We plan the shards on `meta` tensors (shapes only), then for each shard materialise
just its tensors (`to_torch_tensor`), write them and drop them. The memory the export allocates stays near one
shard; the checkpoint pages it reads are mapped from the files (page cache the kernel can reclaim).

The output is what transformers' `save_pretrained` writes for the same model: the tied head stored once (under the
embedding's name, as transformers keeps it), `model.safetensors` or `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json`, `config.json` and `generation_config.json`. The model itself is built on the `meta`
device only, to know its parameter names, shapes and tied weights: no weight of it is ever allocated.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from zckpt_nb.launch import UsageError

WEIGHTS_PATTERN = "model{suffix}.safetensors"  # transformers' names: model.safetensors, model-00001-of-00003...
INDEX = "model.safetensors.index.json"


def lazy_state_dict(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """DeepSpeed's lazy fp32 state dict of checkpoint `tag`: a GatheredTensor (or a buffer) per name, tied names
    sharing one object."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zckpt_nb.export import first_line

    try:  # DeepSpeed's converter prints progress; the export reports in one line of its own
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag, lazy_mode=True)
    except Exception as e:  # truncated or inconsistent shards: one line naming the checkpoint
        raise UsageError(f"cannot convert checkpoint {ckpt_dir / tag}: {first_line(e)}; a shard file may be "
                         "truncated or corrupt (python -m zckpt_nb inspect lists every rank's files)") from None


def meta_model(config: Any) -> Any:
    """The model of `config` on the `meta` device: names, shapes and tied weights, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def stored_names(lazy: dict[str, Any], model: Any, where: Path) -> dict[str, Any]:
    """The tensors to write, each once: the model's names, tied ones (one object in `lazy`) under the first name.

    Raises UsageError, as `load_state_dict(strict=True)` would, when the checkpoint does not fit the model.
    """
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(lazy)), sorted(set(lazy) - set(expected))
    bad_shape = [n for n in expected if n in lazy and tuple(lazy[n].shape) != tuple(expected[n].shape)]
    if missing or unexpected or bad_shape:
        raise UsageError(f"checkpoint {where} does not fit config.json: missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, other shape {bad_shape[:3]}")
    seen: set[int] = set()
    kept = {}
    for name in expected:  # the model's order; a tied name is the same object as one already kept
        if id(lazy[name]) not in seen:
            seen.add(id(lazy[name]))
            kept[name] = lazy[name]
    return kept


def plan_shards(tensors: dict[str, Any], max_shard_size: int) -> Any:
    """huggingface_hub's split of `tensors` into shards of at most `max_shard_size` bytes, planned on shapes alone."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    shapes = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in tensors.items()}
    return split_torch_state_dict_into_shards(shapes, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)


def write_shards(tensors: dict[str, Any], plan: Any, dest: Path) -> None:
    """Materialise, write and drop one shard at a time; the index when there is more than one."""
    from deepspeed.utils.zero_to_fp32 import to_torch_tensor
    from safetensors.torch import save_file

    for filename, names in plan.filename_to_tensors.items():
        shard = to_torch_tensor({n: tensors[n] for n in names})
        save_file(shard, str(dest / filename), metadata={"format": "pt"})
        del shard  # its tensors' last reference: freed now (no cycles, no gc pass needed), before the next shard
    if plan.is_sharded:
        total = sum(t.shape.numel() for t in tensors.values())
        index = {"metadata": {**plan.metadata, "total_parameters": total}, "weight_map": plan.tensor_to_filename}
        (dest / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_weights(ckpt_dir: Path, tag: str, config: Any, dest: Path, max_shard_size: int) -> Any:
    """Write the weights, `config.json` and `generation_config.json` into `dest`; return the (meta) model."""
    model = meta_model(config)
    tensors = stored_names(lazy_state_dict(ckpt_dir, tag), model, ckpt_dir / tag)
    write_shards(tensors, plan_shards(tensors, max_shard_size), dest)
    # what save_pretrained records: the class that loads the weights, and their dtype (fp32 master weights)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    model.config.save_pretrained(str(dest))
    model.generation_config.save_pretrained(str(dest))
    return model
