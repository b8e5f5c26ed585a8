"""Notebook 09's plumbing for a one-rank gloo group inside the notebook's own kernel: the variables `torchrun` would
set, DeepSpeed's start-up output hidden, and the timeout read back from the group."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from zckpt_nb.run.launch import free_port


def one_rank_env() -> dict[str, str]:
    """The five variables `torchrun` sets, for rank 0 of 1 on a free local port (without all five, DeepSpeed's
    `init_distributed` looks for MPI instead)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1"}


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Hide what DeepSpeed and a compiler print (stdout, and stderr at the file descriptor) while a group or an engine
    starts; errors still raise."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(io.StringIO()):
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def group_timeout() -> timedelta:
    """The timeout the default (gloo) process group holds: its CPU backend's options (a private field of torch's)."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
