"""What an asynchronous save holds while training goes on: a host copy of the state DeepSpeed hands to its engine.

The copy must be frozen (later optimizer steps change the tensors in place) and must serialise to the file DeepSpeed
would have written. `copy.deepcopy` gives both on CPU: torch copies each storage once, so tensors that share one
(DeepSpeed's flat partitions and their views) still share it, and `torch.save` of the copy writes the same records.
Measured here: copying a 960 MB state dict took 0.22 s, serialising it with `torch.save` into memory 0.46-0.51 s, so
the save call copies and the background thread serialises (docs/save_stall.md).

On a GPU, deepcopy would copy into GPU memory. So a device tensor is first copied to host memory, pinned where CUDA is
available (the copy from the device is then a DMA, faster than into pageable memory), one host storage per device
storage so sharing survives; deepcopy takes those copies from its memo. torch.save then records their location as
`cpu`; DeepSpeed's loaders and `zero_to_fp32.py` map every storage to where they need it.

torch's caching host allocator rounds each pinned block up to a power of two and keeps it after the copy is freed, so
the pinned memory held (`measure.meters.pinned_host_bytes`, recorded as an asynchronous save's `pinned_bytes` beside
its `snapshot_bytes`) can be up to twice the snapshot's own bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any


def host_copy(state: Any) -> Any:
    """A deep copy of `state` with every tensor in host memory, storage sharing kept."""
    storages: dict[tuple[str, int], Any] = {}
    memo = {id(t): to_host(t, storages) for t in tensors_in(state) if t.device.type != "cpu"}
    return copy.deepcopy(state, memo)


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


def to_host(tensor: Any, storages: dict[tuple[str, int], Any]) -> Any:
    """`tensor` as a view of a host copy of its whole storage (made once per storage, pinned where CUDA is)."""
    import torch

    source = tensor.untyped_storage()
    key = (str(tensor.device), source.data_ptr())
    if key not in storages:
        pinned = tensor.device.type == "cuda"  # never pin for other devices: that would create a CUDA context
        storages[key] = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        storages[key].copy_(source)  # blocking: the background thread reads it next
    host = torch.empty(0, dtype=tensor.dtype).set_(storages[key], tensor.storage_offset(), tensor.size(),
                                                   tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    return host.requires_grad_(tensor.requires_grad) if tensor.is_leaf else host


def pins(state: Any) -> bool:
    """Whether `host_copy(state)` pins host memory: it does for every CUDA tensor, and only for those."""
    return any(t.device.type == "cuda" for t in tensors_in(state))


def storage_bytes(state: Any) -> int:
    """Host bytes held by the tensors of `state`, each storage counted once."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(state)}
    return sum(seen.values())
