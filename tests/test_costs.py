"""The cost model: exact arithmetic on synthetic shapes, and agreement with real shards at N = 1 and 2."""

import json

import pytest
from conftest import cli

from zckpt_nb.convert.inspect import inspect_checkpoint
from zckpt_nb.format.sizes import fixed_tensor_bytes, padding, slice_numel
from zckpt_nb.model import param_count
from zckpt_nb.plan.costs import predict, tensor_numels
from zckpt_nb.run.launch import launch


def test_each_tensor_is_padded_to_a_multiple_of_n():
    assert slice_numel((10, 7), 4) == 3 + 2
    assert padding((10, 7), 4) == 4 * 5 - 17
    assert padding((12, 8), 4) == 0 and slice_numel((12, 8), 1) == 20


def test_prediction_reads_p_from_the_config():
    pred = predict("medium", 4, "bf16")
    assert pred.num_params == param_count("medium") == sum(tensor_numels("medium"))
    assert pred.saves["partitioned"].written_bytes == 12 * pred.slice_numel + fixed_tensor_bytes()
    gathered = pred.saves["gathered16"]
    assert gathered.memory[0].what == "full model on rank 0 (param dtype)" and gathered.memory[0].rank0_bytes == \
        2 * pred.num_params
    assert gathered.extra_peak_bytes(0) == sum(m.rank0_bytes for m in gathered.memory) > 2 * pred.num_params
    assert gathered.extra_peak_bytes(1) == sum(m.other_bytes for m in gathered.memory if m.on_device) > 0
    # lazy zero_to_fp32: one output shard (the whole model when under 5 GB) plus the largest tensor being joined
    biggest = max(tensor_numels("medium"))
    assert pred.saves["offline"].extra_peak_bytes(0) == 4 * pred.num_params + 4 * -(-biggest // 4) * 4
    # save_16bit_model meets GPT-2's tied wte twice (as wte and as lm_head); the per-parameter walk once
    wte = 8192 * 768
    assert gathered.ops["broadcast"] == 2 * (pred.num_params + wte)
    per_param = pred.saves["per_param"].ops["all_gather_into_tensor"]
    assert gathered.ops["all_gather_into_tensor"] == per_param + 2 * wte // 4
    assert pred.slice_numel * 4 == pred.num_params + pred.padding_numel


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    return launch(1, 5, tmp_path_factory.mktemp("n1"), save_checkpoint=True, verbose=False, progress=False)


@pytest.mark.parametrize("which", ["one_rank_run", "full_run"])
def test_predicted_partitioned_bytes_match_the_shards_within_1_percent(which, request):
    run = request.getfixturevalue(which)
    info = inspect_checkpoint(run.output_dir)
    pred = predict("tiny", info.world_size)
    assert info.world_size == run.world_size
    expected = pred.saves["partitioned"].written_bytes
    for shard in info.ranks:
        assert shard.partition_numel == pred.slice_numel
        assert abs(shard.payload_bytes - expected) <= 0.01 * expected
        assert shard.bytes > shard.payload_bytes  # the rest is the header (bounded by the save preflight)


def test_costs_cli_json_has_per_rank_bytes():
    done = cli("costs", "--model", "tiny", "--nproc", "3", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)["prediction"]
    assert data["world_size"] == 3 and data["saves"]["partitioned"]["written_bytes"] > 0
    gathered = data["saves"]["gathered16"]
    assert gathered["ops"]["all_gather_into_tensor"] > 0 and gathered["memory"][0]["rank0_bytes"] > 0
