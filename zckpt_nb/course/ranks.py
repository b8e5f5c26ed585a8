"""Where a notebook's jobs run: GPU ranks when the lesson's world sizes fit this machine's GPUs, else CPU ranks,
the same for every launch of the notebook."""

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


def use_lesson_ranks(world_sizes: list[int], cpu_only: bool = False) -> str:
    """The accelerator of this notebook's launches: "cuda" if its largest world size fits this machine's GPUs and
    not `cpu_only`, else "cpu", which it sets for the whole kernel (DS_ACCELERATOR=cpu, read by every launch)."""
    accelerator, gpus = machine()
    if lesson_placement(world_sizes, accelerator, gpus).accelerator == "cuda" and not cpu_only:
        return "cuda"
    os.environ["DS_ACCELERATOR"] = "cpu"
    return "cpu"


def lesson_dtype(dtype: str) -> str:
    """The training dtype a notebook's `DTYPE` means here: "auto" is bf16 on GPU ranks, fp32 on CPU ranks (the
    worker's own `--dtype auto`); "fp32" and "bf16" are kept. Call it after `use_lesson_ranks`."""
    if dtype != "auto":
        return dtype
    return "bf16" if machine()[0] == "cuda" else "fp32"
