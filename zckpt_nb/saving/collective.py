"""The commit protocol's object collectives, on this thread's process group, and how long a collective may wait."""

from __future__ import annotations

import os
import pickle
from contextvars import ContextVar
from typing import Any

from zckpt_nb.errors import is_peer_failure, peer_failure
from zckpt_nb.measure import meters

# The process group of this thread's protocol collectives: None (the default group) except in an asynchronous save's
# background thread, which commits on a group of its own while training runs collectives on the default one.
GROUP: ContextVar[Any] = ContextVar("zckpt_protocol_group", default=None)


def gather(obj: Any) -> list[Any]:
    """all_gather_object on this thread's `GROUP`; a lost peer raises `CollectiveTimeout`."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj, group=GROUP.get())
    except Exception as e:  # a dead peer (gloo, NCCL's DistBackendError) or a timeout: one error, no more collectives
        if not is_peer_failure(e):
            raise
        raise peer_failure(e, dist.get_rank(), "the commit protocol's agreement") from None
    meters.OBJECT_COLLECTIVES["ops"] += 1  # DeepSpeed's comms logger does not see torch's object collectives
    meters.OBJECT_COLLECTIVES["bytes"] += sum(len(pickle.dumps(item)) + 8 for item in out)
    return out


def timeout_seconds(flag: float | None) -> float:
    """Seconds a collective may wait for the other ranks: `flag`, else $ZCKPT_COLLECTIVE_TIMEOUT, else 600."""
    return flag if flag is not None else float(os.environ.get("ZCKPT_COLLECTIVE_TIMEOUT", 600))
