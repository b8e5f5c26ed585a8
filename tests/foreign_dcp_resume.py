"""DeepSpeed's own universal load of from-dcp's output, in a raw ZeRO-3 engine (no zckpt_nb here): the tiny Llama of
tests/foreign_dcp_writer.py, `"checkpoint": {"load_universal": true}`, `engine.load_checkpoint`; then every
parameter's full fp32 weights and Adam moments as the engine holds them (DeepSpeed's `safe_get_full_*`), saved by
rank 0. `torchrun --nproc_per_node N tests/foreign_dcp_resume.py ZERO_DIR CONFIG_DIR OUT.pt`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig


def main(zero_dir: Path, config_dir: Path, out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                           "torch_adam": True}},
                 "checkpoint": {"load_universal": True}}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers reads it while building the model)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    tag = (zero_dir / "latest").read_text().strip()
    path, _ = engine.load_checkpoint(str(zero_dir / "universal"), tag=tag)
    assert path is not None, "DeepSpeed loaded nothing"
    state = {name: {"fp32": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                    "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
             for name, p in engine.module.named_parameters()}
    group = engine.optimizer.param_groups[0]
    if dist.get_rank() == 0:
        torch.save({"params": state, "global_steps": engine.global_steps, "lr": group["lr"],
                    "betas": tuple(group["betas"]), "weight_decay": group["weight_decay"]}, out)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank (SIGABRT)
