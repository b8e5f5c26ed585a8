"""What a rank's checkpoint files weigh: ZeRO-3's partition arithmetic, and the save preflight's bound of the bytes.

Each rank owns every tensor's slice, padded to a multiple of N; its optimizer file holds 12 bytes per owned element
(fp32 master weights, Adam's two moments). The rest of its two files is header: what DeepSpeed pickles beside the
tensors and the zip record `torch.save` writes around each. The preflight bounds that header per tensor
(`save_bytes`, a few KiB above the files).
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Iterator
from itertools import chain
from typing import Any

ADAM_STATES = 2  # exp_avg, exp_avg_sq
FP32 = 4
TENSOR_HEADER = 640  # bytes around one tensor: its pickled rebuild and name, zip entry, shapes entry (measured 390-460)
FILES_HEADER = 8 * 2**10  # the rest of the two files: zip directories, DeepSpeed's bookkeeping, the optimizer's


def fixed_tensor_bytes() -> int:
    """Tensor bytes every rank saves whatever P is: its torch RNG state (client state) and Adam's fp32 step."""
    import torch

    return torch.get_rng_state().numel() + FP32


def slice_numel(numels: tuple[int, ...], n: int) -> int:
    """Elements each rank owns under ZeRO-3: every tensor padded to a multiple of N, then split N ways."""
    return sum(math.ceil(k / n) for k in numels)


def padding(numels: tuple[int, ...], n: int) -> int:
    """Elements of padding over all ranks: N x slice - P."""
    return n * slice_numel(numels, n) - sum(numels)


def exact_ratio(p: int, n: int) -> str:
    """P/N written exactly: an integer, or an integer and a fraction (never a rounded float)."""
    whole, rest = divmod(p, n)
    return f"{whole:,}" + (f" {rest}/{n}" if rest else "")


def tensors_in(obj: Any) -> Iterator[Any]:
    """Every tensor reachable through dicts, lists and tuples (where DeepSpeed's state dicts keep them)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors_in(item)


def save_bytes(engine: Any, state: dict[str, Any]) -> int:
    """An upper bound of this rank's two files when the ZeRO-3 `engine` saves client `state`."""
    module = engine.module
    owned = sum(getattr(p, "ds_tensor", p).numel() for p in module.parameters())
    client = list(tensors_in(state))
    whole = [t for t in chain(module.parameters(), module.buffers(), client) if t.numel()]
    names = sum(len(name) for name, _ in chain(module.named_parameters(), module.named_buffers()))
    records = len(list(module.parameters())) + len(list(module.buffers())) + len(client) + 2 + ADAM_STATES
    skeleton = copy.deepcopy(state, {id(t): None for t in client})  # the client state without its tensors
    return ((1 + ADAM_STATES) * FP32 * owned + sum(t.numel() * t.element_size() for t in whole)
            + TENSOR_HEADER * records + 3 * names + 2 * len(pickle.dumps(engine.config))
            + len(pickle.dumps(skeleton)) + FILES_HEADER)
