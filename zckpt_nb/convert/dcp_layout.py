"""Where a DCP checkpoint of a causal LM keeps its weights, Adam's moments, param group and step, found by layout.

Three layouts, as DCP flattens them into its metadata's keys: nested (`get_state_dict` under FSDP2: `model.<fqn>`,
`<optim>.state.<fqn>.exp_avg`, `<optim>.param_groups.0.lr`), flattened (`flatten_optimizer_state_dict=True`: the
group's items once per parameter) and torchtitan's step folder (the model's keys at top level). The layout is the one
whose keys hold every parameter of the model `--config` builds, with its shape. Nothing here reads a tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.convert.zero_shards import MOMENTS
from zckpt_nb.errors import CheckpointError

OPTIMIZER_KEYS = ("optim", "optimizer")  # get_state_dict's examples name it `optim`; torchtitan `optimizer`
NOT_MODEL = ("optim", "optimizer", "lr_scheduler", "dataloader", "train_state")  # torchtitan's other top-level keys
TRAIN_STATE = ("step", "seed", "global_batch", "world_size", "steps")  # the package's; other writers' are not read
STEP_IN_NAME = re.compile(r"(?:global_step|step|checkpoint|iter)[-_]?(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelNames:
    """The model `--config` builds: each parameter's first name and shape (model order), tied names, state keys."""

    params: dict[str, tuple[int, ...]]
    ties: dict[str, str]
    keys: frozenset[str]


@dataclass(frozen=True)
class Layout:
    """The keys one checkpoint keeps a parameter's weights and moments under, and its param group's prefixes."""

    model: str  # "model." (nested, flattened) or "" (torchtitan: the model's keys at top level)
    optim: str  # "optim" or "optimizer"
    nested_group: bool  # param_groups.0.* (nested) or param_groups.<fqn>.* (flattened)

    def weight(self, name: str) -> str:
        """The key of parameter `name`'s weights."""
        return f"{self.model}{name}"

    def state(self, name: str, kind: str) -> str:
        """The key of parameter `name`'s optimizer state `kind` (exp_avg, exp_avg_sq, step)."""
        return f"{self.optim}.state.{name}.{kind}"


def model_prefix(folder: Path, tensors: dict[str, tuple[int, ...]], names: ModelNames) -> str:
    """"model." or "": where each parameter of the config's model has its weights, with its shape, and nothing more."""
    top = tuple(f"{k}." for k in NOT_MODEL)
    for prefix in ("model.", ""):
        if all(tensors.get(prefix + n) == s for n, s in names.params.items()):
            extra = sorted(k for k in tensors if k.startswith(prefix) and not (prefix == "" and k.startswith(top))
                           and k[len(prefix):] not in names.keys)
            if extra:
                raise CheckpointError(f"{folder} holds {extra[0]!r}, which the model --config builds has no place for "
                                      f"({len(extra)} such tensors): pass the --config the checkpoint was trained with")
            return prefix
    name, shape = next(iter(names.params.items()))
    for prefix in ("model.", ""):
        if prefix + name in tensors and tensors[prefix + name] != shape:
            raise CheckpointError(f"{folder} holds {prefix + name!r} of shape {tensors[prefix + name]}, but the model "
                                  f"--config builds has {shape}: pass the --config the checkpoint was trained with")
    missing = next(n for n, s in names.params.items() if tensors.get("model." + n) != s and tensors.get(n) != s)
    raise CheckpointError(f"{folder} holds no weights {missing!r} of shape {names.params[missing]} (neither under "
                          "'model.' nor at top level) for the model --config builds: pass the --config the checkpoint "
                          "was trained with")


def find_layout(folder: Path, meta: dict[str, Any], names: ModelNames) -> Layout:
    """The checkpoint's layout; CheckpointError in one line where it holds no weights or no AdamW state for them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k: tuple(v.size) for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}  # key -> shape
    prefix = model_prefix(folder, tensors, names)
    optim = next((o for o in OPTIMIZER_KEYS if any(k.startswith(f"{o}.state.") for k in tensors)), None)
    if optim is None:
        raise CheckpointError(f"{folder} holds the model's weights but no optimizer state (no optim.state.* or "
                              "optimizer.state.*), such as torchtitan's model-only last save: from-dcp converts a "
                              "training checkpoint; convert an earlier step's folder, which keeps Adam's moments")
    layout = Layout(prefix, optim, f"{optim}.param_groups.0.lr" in meta)
    for name in names.params:
        missing = [k for k in (*MOMENTS, "step") if layout.state(name, k) not in tensors]
        if missing:
            raise CheckpointError(f"{folder} has no {missing[0]} for {name!r} under {optim}.state (a frozen "
                                  "parameter, or an optimizer other than Adam/AdamW): from-dcp converts an AdamW "
                                  "checkpoint whose every parameter has its moments")
    return layout


def global_keys(meta: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """What to read besides tensors: the param group, LR scheduler and the package's train state."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    wanted = (f"{layout.optim}.param_groups.", "lr_scheduler.", *(f"train_state.{k}" for k in TRAIN_STATE))
    keys: dict[str, Any] = {k: None for k, v in meta.items()
                            if isinstance(v, BytesStorageMetadata) and k.startswith(wanted)}
    step = meta.get("train_state.step")
    if step is not None and "train_state.step" not in keys:  # torchtitan: a 0-d integer tensor
        keys["train_state.step"] = torch.zeros(tuple(step.size), dtype=step.properties.dtype)
    return keys


def param_group(folder: Path, values: dict[str, Any], layout: Layout, names: ModelNames) -> dict[str, Any]:
    """The one AdamW param group (without its params); CheckpointError where the checkpoint has several."""
    base = f"{layout.optim}.param_groups."
    items = {k[len(base):]: v for k, v in values.items() if k.startswith(base)}
    if layout.nested_group:
        if any(k.startswith("1.") for k in items):
            raise CheckpointError(f"{folder} has more than one optimizer parameter group; from-dcp converts one")
        return {k[2:]: v for k, v in items.items() if k.startswith("0.") and k != "0.params"}
    groups = [{k[len(n) + 1:]: v for k, v in items.items() if k.startswith(f"{n}.")} for n in names.params]
    if any(g != groups[0] for g in groups):
        raise CheckpointError(f"{folder} has more than one optimizer parameter group (their settings differ between "
                              "parameters); from-dcp converts one")
    return groups[0]


def saved_step(folder: Path, values: dict[str, Any]) -> int | None:
    """The train state's step (an int, or a 0-d tensor as torchtitan saves it), if the checkpoint has one."""
    step = values.get("train_state.step")
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) and not (hasattr(step, "numel") and step.numel() == 1):
        raise CheckpointError(f"{folder}'s train_state.step is a {type(step).__name__}, not a step number: restore "
                              "the checkpoint from a trusted copy")
    return int(step)


def resolve_step(folder: Path, saved: int | None, given: int | None) -> int:
    """The step: saved in the checkpoint, else `--step`, else from the folder's name (step-100, ...)."""
    if saved is not None and given is not None and saved != given:
        raise CheckpointError(f"{folder} records step {saved}, but --step says {given}: drop --step")
    found = STEP_IN_NAME.search(folder.name)
    step = saved if saved is not None else given if given is not None else int(found[1]) if found else None
    if step is None:
        raise CheckpointError(f"{folder} records no step (no train_state.step) and its name {folder.name!r} gives "
                              "none (step-100, global_step100, ...): pass --step N")
    return step
