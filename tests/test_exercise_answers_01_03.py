"""Notebooks 02-03's exercise answers speak of the parameter the learner changed: the changed run's figure against
the default's, and a pointer to the exercise when the run used the default."""

from __future__ import annotations

import pytest

from zckpt_nb.convert.inspect import CheckpointInfo, RankShard
from zckpt_nb.lessons import minimal
from zckpt_nb.plan.costs import predict

pytestmark = pytest.mark.fast
P = predict("tiny", 1).num_params


def info(n: int, optim_name: str = "zero_pp_rank_{r}_mp_rank_00_optim_states.pt") -> CheckpointInfo:
    """A checkpoint of preset tiny on `n` ranks, slices as the cost model gives them (exact in notebook 01)."""
    s = predict("tiny", n).slice_numel
    ranks = [RankShard(r, {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 25_000,
                           optim_name.format(r=r): 12 * s + 2_000}, s, 2 * s, 12 * s) for r in range(n)]
    return CheckpointInfo("ckpt", "global_step2", n, P, 28, ranks)


def test_shard_answer_compares_with_the_default_world_size():
    changed = minimal.shard_answer(info(3), default_nproc=2)
    assert "At N = 3" in changed and "At the default N = 2" in changed and f"{P / 2 * 12 / 2**20:.3f} MiB" in changed
    default = minimal.shard_answer(info(2), default_nproc=2)
    assert "set `NPROC = 3`" in default
    shard = info(2).ranks[0]  # the tensor data and the whole files, each said once (every rank's are equal here)
    data, files = shard.payload_bytes / 2**20, shard.bytes / 2**20
    assert f"{data:.3f} MiB of tensor data ({files:.3f} MiB with headers)" in default


def test_resume_verdict_holds_a_bf16_resume_to_its_stated_tolerance():
    full = {1: 6.5, 2: 6.25, 3: 6.0}
    assert "within the 0.05" in minimal.resume_sentence(full, {2: 6.26, 3: 6.0}, "bf16")
    assert "outside the 0.0001" in minimal.resume_sentence(full, {2: 6.26, 3: 6.0}, "fp32")


def test_step_lrs_reads_the_lr_when_rank_0_printed_it():
    log = ["[rank 0] step 1 loss 6.5 lr 0.0015", "[rank 0] step 2 loss 6.25 lr 0.003", "[rank 0] step 3 loss 6.0"]
    assert minimal.step_lrs(log) == {1: 0.0015, 2: 0.003}
    assert minimal.step_losses(log) == {1: 6.5, 2: 6.25, 3: 6.0}
