"""Notebooks 08 and 10 run CPU ranks whatever the GPUs: their scripts join gloo on CPU (lessons.own_model)."""

from __future__ import annotations

import os

import pytest

from zckpt_nb.lessons.own_model import use_cpu_ranks
from zckpt_nb.run.devices import gpu_count, lesson_dtype


@pytest.mark.fast
def test_use_cpu_ranks_puts_the_kernel_on_cpu_ranks_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    gpus = gpu_count()
    said = use_cpu_ranks([3, 2, 3], "the FSDP2 worker runs CPU ranks only")
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert said.startswith("Every launch runs CPU ranks (DS_ACCELERATOR=cpu, gloo), 2 and 3 of them per job: "
                           "the FSDP2 worker runs CPU ranks only; ")
    assert (f"the {gpus} GPU(s) here stay idle" in said) == bool(gpus)
    assert lesson_dtype("auto") == "fp32" and lesson_dtype("bf16") == "bf16"
