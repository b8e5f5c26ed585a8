"""What an asynchronous save holds while training goes on: a host copy of the state DeepSpeed hands to its engine.

The copy must be frozen (later optimizer steps change the tensors in place) and serialise to the file DeepSpeed
would have written. `copy.deepcopy` gives both on CPU: torch copies each storage once, so tensors that share one
(DeepSpeed's flat partitions and their views) still share it. Copying a 960 MB state dict took 0.22 s here,
serialising it 0.46-0.51 s: the save call copies, the background thread serialises (docs/save_stall.md).

On a GPU a device tensor is first copied into host memory, pinned (the copy is then a DMA), one host storage per
device storage so sharing survives; deepcopy takes those copies from its memo. torch's pinned pool rounds blocks up
to powers of two, so the pinned memory held can be twice the snapshot's bytes.
"""

from __future__ import annotations

import copy
from typing import Any

from zckpt_nb.format.sizes import tensors_in


def host_copy(state: Any) -> Any:
    """A deep copy of `state` with every tensor in host memory, storage sharing kept."""
    storages: dict[tuple[str, int], Any] = {}
    memo = {id(t): to_host(t, storages) for t in tensors_in(state) if t.device.type != "cpu"}
    return copy.deepcopy(state, memo)


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
