"""A small model of ZeRO-3 state and save costs, computed from the model config alone (no run needed).

For P parameters in tensors p_1..p_k, N ranks and Adam:
- ZeRO-3 pads every tensor to a multiple of N and gives each rank one slice: rank r owns
  sum_i ceil(|p_i| / N) elements (DeepSpeed's `_aligned_size`/`_partition_param`). That is P/N plus < 1 per tensor.
- Each rank holds, for its slice: the working parameters (2 bytes in bf16, 4 in fp32), their gradients (same
  dtype), an fp32 master copy (DeepSpeed keeps one even in fp32 runs) and Adam's exp_avg and exp_avg_sq (fp32).
- A partitioned save writes, per rank, the fp32 master slice and both Adam moments: 12 bytes per owned element
  (the `fp32_flat_groups` and optimizer `state` tensors of `..._optim_states.pt`), plus two small fixed tensors
  (the rank's torch RNG state in our client state, Adam's step counter) and a pickle header (config, shapes).
  The model-states file holds only 0-element placeholders under ZeRO-3.
- A gathered (consolidated) save all-gathers every parameter: each rank sends its slice of each tensor, so
  DeepSpeed's comms logger records slice bytes per call (partition elements x dtype bytes per rank), and every rank
  receives the padded whole, P_padded x dtype bytes. Rank 0 keeps a full copy: P x dtype bytes extra.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

ADAM_STATES = 2  # exp_avg, exp_avg_sq
FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def fixed_tensor_bytes() -> int:
    """Tensor bytes every rank saves whatever P is: its torch RNG state (client state) and Adam's fp32 step."""
    import torch

    return torch.get_rng_state().numel() + FP32


@cache
def tensor_numels(name: str) -> tuple[int, ...]:
    """Element count of every distinct parameter tensor of preset `name` (tied weights once), from the config."""
    import torch
    from transformers import AutoModelForCausalLM

    from zckpt_nb.model import gpt2_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpt2_config(name))
    return tuple(p.numel() for p in model.parameters())


def slice_numel(numels: tuple[int, ...], n: int) -> int:
    """Elements each rank owns under ZeRO-3: every tensor padded to a multiple of N, then split N ways."""
    return sum(math.ceil(k / n) for k in numels)


def padding(numels: tuple[int, ...], n: int) -> int:
    """Elements of padding over all ranks: N x slice - P."""
    return n * slice_numel(numels, n) - sum(numels)


@dataclass
class Prediction:
    """Predicted bytes for one preset, world size and dtype (all per rank unless named otherwise)."""

    model: str
    world_size: int
    dtype: str
    num_params: int
    num_tensors: int
    slice_numel: int
    padding_numel: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_bytes: int
    partitioned: dict[str, Any]
    gathered: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(name: str, n: int, dtype: str = "fp32") -> Prediction:
    """Everything the cost model says about preset `name` on `n` ranks."""
    numels = tensor_numels(name)
    p, s, b = sum(numels), slice_numel(numels, n), DTYPE_BYTES[dtype]
    write = (1 + ADAM_STATES) * FP32 * s + fixed_tensor_bytes()  # fp32 master slice + Adam moments + fixed
    return Prediction(
        model=name, world_size=n, dtype=dtype, num_params=p, num_tensors=len(numels), slice_numel=s,
        padding_numel=padding(numels, n), param_bytes=b * s, grad_bytes=b * s, master_bytes=FP32 * s,
        optimizer_bytes=ADAM_STATES * FP32 * s,
        partitioned={"per_rank_bytes": [write] * n, "total_bytes": write * n, "comm_bytes": 0},
        gathered={
            "allgather_sent_bytes_per_rank": b * s,  # what DeepSpeed's comms logger records on each rank
            "allgather_received_bytes_per_rank": b * s * n,  # the padded whole, on every rank
            "rank0_extra_peak_bytes": b * p,  # the consolidated copy rank 0 builds
            "written_bytes": b * p,
        },
    )


def format_prediction(pred: Prediction) -> str:
    """A short human-readable summary of a prediction."""
    mib = 2**20
    part, gath = pred.partitioned, pred.gathered
    return "\n".join([
        f"{pred.model}: P = {pred.num_params:,} in {pred.num_tensors} tensors, N = {pred.world_size}, {pred.dtype}",
        f"  each rank owns {pred.slice_numel:,} elements (P/N = {pred.num_params / pred.world_size:,.1f}, "
        f"padding {pred.padding_numel:,} in all)",
        f"  held per rank: params {pred.param_bytes / mib:.2f} MiB, grads {pred.grad_bytes / mib:.2f} MiB, "
        f"fp32 master {pred.master_bytes / mib:.2f} MiB, Adam {pred.optimizer_bytes / mib:.2f} MiB",
        f"  partitioned save: {part['per_rank_bytes'][0]:,} bytes per rank, no communication",
        f"  gathered save: all-gather {gath['allgather_sent_bytes_per_rank']:,} bytes sent per rank, "
        f"rank 0 extra peak {gath['rank0_extra_peak_bytes']:,} bytes, writes {gath['written_bytes']:,} bytes",
    ])


def prediction_json(pred: Prediction) -> str:
    """The prediction as JSON (`partitioned.per_rank_bytes` is a list of N integers)."""
    return json.dumps(pred.to_dict(), indent=1)
