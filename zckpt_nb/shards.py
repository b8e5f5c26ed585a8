"""What each rank's two checkpoint files weigh, predicted from the config: tensor payload plus torch.save's header.

The payload is the cost model's (12 bytes per owned element plus two fixed tensors). The header is the rest of
the files: the non-tensor content DeepSpeed 0.19.8 pickles into them (the module's empty placeholders, parameter
shapes, the DeepSpeed config, Adam's hyperparameters, our client state) and the zip record torch.save writes
around every tensor. We rebuild that content from the model config with every tensor empty and let torch.save
serialise it into memory; its size is the header, up to the 64-byte alignment of each tensor's record.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

from zckpt_nb.costs import meta_model, predict


def saved_size(obj: Any) -> int:
    """Bytes `torch.save` writes for `obj`."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def model_states(name: str, n: int, config: dict[str, Any], step: int, seed: int) -> dict[str, Any]:
    """The model-states file's content as DeepSpeed's `_save_checkpoint` writes it under ZeRO-3, tensors empty."""
    import torch

    from zckpt_nb.checkpoint import client_state
    from zckpt_nb.model import get_preset

    model = meta_model(name)
    client = client_state(step, seed, get_preset(name).global_batch, n)
    client["zckpt"]["rng"]["torch"] = torch.empty(0, dtype=torch.uint8)  # its bytes are payload
    return {"module": OrderedDict((k, torch.empty(0)) for k in model.state_dict()), "buffer_names": [],
            "optimizer": None, "param_shapes": [OrderedDict((k, p.shape) for k, p in model.named_parameters())],
            "frozen_param_shapes": OrderedDict(), "shared_params": {"lm_head.weight": "transformer.wte.weight"},
            "frozen_param_fragments": OrderedDict(), "lr_scheduler": {"last_batch_iteration": step - 1},
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
            "global_samples": step * n * config["train_micro_batch_size_per_gpu"]
            * config["gradient_accumulation_steps"], "dp_world_size": n, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": config,
            "ds_version": deepspeed_version(), **client}


def optim_states(n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The optimizer-states file's content as DeepSpeed's ZeRO-3 `state_dict` writes it, tensors empty."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    params = {k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}
    groups = torch.optim.AdamW([torch.zeros(1)], **params).state_dict()["param_groups"]
    empty = torch.empty(0)
    inner = {"state": {0: {"step": empty, "exp_avg": empty, "exp_avg_sq": empty}}, "param_groups": groups}
    return {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                     "dynamic_loss_scale": False, "overflow": False, "partition_count": n,
                                     "optimizer_state_dict": inner, "fp32_flat_groups": [empty]},
            "ds_config": config, "ds_version": deepspeed_version()}


def deepspeed_version() -> str:
    """The DeepSpeed version string the files record."""
    import deepspeed

    return deepspeed.__version__


def header_bytes(name: str, n: int, *, steps: int = 5, seed: int = 0, persistence_threshold: int = 0) -> int:
    """Predicted bytes of both files of one rank beyond their tensor payload."""
    from zckpt_nb.model import ds_config

    config = ds_config(name, steps=steps, world_size=n, comms_logger=True, persistence_threshold=persistence_threshold)
    return saved_size(model_states(name, n, config, steps, seed)) + saved_size(optim_states(n, config))


def file_bytes(name: str, n: int, *, steps: int = 5, seed: int = 0, persistence_threshold: int = 0) -> int:
    """Predicted size of one rank's two files on disk: the cost model's payload plus the header."""
    payload = predict(name, n, persistence_threshold=persistence_threshold).partitioned["per_rank_bytes"][0]
    return payload + header_bytes(name, n, steps=steps, seed=seed, persistence_threshold=persistence_threshold)
