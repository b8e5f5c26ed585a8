"""Notebooks 01-03's exercise answers speak of the parameter the learner changed: the changed run's figure against
the default's, and a pointer to the exercise when the run used the default."""

from __future__ import annotations

import pytest

from zckpt_nb.convert.inspect import CheckpointInfo, RankShard
from zckpt_nb.lessons import minimal, partitions
from zckpt_nb.plan.costs import predict

pytestmark = pytest.mark.fast
P = predict("tiny", 1).num_params


def info(n: int, optim_name: str = "zero_pp_rank_{r}_mp_rank_00_optim_states.pt") -> CheckpointInfo:
    """A checkpoint of preset tiny on `n` ranks, slices as the cost model gives them (exact in notebook 01)."""
    s = predict("tiny", n).slice_numel
    ranks = [RankShard(r, {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt": 25_000,
                           optim_name.format(r=r): 12 * s + 2_000}, s, 2 * s, 12 * s) for r in range(n)]
    return CheckpointInfo("ckpt", "global_step2", n, P, 28, ranks)


def row(n: int, threshold: int, held: int, files: int, persistent: int = 0) -> dict:
    """One run's figures as `claims.partition_row` gives them."""
    return {"N": n, "threshold": threshold, "P": P, "held per rank": held, "persistent per rank": persistent,
            "shard bytes per rank": files, "save collective bytes per rank": 40,
            "save collective ops": "2 x all_reduce"}


def test_padding_answer_compares_the_changed_world_size_with_the_default():
    changed = partitions.padding_answer([info(2), info(3)], "tiny", default_n=2)
    pad = 3 * predict("tiny", 3).slice_numel - P
    assert "At N = 3" in changed and f"{pad:,} padding elements in all" in changed and "default's N = 2" in changed
    assert f"added {pad:,} padding elements" in changed
    default = partitions.padding_answer([info(1), info(2)], "tiny", default_n=2)
    assert "At N = 2" in default and "set `WORLD_SIZES = [2, 3]`" in default
    assert f"{predict('tiny', 3).padding_numel:,} padding elements in all: set" in default


def test_threshold_answer_compares_with_the_default_threshold_measured_or_predicted():
    base, big = row(2, 0, P // 2, 2_585_449), row(2, 100_000, 524_384, 2_585_449, 311_360)
    measured = partitions.threshold_answer([big], [base, big], "tiny", "fp32")
    assert f"against {P // 2:,} at threshold 0 (measured)" in measured and "stayed at 2.47 MiB" in measured
    predicted = partitions.threshold_answer([big], [big], "tiny", "fp32")
    assert "(the cost model)" in predicted
    at_default = partitions.threshold_answer([base], [base, big], "tiny", "fp32")
    held = predict("tiny", 2, persistence_threshold=partitions.EXERCISE_THRESHOLD).held_numel
    assert "With `PERSISTENCE_THRESHOLD = 10_000`" in at_default
    assert f"{held:,} elements per rank (this run: {P // 2:,})" in at_default


def test_dtype_answer_names_the_other_dtypes_file():
    fp32 = partitions.dtype_answer(info(2), "fp32", "tiny", 0)
    assert "In bf16 it would write `bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt`" in fp32
    assert 'Set `DTYPE = "bf16"`' in fp32
    bf16 = partitions.dtype_answer(info(2, "bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), "bf16", "tiny", 0,
                                   "cuda")
    assert "In fp32 it would write `zero_pp_rank_1_mp_rank_00_optim_states.pt`" in bf16
    assert "trained in fp32 on CPU ranks" in fp32 and "trained in bf16 on GPU ranks" in bf16  # the placement's


def test_comm_verdict_names_the_tag_check_and_the_regather():
    plain = partitions.comm_verdict([row(2, 0, 1, 1)])
    assert plain.startswith("imprecise") and "40 B per rank" in plain and "all-gathers" not in plain
    gathered = {**row(2, 100_000, 1, 1), "save collective bytes per rank": 622_760,
                "save collective ops": "2 x all_reduce, 27 x all_gather_into_tensor"}
    assert "622,760 B per rank at threshold 100,000" in partitions.comm_verdict([row(2, 0, 1, 1), gathered])
    assert partitions.comm_verdict([{**row(1, 0, 1, 1), "save collective bytes per rank": 0}]).startswith("true")


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
