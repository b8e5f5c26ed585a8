"""The exact bytes of a rank's two checkpoint files, for the planner: the tensor payload plus `torch.save`'s header.

The header is what DeepSpeed 0.19.8 pickles beside the tensors (the module's empty placeholders with torch's
`_metadata`, parameter shapes, the DeepSpeed config, Adam's hyperparameters, the client state) and the zip record
`torch.save` writes around every tensor. It is rebuilt here with every tensor empty (one storage each, as in the real
files) and serialised into memory; what an empty tensor cannot show (its record's alignment, its element count in the
pickle) is bounded by `RECORD_SLACK` per tensor with data. For the package's own worker the result is an upper bound
a few hundred bytes above the files (tests/test_costs.py). The save preflight bounds the same cheaply
(`format.sizes.save_bytes`).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

from zckpt_nb.format.client_state import CLIENT_KEY, client_state
from zckpt_nb.format.sizes import ADAM_STATES, FP32, fixed_tensor_bytes, slice_numel
from zckpt_nb.model import tied_names

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


def package_client(config: dict[str, Any], n: int, step: int, seed: int) -> dict[str, Any]:
    """This package's client state as the worker saves it, from the config alone, its RNG tensor empty."""
    import torch

    batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * n  # DeepSpeed's
    client = client_state(step, seed, batch, n, config["scheduler"]["params"]["total_num_steps"])
    client[CLIENT_KEY]["rng"]["torch"] = torch.empty(0, dtype=torch.uint8)
    return client


def model_states(model: Any, n: int, config: dict[str, Any], step: int, client: dict[str, Any]) -> dict[str, Any]:
    """The model-states file's content as DeepSpeed writes it under ZeRO-3, tensors empty."""
    import deepspeed

    batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * n  # DeepSpeed's
    shapes = OrderedDict((k, getattr(p, "ds_shape", p.shape)) for k, p in model.named_parameters())
    return {"module": placeholders(model), "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
            "frozen_param_shapes": OrderedDict(), "shared_params": tied_names(model),
            "frozen_param_fragments": OrderedDict(), "lr_scheduler": {"last_batch_iteration": step - 1},
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": step,
            "global_samples": step * batch, "dp_world_size": n, "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": config,
            "ds_version": deepspeed.__version__, **client}


def optim_states(n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The optimizer-states file's content as DeepSpeed's ZeRO-3 `state_dict` writes it, tensors empty."""
    import deepspeed
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
            "ds_config": config, "ds_version": deepspeed.__version__}


def module_file_bytes(model: Any, n: int, config: dict[str, Any], step: int, client: dict[str, Any]) -> int:
    """Predicted size of one rank's two files when `model` on `n` ranks saves at `step`."""
    numels = tuple(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    payload = (1 + ADAM_STATES) * FP32 * slice_numel(numels, n) + fixed_tensor_bytes()
    header = saved_size(model_states(model, n, config, step, client)) + saved_size(optim_states(n, config))
    return payload + header + DATA_TENSORS * RECORD_SLACK
