"""Which device each rank of a launch gets: NCCL puts one rank on one GPU, so GPU ranks are at most the GPUs here;
CPU ranks (DeepSpeed's CPU accelerator, `DS_ACCELERATOR=cpu`, gloo) run anywhere, any number of them."""

from __future__ import annotations

import os
from dataclasses import dataclass

CPU_HINT = "DS_ACCELERATOR=cpu to run any number of CPU ranks (gloo) on any machine"


@dataclass(frozen=True)
class Placement:
    """The ranks of one launch: how many, on which accelerator, and why."""

    ranks: int
    accelerator: str  # "cuda" (one GPU per rank, NCCL) or "cpu" (CPU ranks, gloo)
    note: str


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 on CPU-only machines or with DS_ACCELERATOR=cpu)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine() -> tuple[str, int]:
    """This machine's accelerator and GPU count: ("cuda", n) with GPUs, ("cpu", 0) without."""
    gpus = gpu_count()
    return ("cuda", gpus) if gpus else ("cpu", 0)
