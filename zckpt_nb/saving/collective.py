"""The commit protocol's object collectives, on this thread's process group.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from zckpt_nb.measure import meters

# The process group of this thread's protocol collectives: None (the default group) except in an asynchronous save's
# background thread, which commits on a group of its own while training runs collectives on the default one.
GROUP: ContextVar[Any] = ContextVar("zckpt_protocol_group", default=None)


def gather(obj: Any) -> list[Any]:
    """all_gather_object: every rank's `obj` on every rank (on this thread's `GROUP`)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=GROUP.get())
    meters.count_object_collective(out)  # DeepSpeed's comms logger does not see torch's object collectives
    return out
