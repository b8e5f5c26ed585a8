"""The FSDP2 worker's `--dtype bf16`: bf16 compute over fp32 masters, continuing a bf16 ZeRO-3 run through DCP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zckpt_nb.convert.dcp import to_dcp
from zckpt_nb.run.launch import RunResult, launch

STEPS, SWITCH = 4, 2  # ZeRO-3 (bf16) to step SWITCH, then the FSDP2 worker on 2 CPU ranks to STEPS
TAG = f"global_step{SWITCH}"
BF16_TOLERANCE = 0.05  # a bf16 loss summed in another order (other ranks, FSDP2's reduce-scatter): notebook 10's


def tensor_dtypes(dcp_dir: Path) -> set[torch.dtype]:
    """The dtypes of a DCP checkpoint's weights and Adam moments (its `step` counters left out), read from its
    `.metadata` alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items()
    return {meta.properties.dtype for name, meta in entries if isinstance(meta, TensorStorageMetadata)
            and name.split(".")[0] in ("model", "optimizer") and not name.endswith(".step")}


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """The uninterrupted bf16 ZeRO-3 run on 2 ranks, and FSDP2 in bf16 and in fp32 resumed from its converted save."""
    root = tmp_path_factory.mktemp("fsdp_bf16")
    base = launch(2, STEPS, root / "zero3", save_every=SWITCH, dtype="bf16", verbose=False, progress=False,
                  timeout=600)
    runs = {"zero3": base}
    for dtype in ("bf16", "fp32"):
        to_dcp(base.output_dir, root / dtype / TAG, TAG)
        runs[dtype] = launch(2, STEPS, root / dtype, resume=True, save_checkpoint=True, worker="zckpt_nb.train_fsdp",
                             dtype=dtype, verbose=False, progress=False, timeout=600)
    return runs


def test_fsdp2_bf16_continues_the_bf16_zero3_run_and_saves_fp32_masters(legs: dict[str, RunResult]) -> None:
    base, bf16 = legs["zero3"], legs["bf16"]
    assert bf16.dtype == "bf16" and bf16.steps == list(range(SWITCH, STEPS)) and bf16.world_size == 2
    gaps = [abs(a - b) for a, b in zip(bf16.losses, base.losses[SWITCH:])]
    assert max(gaps) < BF16_TOLERANCE, gaps
    assert tensor_dtypes(bf16.output_dir / f"global_step{STEPS}") == {torch.float32}


def test_fsdp2_bf16_computes_in_bf16(legs: dict[str, RunResult]) -> None:
    """Same checkpoint, same data: only the compute dtype differs, so the losses must differ (bf16 rounds)."""
    assert legs["fp32"].dtype == "fp32"
    assert legs["bf16"].losses != legs["fp32"].losses
    assert tensor_dtypes(legs["fp32"].output_dir / f"global_step{STEPS}") == {torch.float32}
