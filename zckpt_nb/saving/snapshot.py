"""What an asynchronous save holds while training goes on: a frozen host copy of the state DeepSpeed hands its engine.

`copy.deepcopy` copies each storage once, so views stay views and the copy serialises to the same file (docs/
save_stall.md: copying is about half the time of serialising). A device tensor first goes to host memory (pinned
on CUDA), one host storage per device storage, taken by deepcopy from its memo. For a writer process every storage
goes to shared memory instead. By hand rather than PyTorch's `DefaultStager`: that stager drops `requires_grad` and
the `Parameter` type, so its copy would not serialise to the synchronous save's bytes.
"""

from __future__ import annotations

import copy
from typing import Any

from zckpt_nb.format.sizes import tensors_in


def host_copy(state: Any, staging: dict[tuple[str, int], Any] | None = None) -> Any:
    """A deep copy of `state` with every tensor in host memory (or `staging`'s shared buffers)."""
    storages: dict[tuple[str, int], Any] = {}
    memo = {id(t): to_host(t, storages, staging) for t in tensors_in(state)
            if staging is not None or t.device.type != "cpu"}
    return copy.deepcopy(state, memo)


def to_host(tensor: Any, storages: dict[tuple[str, int], Any],
            staging: dict[tuple[str, int], Any] | None = None) -> Any:
    """`tensor` as a view of a host copy of its whole storage, made once per storage."""
    import torch

    source = tensor.untyped_storage()
    key = (str(tensor.device), source._cdata)  # the storage itself, as torch.save tells storages apart (empty ones too)
    if key not in storages:
        if staging is not None:
            if key not in staging or staging[key].nbytes() != source.nbytes():
                staging[key] = torch.UntypedStorage(source.nbytes())
                staging[key] = staging[key].share_memory_() if source.nbytes() else staging[key]
            storages[key] = staging[key]
        else:
            pinned = tensor.device.type == "cuda"  # never pin for other devices: that would create a CUDA context
            storages[key] = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        storages[key].copy_(source)  # blocking: the background thread reads it next
    host = torch.empty(0, dtype=tensor.dtype).set_(storages[key], tensor.storage_offset(), tensor.size(),
                                                   tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        host = torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    elif tensor.is_leaf:
        host.requires_grad_(tensor.requires_grad)
    host.__dict__.update(copy.deepcopy(tensor.__dict__))  # what DeepSpeed sets on a tensor (ds_id): the file keeps it
    return host


def pins(state: Any) -> bool:
    """Whether `host_copy(state)` pins host memory: it does for every CUDA tensor, and only for those."""
    return any(t.device.type == "cuda" for t in tensors_in(state))


def storage_bytes(state: Any) -> int:
    """Host bytes held by the tensors of `state`, each storage counted once."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_in(state)}
    return sum(seen.values())
