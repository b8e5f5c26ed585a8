"""What an asynchronous save holds while training goes on: a frozen host copy of the state DeepSpeed hands its engine.

`copy.deepcopy` copies each storage once, so views stay views and the copy serialises to the same file (docs/
save_stall.md: copying is about half the time of serialising). Each storage is copied into a host buffer (pinned
for a CUDA tensor, shared memory for a writer process) that the saver keeps and reuses at its next save: with at
most one save in flight, a buffer is free again when the next save copies into it, and only the first save pays
for allocating (page-faulting) the buffers. By hand rather than PyTorch's `DefaultStager`: that stager drops
`requires_grad` and the `Parameter` type, so its copy would not serialise to the synchronous save's bytes.
"""

from __future__ import annotations

import copy
from typing import Any

from zckpt_nb.format.sizes import tensors_in


class Staging:
    """The host buffers a saver's saves copy into, by source storage; a buffer one save leaves unused is dropped."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared  # buffers in shared memory, for a writer process
        self.kept: dict[tuple[str, int], Any] = {}  # the last save's buffers, free for this one
        self.used: dict[tuple[str, int], Any] = {}  # this save's

    def next_save(self) -> None:
        """Before each save (the one before it written): its buffers are free again, those it did not use dropped."""
        self.kept, self.used = self.used or self.kept, {}

    def buffer(self, key: tuple[str, int], tensor: Any, nbytes: int) -> Any:
        """A host buffer of `nbytes` for the source storage `key` (`tensor`'s), the last save's where it fits."""
        import torch

        if key not in self.used:
            kept = self.kept.pop(key, None)
            if kept is None or kept.nbytes() != nbytes:
                pinned = tensor.device.type == "cuda"  # never pin for other devices: that would create a CUDA context
                kept = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
                kept = kept.share_memory_() if self.shared and nbytes else kept
            self.used[key] = kept
        return self.used[key]


def host_copy(state: Any, staging: Staging | None = None) -> Any:
    """A deep copy of `state` with every tensor in a host buffer of `staging` (kept for the next save), else new."""
    storages: dict[tuple[str, int], Any] = {}
    staging = staging or Staging()  # none given: new buffers, dropped with the copy
    memo = {id(t): to_host(t, storages, staging) for t in tensors_in(state)}
    return copy.deepcopy(state, memo)


def to_host(tensor: Any, storages: dict[tuple[str, int], Any], staging: Staging) -> Any:
    """`tensor` as a view of a host copy of its whole storage, copied once per storage into a buffer of `staging`."""
    import torch

    source = tensor.untyped_storage()
    key = (str(tensor.device), source._cdata)  # the storage itself, as torch.save tells storages apart (empty ones too)
    if key not in storages:
        storages[key] = staging.buffer(key, tensor, source.nbytes())
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
