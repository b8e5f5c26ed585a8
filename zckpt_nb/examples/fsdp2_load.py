"""Load a DCP checkpoint (`python -m zckpt_nb to-dcp`) with plain FSDP2, as a PyTorch user would, on any world size.

    torchrun --nproc_per_node 3 -m zckpt_nb.examples.fsdp2_load DCP_DIR CONFIG_DIR OUT.pt

Nothing of zckpt_nb: the Hugging Face model from its config.json, `fully_shard` on each block and the root,
`torch.optim.AdamW`, `get_state_dict`, `dcp.load`, `set_state_dict`. Rank 0 then writes the full (gathered) model
and optimizer state, with the LR scheduler and train state it loaded, to OUT.pt, for a test to compare.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

TRAIN_STATE = ("step", "seed", "global_batch", "world_size", "steps")  # what to-dcp writes under "train_state"


def main(dcp_dir: str, config_dir: str, out: str) -> None:
    """Build, shard, load the checkpoint into model and optimizer, then write the gathered state on rank 0."""
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": {"last_batch_iteration": -1},
             "train_state": dict.fromkeys(TRAIN_STATE, 0)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full, optim_full = get_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": model_full, "optimizer": optim_full, "lr_scheduler": state["lr_scheduler"],
                    "train_state": state["train_state"], "world_size": dist.get_world_size()}, out)
        ranks = "1 rank" if dist.get_world_size() == 1 else f"{dist.get_world_size()} ranks"
        print(f"loaded {dcp_dir} on {ranks} at step {state['train_state']['step']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank
