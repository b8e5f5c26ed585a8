"""What changes on a GPU cluster (zckpt_nb.plan.cluster), and the calibration's readable table: arithmetic on the
shipped configs and records, checked against the plan it is computed from."""

from __future__ import annotations

import csv
import math

import pytest
import torch.distributed.constants as torch_constants

from zckpt_nb.plan.calibration import (
    as_factor,
    calibration,
    calibration_table,
    constants_table,
    machine_constants,
    measured_records,
    misfit,
    save_calibration,
)
from zckpt_nb.plan.cluster import (
    default_timeouts,
    filesystem_rows,
    filesystem_sentence,
    filesystem_table,
    gather_waits,
    pinned_bytes,
    pinned_rows,
    pinned_sentence,
    pinned_table,
    slowest_write_within,
    timeout_answer,
    timeout_sentence,
)
from zckpt_nb.plan.costs import predict
from zckpt_nb.plan.planning import Bandwidths

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 1024, 1025, 3 * 2**30 + 7])
def test_pinned_bytes_are_the_next_power_of_two(n):
    reserved = pinned_bytes(n)
    assert reserved >= n and reserved == 2 ** math.ceil(math.log2(n)) and reserved < 2 * n


def test_pinned_rows_hold_the_ranks_fp32_master_and_adam_moments():
    rows = pinned_rows("llama-3-8b", [8, 24], "bf16")
    for row in rows:
        pred = predict("llama-3-8b", row["N"], "bf16")
        assert row["shard MiB"] * 2**20 == pred.master_bytes + pred.optimizer_bytes == 12 * pred.slice_numel
        assert row["shard MiB"] <= row["pinned MiB"] < 2 * row["shard MiB"]
    assert rows[0]["rounding"] != rows[1]["rounding"]
    assert f"N = {max(rows, key=lambda r: r['rounding'])['N']}" in pinned_sentence(rows, 8)


def test_default_timeouts_are_read_from_torch_and_deepspeed():
    found = default_timeouts()
    assert found["torch, other backends"] == torch_constants.default_pg_timeout.total_seconds()
    assert all(v > 0 for v in found.values())


def test_rank_0_write_of_a_gathered_save_trips_the_timeout_only_when_slow():
    fast, slow = Bandwidths(2.0, 2.0, 25.0), Bandwidths(0.05, 2.0, 25.0)
    quick, long = gather_waits("llama-3-70b", 64, fast), gather_waits("llama-3-70b", 64, slow)
    assert long["rank 0 write s"] == pytest.approx(quick["rank 0 write s"] * 40)
    assert quick["rank 0 write s"] == pytest.approx(predict("llama-3-70b", 64, "bf16").gathered["written_bytes"] / 2e9)
    assert quick["longest call s"] < quick["collectives s"]
    timeouts = {"short": 600.0, "long": 1800.0}
    assert "no default timeout fires" in timeout_sentence("llama-3-70b", 64, quick, timeouts)
    assert "over the default of short (600 s), long (1800 s)" in timeout_sentence("llama-3-70b", 64, long, timeouts)


def test_a_shared_filesystem_cap_sets_the_save_time_once_the_nodes_exceed_it():
    rows = filesystem_rows("llama-3-8b", [1, 8, 64], 8, node_gbps=10.0, cap_gbps=200.0)
    assert [r["aggregate GB/s"] for r in rows] == [10.0, 80.0, 200.0]
    assert rows[0]["capped s"] == rows[0]["uncapped s"] and rows[2]["capped s"] > rows[2]["uncapped s"]
    assert rows[2]["capped s"] == pytest.approx(rows[2]["save GiB"] * 2**30 / 200e9)
    assert filesystem_sentence(rows, 200.0).startswith("From 64 nodes on")
    assert "below the filesystem" in filesystem_sentence(rows[:2], 200.0)


def test_calibration_table_is_readable_and_the_file_holds_every_save(tmp_path):
    rows = calibration(measured_records(), Bandwidths(0.5, 2.0, 0.5))
    shown = calibration_table(rows, 5)
    assert len(shown) == 5 and len(shown[0]) <= 8
    factors = [float(r["fitted, miss"].split("x")[0]) for r in shown]  # '1.43x under' before '1.32x over'
    assert factors == sorted(factors, reverse=True)
    assert (as_factor(-0.9), as_factor(1.83)) == ("10.0x under", "2.8x over") and misfit(-0.9) > misfit(1.83)
    with save_calibration(rows, tmp_path / "calibration.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    constants = constants_table(machine_constants(rows))
    assert len(constants[0]) == 1 + len({r["machine"] for r in rows})


def test_the_timeout_answer_names_the_bandwidth_where_the_write_outlasts_the_default():
    floor = slowest_write_within("llama-3-8b", 64, 600.0)
    assert gather_waits("llama-3-8b", 64, Bandwidths(floor, 2.0, 25.0))["rank 0 write s"] == pytest.approx(600.0)
    timeouts = {"torch, NCCL": 600.0, "torch, other backends": 1800.0}
    assert timeout_answer("llama-3-8b", 64, floor * 0.9, timeouts).endswith("trips it.")
    assert timeout_answer("llama-3-8b", 64, floor * 1.1, timeouts).endswith("stays within it.")
    assert "At the exercise's 0.02 GB/s the write would take" in timeout_answer("llama-3-8b", 64, 2.0, timeouts)
    assert "At the default 2 GB/s the write would take" in timeout_answer("llama-3-8b", 64, 0.02, timeouts)
    assert len(filesystem_table(filesystem_rows("gpt2-xl", [1, 2], 8, 5.0, 8.0))[0]) <= 8
    assert pinned_table(pinned_rows("gpt2-xl", [3]))[0]["rounding adds"].endswith("%")
