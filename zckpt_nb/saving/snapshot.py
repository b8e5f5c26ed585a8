"""What an asynchronous save holds while training goes on: a frozen host copy of the state DeepSpeed hands its engine.

`copy.deepcopy` copies each storage once, so views stay views and the copy serialises to the same file (docs/
save_stall.md: copying is about half the time of serialising). A device tensor first goes to host memory (pinned
on CUDA), one host storage per device storage, taken by deepcopy from its memo.
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
