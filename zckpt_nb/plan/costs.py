"""A small model of ZeRO-3 state and save costs, computed from the model config alone (no run needed).

The formulas, each with the DeepSpeed function it follows, are in docs/cost_model.md ("The formulas").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zckpt_nb.format.records import Record
from zckpt_nb.format.sizes import ADAM_STATES, FP32, fixed_tensor_bytes, padding, slice_numel
from zckpt_nb.model import meta_model

OFFLINE_SHARD_BYTES = 5 * 10**9  # zero_to_fp32's max_shard_size="5GB" (huggingface_hub reads GB as 10**9)

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


def gather_bytes(numels: tuple[int, ...], n: int, dtype_bytes: int) -> int:
    """What DeepSpeed's comms logger records on each rank for all-gathering these tensors: the slices sent."""
    return slice_numel(numels, n) * dtype_bytes


@dataclass(frozen=True)
class Memory:
    """One term of a save's extra peak memory: its bytes on rank 0 and on each other rank, and where it is held."""

    what: str
    rank0_bytes: int
    other_bytes: int = 0
    on_device: bool = False  # held where the parameters live (GPU memory on GPU ranks); else host memory


@dataclass(frozen=True)
class SaveCost:
    """One route's cost predicted from a config: bytes, collectives, memory terms (measured: `records.SaveCost`)."""

    route: str
    written_bytes: int
    read_bytes: int = 0
    ops: dict[str, int] = field(default_factory=dict)  # DeepSpeed op name -> bytes logged on each rank
    memory: tuple[Memory, ...] = ()

    @property
    def comm_bytes(self) -> int:
        """Collective bytes DeepSpeed logs on each rank, every op together."""
        return sum(self.ops.values())

    def extra_peak_bytes(self, rank: int = 0) -> int:
        """The extra peak memory on `rank` (every term, host and device)."""
        return sum(m.rank0_bytes if rank == 0 else m.other_bytes for m in self.memory)


@dataclass(frozen=True)
class Prediction(Record):
    """What the cost model says about one preset or config on N ranks (every figure per rank unless named)."""

    model: str
    world_size: int
    dtype: str
    persistence_threshold: int
    num_params: int
    num_tensors: int
    slice_numel: int
    padding_numel: int  # over all ranks
    persistent_tensors: int
    persistent_numel: int  # elements each rank holds whole beyond its slice
    held_numel: int  # slice + persistent: the parameter elements each rank holds
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    optimizer_bytes: int
    tag_check_bytes: int
    regather_bytes: int  # the partitioned save's epilogue gathers the persistent tensors again
    saves: dict[str, SaveCost]  # by route: partitioned, gathered16, per_param, offline, hf


def nonzero(ops: dict[str, int]) -> dict[str, int]:
    """A route's collectives without the ops it does not run."""
    return {op: v for op, v in ops.items() if v}


def predict(name: str, n: int, dtype: str = "fp32", persistence_threshold: int = 0) -> Prediction:
    """Everything the cost model says about preset or config `name` on `n` ranks."""
    numels, walk = tensor_numels(name), module_walk_numels(name)
    p, s, b = sum(numels), slice_numel(numels, n), DTYPE_BYTES[dtype]
    kept = persistent(numels, persistence_threshold)
    regather = gather_bytes(kept, n, b) if n > 1 else 0  # a world of one rank has nothing to gather
    released = tuple(k for k in numels if k > persistence_threshold)  # what a gathered save must fetch
    walk_released = tuple(k for k in walk if k > persistence_threshold)
    shard = (1 + ADAM_STATES) * FP32 * s + fixed_tensor_bytes()  # fp32 master slice + Adam moments + fixed
    # GatheredParameters allocates one buffer per tensor it gathers, its N slices (padded to a multiple of N), and
    # points the parameter at it: no second copy (partition_parameters.py, _allgather_params_*). Persistent tensors
    # are whole already and gather nothing; at N = 1 it is an upper bound (DeepSpeed may have left tensors whole, and
    # a module's several tensors are then used in place). On CPU ranks gloo's all-gather also allocates a flat output
    # of the same size while it runs (ProcessGroupGloo's allgather, newLikeFlat), so a CPU rank's peak holds about two.
    module = max(n * slice_numel(tuple(k for k in g if k > persistence_threshold), n) for g in module_numels(name)) * b
    tensor = n * slice_numel((max(released, default=0),), n) * b
    full = Memory("full model on rank 0 (param dtype)", b * p)
    saves = [
        SaveCost("partitioned", shard,
                 ops=nonzero({"all_reduce": TAG_CHECK_BYTES, "all_gather_into_tensor": regather})),
        # save_16bit_model gathers each module's own parameters and broadcasts them back from rank 0
        SaveCost("gathered16", b * p, ops=nonzero({"all_gather_into_tensor": gather_bytes(walk_released, n, b),
                                                   "broadcast": sum(walk) * b}),
                 memory=(full, Memory("largest module, gathered (one padded buffer per tensor)", module, module,
                                      True))),
        SaveCost("per_param", b * p, ops=nonzero({"all_gather_into_tensor": gather_bytes(released, n, b)}),
                 memory=(full, Memory("largest tensor, gathered (one padded buffer)", tensor, tensor, True))),
        # zero_to_fp32 maps every optimizer file and drops the moments unread: it reads the fp32 master slices only.
        # convert_zero_checkpoint_to_fp32_state_dict runs it with lazy_mode=True and builds one output shard
        # (max_shard_size, 5 GB) at a time, each tensor joined from the mapped slices (torch.cat of its N padded
        # pieces): the peak is one shard plus the largest tensor being joined, not the whole model
        SaveCost("offline", FP32 * p, read_bytes=FP32 * s * n,
                 memory=(Memory("one output shard (max_shard_size)", min(FP32 * p, OFFLINE_SHARD_BYTES)),
                         Memory("largest tensor, joined from N padded slices", FP32 * math.ceil(max(numels) / n) * n))),
        SaveCost("hf", FP32 * p, read_bytes=shard * n),  # every byte hashed first; then streamed, nothing built
    ]
    return Prediction(
        model=name, world_size=n, dtype=dtype, persistence_threshold=persistence_threshold, num_params=p,
        num_tensors=len(numels), slice_numel=s, padding_numel=padding(numels, n), persistent_tensors=len(kept),
        persistent_numel=sum(kept), held_numel=s + sum(kept), param_bytes=b * (s + sum(kept)), grad_bytes=b * s,
        master_bytes=FP32 * s, optimizer_bytes=ADAM_STATES * FP32 * s,
        tag_check_bytes=TAG_CHECK_BYTES, regather_bytes=regather, saves={c.route: c for c in saves})

