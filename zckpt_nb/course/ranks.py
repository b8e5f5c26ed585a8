"""Where a notebook's jobs run: GPU ranks when the lesson's world sizes fit this machine's GPUs, else CPU ranks,
the same for every launch of the notebook, said in one sentence."""

from __future__ import annotations

import os

from zckpt_nb.format.units import counted
from zckpt_nb.run.devices import CPU_HINT, Placement, machine


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
