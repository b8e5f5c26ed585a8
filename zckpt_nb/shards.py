"""What each rank's two checkpoint files weigh, predicted from the config: tensor payload plus torch.save's header.

The payload is the cost model's (12 bytes per owned element plus two fixed tensors). The header is the rest of
the files: the non-tensor content DeepSpeed 0.19.8 pickles into them (the module's empty placeholders with torch's
`_metadata`, parameter shapes, the DeepSpeed config, Adam's hyperparameters, our client state) and the zip record
torch.save writes around every tensor. We rebuild that content with every tensor empty (one storage each, as in the
real files) and let torch.save serialise it into memory; its size is the header. What an empty tensor cannot show
(its record's alignment, its element count in the pickle) is bounded by `RECORD_SLACK` per tensor with data, so the
prediction is an upper bound a few hundred bytes above the files. The save preflight (`zckpt_nb.commit`) asks
`engine_file_bytes`, which builds the same prediction from the live engine instead of a preset.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

from zckpt_nb.costs import ADAM_STATES, FP32, fixed_tensor_bytes, meta_model, slice_numel

# Tensors with data in one rank's files: the torch RNG state (model states); the fp32 partition, Adam's step and
# both moments (optimizer states). Each record's data starts on a 64-byte boundary (up to 63 bytes of padding), and
# the pickle spells each tensor's element count: 128 bytes bound both.
DATA_TENSORS, RECORD_SLACK = 5, 128


def saved_size(obj: Any) -> int:
    """Bytes `torch.save` writes for `obj`."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def placeholders(model: Any) -> OrderedDict:
    """`model.state_dict()` as ZeRO-3 saves it: every tensor empty (tied ones share one), torch's `_metadata` kept."""
    import torch

    module, empty = model.state_dict(keep_vars=True), {}
    for key, tensor in module.items():
        module[key] = empty.setdefault(id(tensor), torch.empty(0, dtype=tensor.dtype))
    return module


def model_states(model: Any, n: int, config: dict[str, Any], step: int, seed: int) -> dict[str, Any]:
    """The model-states file's content as DeepSpeed's `_save_checkpoint` writes it under ZeRO-3, tensors empty.

    `model` is a meta model or a live ZeRO-3 one (whose shapes are in `ds_shape`).
    """
    import torch

    from zckpt_nb.checkpoint import client_state

    batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * n  # DeepSpeed's
    horizon = config["scheduler"]["params"]["total_num_steps"]
    client = client_state(step, seed, batch, n, horizon)  # the global batch within a few bytes, from the config alone
    client["zckpt"]["rng"]["torch"] = torch.empty(0, dtype=torch.uint8)  # its bytes are payload
    shapes = OrderedDict((k, getattr(p, "ds_shape", p.shape)) for k, p in model.named_parameters())
    return {"module": placeholders(model), "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
            "frozen_param_shapes": OrderedDict(), "shared_params": {"lm_head.weight": "transformer.wte.weight"},
            "frozen_param_fragments": OrderedDict(), "lr_scheduler": {"last_batch_iteration": step - 1},
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
            "global_samples": step * batch, "dp_world_size": n, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": config,
            "ds_version": deepspeed_version(), **client}


def optim_states(n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The optimizer-states file's content as DeepSpeed's ZeRO-3 `state_dict` writes it, tensors empty."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    params = {k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}
    groups = torch.optim.AdamW([torch.zeros(1)], **params).state_dict()["param_groups"]
    adam = {key: torch.empty(0) for key in ("step", "exp_avg", "exp_avg_sq")}
    inner = {"state": {0: adam}, "param_groups": groups}
    return {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                     "dynamic_loss_scale": False, "overflow": False, "partition_count": n,
                                     "optimizer_state_dict": inner, "fp32_flat_groups": [torch.empty(0)]},
            "ds_config": config, "ds_version": deepspeed_version()}


def deepspeed_version() -> str:
    """The DeepSpeed version string the files record."""
    import deepspeed

    return deepspeed.__version__


def module_file_bytes(model: Any, n: int, config: dict[str, Any], step: int, seed: int) -> int:
    """Predicted size of one rank's two files when `model` trained with `config` on `n` ranks saves at `step`."""
    numels = tuple(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    payload = (1 + ADAM_STATES) * FP32 * slice_numel(numels, n) + fixed_tensor_bytes()
    header = saved_size(model_states(model, n, config, step, seed)) + saved_size(optim_states(n, config))
    return payload + header + DATA_TENSORS * RECORD_SLACK


def file_bytes(name: str, n: int, *, steps: int = 5, seed: int = 0, persistence_threshold: int = 0) -> int:
    """Predicted size of one rank's two files on disk for preset or config `name`: payload plus header."""
    from zckpt_nb.model import ds_config

    config = ds_config(name, steps=steps, world_size=n, comms_logger=True, persistence_threshold=persistence_threshold)
    return module_file_bytes(meta_model(name), n, config, steps, seed)


def engine_file_bytes(engine: Any, state: dict[str, Any]) -> int:
    """Predicted size of this rank's two files when the live ZeRO-3 `engine` saves client `state` now."""
    from zckpt_nb.checkpoint import CLIENT_KEY

    ours = state[CLIENT_KEY]
    return module_file_bytes(engine.module, engine.dp_world_size, engine.config, ours["step"], ours["seed"])
