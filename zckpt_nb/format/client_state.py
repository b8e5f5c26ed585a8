"""The package's entry in DeepSpeed's client state (under `CLIENT_KEY`, beside a user's keys): data position, batch,
LR horizon and every RNG state."""

from __future__ import annotations

import random
from typing import Any

CLIENT_KEY = "zckpt"  # our entry inside DeepSpeed's client_state


def rng_state() -> dict[str, Any]:
    """Every random state this rank's next step depends on (dropout draws from torch's)."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # a GPU rank; asking a CPU rank would create a CUDA context on GPU 0
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def client_state(step: int, seed: int, global_batch: int, world_size: int, horizon: int) -> dict[str, Any]:
    """What exact resumption needs beyond DeepSpeed's state (a universal load hands every rank rank 0's)."""
    return {CLIENT_KEY: {"step": step, "seed": seed, "global_batch": global_batch, "world_size": world_size,
                         "steps": horizon, "rng": rng_state()}}  # steps: the LR schedule's horizon (train.py)
