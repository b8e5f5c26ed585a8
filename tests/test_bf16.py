"""bf16 on CPU ranks (much of the GPU path): train, save, verify, resume on the same and another world size, export."""

from __future__ import annotations

import math

import pytest
from conftest import file_hashes
from weights import load_weights

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.convert.export import export
from zckpt_nb.convert.verify import verify
from zckpt_nb.run.launch import launch

BF16 = {"dtype": "bf16"}


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    return launch(2, 6, tmp_path_factory.mktemp("bf16"), save_every=3, **BF16, verbose=False, progress=False,
                  timeout=600)


def test_bf16_trains_from_initialised_weights_and_saves_deepspeeds_bf16_files(bf16_run):
    assert bf16_run.dtype == "bf16" and bf16_run.ds_config["bf16"]["enabled"]
    assert abs(bf16_run.losses[0] - math.log(bf16_run.vocab_size)) < 0.15 * math.log(bf16_run.vocab_size)
    names = sorted(e.path for e in verify(bf16_run.output_dir).files)
    assert names == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + \
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)]


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_resumes_weights_only_on_the_same_and_another_world_size(bf16_run, tmp_path, world):
    folder = copy_checkpoint(bf16_run.output_dir, tmp_path / "ckpt", "global_step3")
    run = launch(world, 6, folder, resume=True, **BF16, verbose=False, progress=False, timeout=600)
    assert run.resumed_from_step == 3 and (run.resharded is not None) == (world != 2)
    worst = max(abs(a - b) for a, b in zip(bf16_run.losses[3:], run.losses, strict=True))
    assert worst <= (0 if world == 2 else 0.05), worst  # bf16 sums in another order differ in the 3rd digit


def test_bf16_export_holds_the_fp32_master_weights(bf16_run, tmp_path):
    weights = load_weights(export(bf16_run.output_dir, tmp_path / "hf"))
    assert {str(t.dtype) for t in weights.values()} == {"torch.float32"}
    assert sum(t.numel() for t in weights.values()) == bf16_run.num_params  # lm_head is tied to wte: stored once


def test_bf16_async_saves_write_the_committed_saves_files_byte_for_byte(bf16_run, tmp_path):
    """The asynchronous snapshot copies bf16 parameters and fp32 masters alike: same files, same SHA-256."""
    run = launch(2, 6, tmp_path / "async", save_every=3, **BF16, save_mode="async", verbose=False,
                 progress=False, timeout=600)
    assert run.losses == bf16_run.losses and run.failed_saves == []
    for tag in ("global_step3", "global_step6"):
        mine = file_hashes(run.output_dir, tag)
        assert len(mine) == 4 and mine == file_hashes(bf16_run.output_dir, tag), tag
