"""A ZeRO-3 checkpoint's parameters read straight from its rank files, one tensor at a time, in bounded memory.

DeepSpeed's public `zero_to_fp32` helpers (`zero3_partitioned_param_info`, `GatheredTensor`) locate each parameter's
slices of the flat fp32 partitions and Adam's moments; neither DeepSpeed reader gives one parameter on demand. The
files are memory-mapped weights-only and unmapped as a budget of bytes is read through them (docs/dcp.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import excludes_frozen, shard_paths
from zckpt_nb.convert.safeload import load
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.units import listed
from zckpt_nb.model import on_meta

ZERO_3 = 3  # DeepSpeed's ZeroStageEnum.weights
MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHTS = "fp32"  # DeepSpeed's name for a parameter's fp32 weights (its universal copy names files so)


class MappedFiles:
    """Checkpoint files loaded memory-mapped on first use and unmapped once `budget` bytes were read through them."""

    def __init__(self, paths: list[Path], budget: int) -> None:
        self.paths, self.budget, self.used, self.loaded = paths, budget, 0, {}

    def get(self, index: int) -> Any:
        """File `index`, unpickled weights-only with its tensors memory-mapped."""
        if index not in self.loaded:
            self.loaded[index] = load(self.paths[index], mmap=True)
        return self.loaded[index]

    def spent(self, nbytes: int) -> None:
        """Count `nbytes` read through the mappings; unmap them all once the budget is reached."""
        self.used += nbytes
        if self.used >= self.budget:
            self.loaded, self.used = {}, 0


def check_frozen_kept(states: dict[str, Any], config: Callable[[], Any], present: set[str], where: Path) -> None:
    """CheckpointError where frozen weights were not saved and `config()`'s model lacks some in `present`."""
    if not excludes_frozen(states):
        return
    config = config()
    if config is None:
        raise CheckpointError(f"{where} was saved with exclude_frozen_parameters=True and has no config.json beside "
                              "it to tell which weights it lacks: pass the model's config (--config)")
    missing = [name for name, _ in on_meta(config).named_parameters() if name not in present]
    if missing:
        raise CheckpointError(f"{where} was saved with exclude_frozen_parameters=True: it holds no weights for "
                              f"{listed(missing, 1)}, which would load randomly initialised; save it again without "
                              "that option, or resume it in training with zckpt_nb.resume(engine, dir, strict=False)")


def own_storage(tensor: Any) -> Any:
    """`tensor`, copied if it is a view into a larger storage (padding): DCP writes and frees whole storages."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


class ShardReader:
    """One parameter's fp32 weights or Adam moment, gathered from every rank's partition of a ZeRO-3 tag folder."""

    def __init__(self, folder: Path, names: list[str] | None = None) -> None:
        ranks = shard_paths(folder, names)  # the manifest's rank files, where there is one
        self.states = load(ranks[0]["model"], mmap=True)  # rank 0's model states, read once: names, shapes, ties
        # the largest parameter's fp32 state in bytes (weights and both moments; a frozen one's weights only)
        trainable = max(int(s.numel()) for group in self.states["param_shapes"] for s in group.values())
        frozen = max((int(s.numel()) for s in (self.states.get("frozen_param_shapes") or {}).values()), default=0)
        self.unit = 4 * max(3 * trainable, frozen)
        self.models = MappedFiles([ranks[r]["model"] for r in sorted(ranks)], self.unit // 2)
        self.models.loaded[0] = self.states
        self.optims = MappedFiles([ranks[r]["optim"] for r in sorted(ranks)], self.unit // 2) \
            if "optim" in ranks[0] else None
        self.frozen = dict(self.states.get("frozen_param_shapes") or {})
        self.places: dict[str, tuple[int, int, Any]] = {}

    def optimizer(self) -> dict[str, Any]:
        """Rank 0's optimizer state (the param groups, the step), as DeepSpeed's optimizer_state_dict holds it."""
        return self.optims.get(0)["optimizer_state_dict"]

    def plain(self) -> bool:
        """The files are the layout read here: ZeRO-3, one optimizer file per rank, every sub-group's moments."""
        if self.optims is None:
            return False
        optim = self.optimizer()
        groups = len(optim.get("fp32_flat_groups") or [])
        state = optim.get("optimizer_state_dict", {}).get("state", {})
        return (int(optim.get("zero_stage", 0)) == ZERO_3 and optim.get("partition_count") == len(self.optims.paths)
                and groups > 0 and all(set(MOMENTS) <= set(state.get(i, {})) for i in range(groups)))

    def index(self, shapes: dict[str, Any]) -> None:
        """Each trainable parameter's (offset, numel per rank, shape) in the flat partitions."""
        from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info

        offset, world = 0, len(self.optims.paths)
        for name, shape in shapes.items():
            per_rank, _ = zero3_partitioned_param_info(shape.numel(), world)
            self.places[name] = (offset, per_rank, shape)
            offset += per_rank
        available = sum(int(t.numel()) for t in self.optimizer()["fp32_flat_groups"])
        if offset != available:
            raise CheckpointError(f"{self.optims.paths[0]}: the parameters take {offset} elements of each rank's "
                                  f"partition, the file holds {available}; the model-states and optimizer files "
                                  "disagree (save the checkpoint again)")

    def flat_groups(self, kind: str) -> list[list[Any]]:
        """Every rank's flat partitions of `kind` (fp32 weights or a moment), one per sub-group."""
        out = []
        for rank in range(len(self.optims.paths)):
            optim = self.optims.get(rank)["optimizer_state_dict"]
            state = optim["optimizer_state_dict"]["state"]
            out.append(list(optim["fp32_flat_groups"]) if kind == WEIGHTS else
                       [state[i][kind] for i in range(len(optim["fp32_flat_groups"]))])
        return out

    def trainable(self, name: str, kind: str) -> Any:
        """Trainable parameter `name`'s `kind`, whole, in a storage of its own."""
        import numpy as np
        from deepspeed.utils.zero_to_fp32 import GatheredTensor

        offset, per_rank, shape = self.places[name]
        groups = self.flat_groups(kind)
        starts = [0, *np.cumsum([int(t.numel()) for t in groups[0]]).tolist()]
        tensor = own_storage(GatheredTensor(groups, starts, offset, per_rank, shape).contiguous())
        self.optims.spent(per_rank * len(groups) * tensor.element_size())
        return tensor

    def frozen_weight(self, name: str) -> Any:
        """Frozen parameter `name`'s weights: every rank's padded share, joined and cut to its shape."""
        import torch

        shape = self.frozen[name]
        parts = [self.models.get(r)["frozen_param_fragments"][name] for r in range(len(self.models.paths))]
        tensor = own_storage(torch.cat(parts).narrow(0, 0, shape.numel()).view(shape))
        self.models.spent(sum(p.nbytes for p in parts))
        return tensor

    def drop(self) -> None:
        """Unmap every file now."""
        self.models.loaded = {}
        if self.optims is not None:
            self.optims.loaded = {}
