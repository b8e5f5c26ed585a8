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
- Every `save_checkpoint` validates its tag: two all-reduces (MAX and MIN) of the tag's 20-byte SHA-1 digest.
- Persistent tensors: with `stage3_param_persistence_threshold` t, every tensor of at most t elements is kept whole
  on every rank (DeepSpeed's `mark_persistent_parameters`; its default t = 1e5). It is still partitioned for the
  optimizer (the save writes the same bytes), but each rank also holds it whole in the working dtype, and every
  `save_checkpoint` ends by all-gathering the persistent tensors again (`checkpoint_event_epilogue`).
- A gathered (consolidated) save all-gathers parameters: each rank sends its slice of a tensor (DeepSpeed's comms
  logger records that input: ceil(k/N) x dtype bytes per call) and receives the padded whole.
  * Route 1, `save_16bit_model`, walks the modules and gathers each module's own parameters with
    `GatheredParameters(modifier_rank=0)`, which broadcasts every full tensor back from rank 0 on exit. A tied
    tensor is gathered (and broadcast) once per module that owns it (GPT-2's wte and lm_head: twice).
  * Route 2, per-parameter gather, walks `named_parameters()` (each distinct tensor once), no broadcast.
  Rank 0 keeps a full copy in the parameter dtype: P x dtype bytes extra, and writes them.
- Offline conversion and HF export run in one process: no communication; they read every shard (memory-mapped).
  The conversion builds the fp32 state dict (P x 4 bytes extra) and writes it; the export builds no tensor at all
  (it writes each one from the mapped rank files, `zckpt_nb.convert.streaming`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from zckpt_nb.format.sizes import (
    ADAM_STATES,
    FP32,
    exact_ratio,
    fixed_tensor_bytes,
    module_file_bytes,
    package_client,
    padding,
    slice_numel,
)
from zckpt_nb.model import PRESETS, ds_config, meta_model

TAG_CHECK_BYTES = 2 * 20  # save_checkpoint's tag validation: MAX and MIN all-reduce of a SHA-1 digest


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def tensor_numels(name: str) -> tuple[int, ...]:
    """Element count of every distinct parameter tensor of `name` (tied weights once), from the config."""
    return tuple(p.numel() for p in meta_model(name).parameters())


def module_numels(name: str) -> tuple[tuple[int, ...], ...]:
    """Per module with parameters of its own, their element counts (tied ones once per owning module)."""
    groups = (tuple(p.numel() for p in m.parameters(recurse=False)) for m in meta_model(name).modules())
    return tuple(g for g in groups if g)


def module_walk_numels(name: str) -> tuple[int, ...]:
    """Element counts as `save_16bit_model` meets them: each module's own parameters, tied ones once per owner."""
    return tuple(k for group in module_numels(name) for k in group)


def persistent(numels: tuple[int, ...], threshold: int) -> tuple[int, ...]:
    """Element counts of the tensors DeepSpeed keeps whole on every rank: those of at most `threshold` elements."""
    return tuple(k for k in numels if k <= threshold)


@dataclass
class Prediction:
    """Predicted bytes for one preset or config, world size and dtype (all per rank unless named otherwise)."""

    model: str
    world_size: int
    dtype: str
    persistence_threshold: int
    num_params: int
    num_tensors: int
    slice_numel: int
    padding_numel: int
    persistent_tensors: int
    persistent_numel: int  # elements each rank holds whole beyond its slice
    held_numel: int  # slice + persistent: the parameter elements each rank holds
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_bytes: int
    partitioned: dict[str, Any]
    gathered: dict[str, Any]
    per_param: dict[str, Any]
    offline: dict[str, Any]
    hf: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gather_bytes(numels: tuple[int, ...], n: int, b: int) -> int:
    """What DeepSpeed's comms logger records on each rank for all-gathering these tensors: the slices sent."""
    return sum(math.ceil(k / n) * b for k in numels)


def with_ops(ops: dict[str, int]) -> dict[str, Any]:
    """A mode's predicted collectives: bytes per DeepSpeed op name (zero ones dropped) and their sum."""
    ops = {op: v for op, v in ops.items() if v}
    return {"ops": ops, "comm_bytes_per_rank": sum(ops.values())}


def memory(rank0: dict[str, int], others: dict[str, int], device: tuple[str, ...] = ()) -> dict[str, Any]:
    """A mode's predicted extra peak memory: its named terms on rank 0 and on the other ranks, and their sums.

    `device` names the terms held where the parameters live (GPU memory on GPU ranks: the gather buffers); every
    other term is host memory on any rank (DeepSpeed and route 2 move rank 0's full copy to the CPU).
    """
    return {"memory_terms": {"rank 0": rank0, "other ranks": others}, "rank0_extra_peak_bytes": sum(rank0.values()),
            "other_extra_peak_bytes": sum(others.values()), "device_terms": list(device)}


def predict(name: str, n: int, dtype: str = "fp32", persistence_threshold: int = 0) -> Prediction:
    """Everything the cost model says about preset `name` on `n` ranks."""
    numels, walk = tensor_numels(name), module_walk_numels(name)
    p, s, b = sum(numels), slice_numel(numels, n), DTYPE_BYTES[dtype]
    kept = persistent(numels, persistence_threshold)
    # the save's epilogue gathers the persistent tensors again (a world of one rank has nothing to gather)
    regather = gather_bytes(kept, n, b) if n > 1 else 0
    released = tuple(k for k in numels if k > persistence_threshold)  # what a gathered save must fetch
    walk_released = tuple(k for k in walk if k > persistence_threshold)
    write = (1 + ADAM_STATES) * FP32 * s + fixed_tensor_bytes()  # fp32 master slice + Adam moments + fixed
    route1 = {"allgather_bytes_per_rank": gather_bytes(walk_released, n, b), "broadcast_bytes_per_rank": sum(walk) * b}
    route2 = {"allgather_bytes_per_rank": gather_bytes(released, n, b)}
    largest_module = max(sum(g) for g in module_numels(name)) * b
    largest_tensor = max(numels) * b
    partitioned = {"per_rank_bytes": [write] * n, "total_bytes": write * n,  # tensor data: exact
                   "per_rank_file_bytes": file_bytes(name, n, persistence_threshold=persistence_threshold,
                                                     dtype=dtype) if name in PRESETS else None,
                   "tag_check_bytes_per_rank": TAG_CHECK_BYTES, "regather_bytes_per_rank": regather,
                   **with_ops({"all_reduce": TAG_CHECK_BYTES, "all_gather_into_tensor": regather})}
    # zero_to_fp32 (offline) joins every rank's flat fp32 partitions, then cuts the state dict out of them: two fp32
    # copies of the model in one process
    offline_memory = memory({"fp32 state dict": FP32 * p, "joined flat fp32 partitions": FP32 * n * s}, {})
    return Prediction(
        model=name, world_size=n, dtype=dtype, persistence_threshold=persistence_threshold, num_params=p,
        num_tensors=len(numels), slice_numel=s, padding_numel=padding(numels, n), persistent_tensors=len(kept),
        persistent_numel=sum(kept), held_numel=s + sum(kept), param_bytes=b * (s + sum(kept)), grad_bytes=b * s,
        master_bytes=FP32 * s, optimizer_bytes=ADAM_STATES * FP32 * s,
        partitioned={**partitioned, **memory({}, {})},
        gathered={**route1, "written_bytes": b * p,
                  **with_ops({"all_gather_into_tensor": route1["allgather_bytes_per_rank"],
                              "broadcast": route1["broadcast_bytes_per_rank"]}),
                  **memory({"full model on rank 0 (param dtype)": b * p,
                            "two buffers of the largest module, gathered": 2 * largest_module},
                           {"two buffers of the largest module, gathered": 2 * largest_module},
                           device=("two buffers of the largest module, gathered",))},
        per_param={**route2, "written_bytes": b * p,
                   **with_ops({"all_gather_into_tensor": route2["allgather_bytes_per_rank"]}),
                   **memory({"full model on rank 0 (param dtype)": b * p,
                             "the largest tensor, gathered": largest_tensor},
                            {"two buffers of the largest tensor, gathered": 2 * largest_tensor},
                            device=("the largest tensor, gathered", "two buffers of the largest tensor, gathered"))},
        offline={"read_bytes": write * n, "written_bytes": FP32 * p, **with_ops({}), **offline_memory},
        # the export streams every tensor from the mapped rank files: no tensor is built in memory
        hf={"read_bytes": write * n, "written_bytes": FP32 * p, **with_ops({}), **memory({}, {})},
    )


MODE_KEYS = {"partitioned": "partitioned", "gathered16": "gathered", "per_param": "per_param", "offline": "offline",
             "hf": "hf"}


def predicted_for(pred: Prediction, mode: str, rank: int) -> dict[str, int]:
    """One rank's predicted bytes written, collective bytes and extra peak for save `mode`."""
    part = getattr(pred, MODE_KEYS[mode])
    extra = part["rank0_extra_peak_bytes"] if rank == 0 else part["other_extra_peak_bytes"]
    if mode == "partitioned":
        written = part["per_rank_bytes"][rank]
    else:  # one process writes the full model: rank 0 (offline and hf run as rank 0 alone)
        written = part["written_bytes"] if rank == 0 else 0
    return {"predicted_bytes": written, "predicted_comm_bytes": part["comm_bytes_per_rank"],
            "predicted_comm_ops": part["ops"], "predicted_extra_peak_bytes": extra}


def format_prediction(pred: Prediction, consolidated: bool = True) -> str:
    """A short human-readable summary of a prediction; `consolidated=False` leaves out the gathered saves' lines."""
    mib = 2**20
    part, gath = pred.partitioned, pred.gathered
    lines = [
        f"{pred.model}: P = {pred.num_params:,} in {pred.num_tensors} tensors, N = {pred.world_size}, {pred.dtype}, "
        f"stage3_param_persistence_threshold {pred.persistence_threshold:,}",
        f"  each rank owns a slice of {pred.slice_numel:,} elements "
        f"(P/N = {exact_ratio(pred.num_params, pred.world_size)}, padding {pred.padding_numel:,} elements in all)",
        f"  and keeps {pred.persistent_tensors} persistent tensors whole ({pred.persistent_numel:,} elements): "
        f"it holds {pred.held_numel:,} parameter elements",
        f"  held per rank: params {pred.param_bytes / mib:.2f} MiB, grads {pred.grad_bytes / mib:.2f} MiB, "
        f"fp32 master {pred.master_bytes / mib:.2f} MiB, Adam {pred.optimizer_bytes / mib:.2f} MiB",
        f"  partitioned save: {part['per_rank_bytes'][0]:,} bytes of tensor data per rank, "
        + (f"{part['per_rank_file_bytes']:,} bytes in its two files (torch.save's header included)"
           if part["per_rank_file_bytes"] else "its files add a header that holds the run's own DeepSpeed config and "
           "client state (not predicted for a config)")
        + f"\n  partitioned save's collectives: {part['comm_bytes_per_rank']:,}"
        f" bytes per rank ({part['tag_check_bytes_per_rank']} for the tag check, DeepSpeed's check that every rank "
        f"saves under the same tag; {part['regather_bytes_per_rank']:,} to gather the persistent tensors again)",
    ]
    return "\n".join(lines + [
        f"  gathered save (save_16bit_model): all-gather {gath['allgather_bytes_per_rank']:,} + broadcast "
        f"{gath['broadcast_bytes_per_rank']:,} bytes logged per rank, rank 0 extra peak "
        f"{gath['rank0_extra_peak_bytes']:,} bytes, writes {gath['written_bytes']:,} bytes",
        f"  per-parameter gather: all-gather {pred.per_param['allgather_bytes_per_rank']:,} bytes logged per rank",
    ] * consolidated)


def file_bytes(name: str, n: int, *, steps: int = 5, seed: int = 0, persistence_threshold: int = 0,
               dtype: str = "fp32") -> int:
    """Predicted size of one rank's two files on disk for preset `name` saved by this package's worker: payload plus
    torch.save's header (which holds the worker's DeepSpeed config and client state, so only a preset has one)."""
    config = ds_config(name, steps=steps, world_size=n, comms_logger=True, persistence_threshold=persistence_threshold,
                       bf16=dtype == "bf16")
    return module_file_bytes(meta_model(name), n, config, steps, package_client(config, n, steps, seed))
