"""How many ranks a launch can have on this machine, and which device each rank gets.

NCCL puts one rank on one GPU ("Duplicate GPU detected" otherwise), so GPU ranks are at most the GPUs present. CPU ranks
(DeepSpeed's CPU accelerator, `DS_ACCELERATOR=cpu`, gloo) run on any machine, any number of them. Simulated nodes on
one machine each get their own GPUs through `CUDA_VISIBLE_DEVICES` (every node's first rank is `LOCAL_RANK` 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zckpt_nb.format.units import counted

CPU_HINT = "DS_ACCELERATOR=cpu to run any number of CPU ranks (gloo) on any machine"


@dataclass(frozen=True)
class Placement:
    """The ranks of one launch: how many, on which accelerator, which GPUs (local rank i -> gpus[i]), and why."""

    ranks: int
    accelerator: str  # "cuda" (one GPU per rank, NCCL) or "cpu" (CPU ranks, gloo)
    note: str
    gpus: tuple[int, ...] = ()  # CUDA device indices of this machine; () on CPU or for all of them

    def env(self) -> dict[str, str]:
        """The ranks' environment for this placement: DS_ACCELERATOR=cpu, or the GPUs they may see."""
        if self.accelerator == "cpu":
            return {"DS_ACCELERATOR": "cpu"}
        if not self.gpus:
            return {}
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")  # indices are relative to what this process already sees
        names = seen.split(",") if seen else [str(i) for i in range(max(self.gpus) + 1)]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in self.gpus)}


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


def too_many(requested: int, gpus: int) -> str:
    """One line: `requested` GPU ranks do not fit `gpus` GPUs, and the two ways that work."""
    return (f"--nproc {requested} asks for more GPU ranks than the {counted(gpus, 'GPU')} here (NCCL needs one GPU "
            f"per rank); use --nproc {gpus}, or set {CPU_HINT}")


def choose_world(requested: int, accelerator: str, gpus: int, *, exact: bool = False) -> Placement:
    """The ranks to use for `requested` on this accelerator and GPU count, with a one-line note.

    On GPUs, more ranks than GPUs become as many ranks as GPUs, or, with `exact` (a lesson that needs that very world
    size), `requested` CPU ranks. CPU (or no GPU) gives `requested` CPU ranks.
    """
    if accelerator != "cuda" or gpus < 1:
        why = "no GPU here" if accelerator == "cuda" else "CPU asked for"
        return Placement(requested, "cpu", f"{counted(requested, 'CPU rank')} (DS_ACCELERATOR=cpu, gloo): {why}")
    if requested <= gpus:
        return Placement(requested, "cuda", f"{counted(requested, 'GPU rank')}, one per GPU (NCCL), of the "
                                            f"{counted(gpus, 'GPU')} here")
    if exact:
        return Placement(requested, "cpu", f"{counted(requested, 'CPU rank')} (DS_ACCELERATOR=cpu, gloo): "
                                           f"{requested} ranks do not fit the {counted(gpus, 'GPU')} here, one rank "
                                           "per GPU (NCCL)")
    return Placement(gpus, "cuda", f"{counted(gpus, 'GPU rank')} instead of {requested}: NCCL needs one GPU per "
                                   f"rank and there are {gpus} here ({CPU_HINT})")


def node_placements(nnodes: int, nproc: int, accelerator: str, gpus: int) -> list[Placement]:
    """Simulated nodes on this machine: node k's ranks get GPUs k*nproc .. k*nproc+nproc-1, or all are CPU ranks.

    Every node's ranks start at LOCAL_RANK 0, so without their own `CUDA_VISIBLE_DEVICES` they would all take GPU 0.
    """
    need = nnodes * nproc
    if accelerator != "cuda" or gpus < need:
        note = (f"{counted(nnodes, 'node')} x {counted(nproc, 'CPU rank')} (DS_ACCELERATOR=cpu, gloo)"
                + (f": {need} ranks do not fit the {counted(gpus, 'GPU')} here, one per GPU"
                   if accelerator == "cuda" else ""))
        return [Placement(nproc, "cpu", note) for _ in range(nnodes)]
    ids = [tuple(range(k * nproc, (k + 1) * nproc)) for k in range(nnodes)]
    word = "GPUs" if nproc > 1 else "GPU"
    return [Placement(nproc, "cuda", f"node {k}: {word} {', '.join(map(str, ids[k]))}", ids[k]) for k in range(nnodes)]


def lesson_placement(world_sizes: list[int], accelerator: str, gpus: int) -> Placement:
    """Where every launch of one notebook runs: GPU ranks if its largest world size fits the GPUs, else CPU ranks.

    One choice for the whole notebook, so that the figures it compares were measured on the same kind of rank.
    """
    largest = max(world_sizes)
    return choose_world(largest, accelerator, gpus, exact=True)


def use_lesson_ranks(world_sizes: list[int], cpu_only: str = "") -> str:
    """Put this notebook's launches where `lesson_placement` says, or on CPU ranks whatever the GPUs when `cpu_only`
    says why (scripts that join gloo on CPU), and say so in one sentence.

    CPU ranks are chosen for the whole kernel by `DS_ACCELERATOR=cpu`, which `gpu_count`, and so every launch, reads.
    """
    accelerator, gpus = machine()
    where = lesson_placement(world_sizes, accelerator, gpus)
    named = [str(n) for n in sorted(set(world_sizes))]
    sizes = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
    if where.accelerator == "cuda" and not cpu_only:
        ranks = "rank" if named == ["1"] else "ranks"
        return f"Every launch runs GPU ranks, one per GPU (NCCL): {sizes} {ranks}, of the {counted(gpus, 'GPU')} here."
    os.environ["DS_ACCELERATOR"] = "cpu"
    if cpu_only:
        idle = f"the {counted(gpus, 'GPU')} here stay idle" if gpus else "there is no GPU here either"
        why = f"{cpu_only}; {idle}"
    elif gpus:
        why = f"{max(world_sizes)} ranks do not fit the {counted(gpus, 'GPU')} here (NCCL needs one GPU per rank)"
    else:
        why = "there is no GPU here"
    return f"Every launch runs CPU ranks (DS_ACCELERATOR=cpu, gloo), {sizes} of them per job: {why}."

def lesson_dtype(dtype: str) -> str:
    """The training dtype a notebook's `DTYPE` means here: "auto" is bf16 on GPU ranks, fp32 on CPU ranks (the
    worker's own `--dtype auto`); "fp32" and "bf16" are kept. Call it after `use_lesson_ranks`."""
    if dtype != "auto":
        return dtype
    return "bf16" if machine()[0] == "cuda" else "fp32"
