"""What the notebooks teach, as checks: every verdict follows the data, every failure they name really happens.

Real 2-rank ZeRO-3 runs on CPU; the claims are fed data that must flip them.
"""

from __future__ import annotations

import pytest

from zckpt_nb.errors import LaunchError
from zckpt_nb.examples import faults
from zckpt_nb.format.layout import RANK_FILE, latest_name
from zckpt_nb.format.sizes import exact_ratio
from zckpt_nb.plan.costs import persistent, predict, tensor_numels
from zckpt_nb.run.launch import launch
from zckpt_nb.run.logs import rank_lines


def deepspeed_persistence_default() -> int:
    """DeepSpeed's own default for `stage3_param_persistence_threshold`, read from its config model."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return int(DeepSpeedZeroConfig.model_fields["param_persistence_threshold"].default)


def test_exact_ratio_and_persistent_tensors():
    assert exact_ratio(426_048, 3) == "142,016" and exact_ratio(10, 3) == "3 1/3"
    assert persistent((5, 100, 100_001), 100_000) == (5, 100) and persistent((5,), 0) == ()
    assert deepspeed_persistence_default() == 100_000
    one, two = predict("tiny", 1, persistence_threshold=10**5), predict("tiny", 2, persistence_threshold=10**5)
    assert one.regather_bytes == 0  # one rank has nothing to gather
    kept = persistent(tensor_numels("tiny"), 10**5)
    assert 0 < len(kept) < two.num_tensors  # tiny's embedding is above DeepSpeed's default threshold, the rest below
    assert two.held_numel == two.slice_numel + sum(kept) and two.persistent_tensors == len(kept)
    assert predict("tiny", 3).padding_numel > 0  # what notebook 01 shows at N = 3


@pytest.fixture(scope="module")
def persistent_run(tmp_path_factory):
    """DeepSpeed's default threshold: every tensor of tiny stays whole on both ranks."""
    return launch(2, 3, tmp_path_factory.mktemp("persist"), save_checkpoint=True, verbose=False, progress=False,
                  persistence_threshold=deepspeed_persistence_default())


def test_persistence_threshold_changes_what_ranks_hold_and_what_a_save_gathers(persistent_run, full_run):
    pred = predict("tiny", 2, persistence_threshold=deepspeed_persistence_default())
    for r in persistent_run.ranks:
        assert r["held"]["owned"] + r["held"]["persistent"] == pred.held_numel > persistent_run.num_params
    for r in full_run.ranks:
        assert r["held"] == {"owned": predict("tiny", 2).slice_numel, "persistent_tensors": 0, "persistent": 0}
    for c in persistent_run.save_costs:
        assert c["comm_bytes"] == pred.saves["partitioned"].comm_bytes  # tag check + every tensor re-gathered
        assert c["comm_ops"]["all_gather_into_tensor"]["count"] == pred.persistent_tensors
    held = [line for line in persistent_run.log if "persistent tensors kept whole" in line]
    assert len(held) == 2 and f"holds {pred.held_numel:,} parameter elements" in held[0]


def test_save_16bit_with_the_gather_flag_off_writes_nothing_and_says_so(tmp_path):
    run = launch(2, 2, tmp_path, verbose=False, progress=False, save_16bit=True, gather_16bit="off")
    lines = [line for found in rank_lines(tmp_path, last=100).values() for line in found]
    assert sum("save_16bit_model returned False and wrote nothing" in line for line in lines) == 2
    assert not list((tmp_path / "gathered16").glob("*"))
    assert {c["bytes_written"] for c in run.save_costs if c["mode"] == "gathered16"} == {0}


def test_deepspeeds_plain_save_moves_latest_before_every_shard_exists(tmp_path):
    with faults.injected("shards:1:4:2"), pytest.raises(LaunchError):
        launch(2, 8, tmp_path, save_every=4, verbose=False, progress=False, save_mode="plain",
               worker="zckpt_nb.examples.faults")
    tag = latest_name(tmp_path)
    assert tag == "global_step4"
    found = {m.group(1, 2) for p in (tmp_path / tag).iterdir() if (m := RANK_FILE.search(p.name))}
    assert ("1", "model") in found and ("1", "optim") not in found  # latest names a checkpoint missing a shard
