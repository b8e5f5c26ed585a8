"""Load a DCP checkpoint of a Hugging Face causal LM (`python -m zckpt_nb to-dcp`'s, or a plain FSDP2 loop's
`dcp.save({"model": ..., "optim"|"optimizer": ...})`) with plain FSDP2, as a PyTorch user would, on any world size.

    torchrun --nproc_per_node 3 -m zckpt_nb.examples.fsdp2_load DCP_DIR CONFIG_DIR OUT.pt

Nothing of zckpt_nb: the Hugging Face model from its config.json, `fully_shard` on each block (the model's
`_no_split_modules`: GPT2Block, LlamaDecoderLayer, ...) and the root,
`torch.optim.AdamW`, `get_state_dict`, `dcp.load`, `set_state_dict`. Rank 0 then writes the full (gathered) model
and optimizer state, with the LR scheduler and train state it loaded, to OUT.pt, for a test to compare.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM


def flat_entries(saved: dict, top: str) -> dict:
    """Placeholders for the checkpoint's entries directly under `top` (the LR scheduler's or the train state's
    scalars and tensors), which dcp.load fills; {} when it has none."""
    found: dict = {}
    for key, meta in saved.items():
        head, _, name = key.partition(".")
        if head == top and name and "." not in name:
            found[name] = torch.empty(meta.size, dtype=meta.properties.dtype) \
                if isinstance(meta, TensorStorageMetadata) else 0
    return found


def main(dcp_dir: str, config_dir: str, out: str) -> None:
    """Build, shard, load the checkpoint into model and optimizer, then write the gathered state on rank 0."""
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    blocks = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]  # GPT2Block, LlamaDecoderLayer
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata  # what the checkpoint holds, by key
    optim_key = "optimizer" if any(k.startswith("optimizer.") for k in saved) else "optim"  # both names are in use
    extras = {top: flat_entries(saved, top) for top in ("lr_scheduler", "train_state")}
    state = {"model": model_sd, optim_key: optim_sd, **{top: found for top, found in extras.items() if found}}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state[optim_key])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full, optim_full = get_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": model_full, "optimizer": optim_full, "lr_scheduler": state.get("lr_scheduler", {}),
                    "train_state": state.get("train_state", {}), "world_size": dist.get_world_size()}, out)
        ranks = "1 rank" if dist.get_world_size() == 1 else f"{dist.get_world_size()} ranks"
        step = state.get("train_state", {}).get("step", "unknown (no train_state)")
        print(f"loaded {dcp_dir} on {ranks} at step {step}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank
