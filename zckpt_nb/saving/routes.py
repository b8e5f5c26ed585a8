"""The two consolidated routes that run in the ranks (`Route.GATHERED16`, `Route.PER_PARAM`; every rank calls them);
the offline ones are `convert.zero_to_fp32` and `convert.export`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import WEIGHTS


def save_gathered16(engine: Any, out_dir: str | Path) -> Path:
    """`engine.save_16bit_model` on every rank: one module gathered at a time, rank 0 keeps a CPU copy of the whole
    model until it writes `out_dir/pytorch_model.bin`."""
    if not engine.save_16bit_model(str(out_dir), WEIGHTS):  # DeepSpeed says so only at INFO level
        print(f"rank {engine.global_rank}: save_16bit_model returned False and wrote nothing "
              f"(stage3_gather_16bit_weights_on_model_save is "
              f"{engine.zero_gather_16bit_weights_on_model_save()})", flush=True)
    return Path(out_dir) / WEIGHTS


def save_per_param(engine: Any, out_dir: str | Path) -> Path:
    """Route 2 (DeepSpeed-Chat's `save_zero_three_model`): gather one parameter at a time on every rank, so the
    accelerator never holds more than one whole; rank 0's CPU keeps a copy of all of P and writes
    `out_dir/pytorch_model.bin`."""
    import deepspeed
    import torch
    import torch.distributed as dist

    rank0, state, path = dist.get_rank() == 0, {}, Path(out_dir) / WEIGHTS
    for name, param in engine.module.named_parameters():  # tied weights appear once, under their first name
        with deepspeed.zero.GatheredParameters([param]):
            if rank0:  # copy=True: on CPU ranks .cpu() returns DeepSpeed's own gathered buffer; keep a copy
                state[name] = param.data.detach().to("cpu", copy=True)
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(state, path)
    return path
