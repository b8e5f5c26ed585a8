"""Memory by kind: host RSS, host heap, CUDA allocated and pinned host bytes are separate figures of every save, and
the cost model is compared only with the kind it predicts."""

import json
import sys
from pathlib import Path

import pytest

from zckpt_nb.measure.meters import measure
from zckpt_nb.plan.costs import predict
from zckpt_nb.run.launch import launch
from zckpt_nb.saving import snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from measured_routes import record  # noqa: E402  (benchmarks/measured_routes.py)


@pytest.mark.fast
def test_a_cpu_save_records_host_rss_and_heap_and_no_cuda_figures():
    held = []
    cost = measure("partitioned", lambda: held.append(bytearray(64 * 2**20)), written=list)
    assert cost.heap_extra_peak_bytes >= 64 * 2**20  # the host heap saw the allocation
    assert cost.peak_memory_bytes >= cost.extra_peak_bytes > 0  # host RSS, its own figure
    assert cost.cuda_peak_bytes is None and cost.cuda_extra_peak_bytes is None and cost.pinned_host_bytes is None


def _record(mode, rank, heap, device, dtype, cuda=None):
    """The compare record of one route's cost on `rank`, as a run on `device` would have measured it."""
    run = {"model": "tiny", "world_size": 2, "dtype": dtype, "persistence_threshold": 0, "device": device}
    cost = {"mode": mode, "rank": rank, "extra_peak_bytes": 3 * heap, "heap_extra_peak_bytes": heap,
            "cuda_extra_peak_bytes": cuda, "pinned_host_bytes": None, "files": [], "bytes_written": 0,
            "comm_bytes": 0, "comm_ops": {}, "peak_memory_bytes": 4 * heap, "seconds": 0.1}
    return record(run, cost, {})


@pytest.mark.fast
def test_on_cpu_ranks_every_term_is_host_memory():
    pred = predict("tiny", 2, "fp32")
    row = _record("gathered16", 0, 10, "cpu", "fp32")
    assert row.predicted_extra_peak_bytes == pred.saves["gathered16"].extra_peak_bytes(0)
    assert row.measured_extra_peak_bytes == 10 and row.measured_memory_kind == "host heap"
    assert row.predicted_cuda_extra_peak_bytes is None


@pytest.mark.fast
def test_on_gpu_ranks_gather_buffers_are_compared_with_cuda_allocated_only():
    pred = predict("tiny", 2, "bf16")
    full, buffers = (m.rank0_bytes for m in pred.saves["gathered16"].memory)
    row = _record("gathered16", 0, 10, "cuda:0", "bf16", cuda=buffers)
    assert row.predicted_extra_peak_bytes == full  # host: rank 0's copy
    assert row.predicted_cuda_extra_peak_bytes == row.measured_cuda_extra_peak_bytes == buffers
    assert row.measured_extra_peak_bytes == 10  # the heap, never CUDA bytes
    offline = _record("offline", 0, 10, "cuda:0", "bf16")  # one CPU process on any machine
    assert offline.predicted_cuda_extra_peak_bytes is None


@pytest.mark.fast
def test_a_cpu_snapshot_pins_nothing():
    import torch

    state = {"w": torch.zeros(4), "opt": [torch.ones(2)]}
    assert not snapshot.pins(state)


def test_every_rank_records_each_memory_kind_of_each_save(tmp_path):
    """Two CPU ranks, two saves (one asynchronous): every save cost and rank record holds each kind on its own."""
    run = launch(2, 4, tmp_path / "run", save_every=2, save_mode="async", verbose=False, progress=False, timeout=300)
    costs = run.save_costs
    assert {c["rank"] for c in costs} == {0, 1} and len(costs) == 4
    for c in costs:
        assert c["peak_memory_bytes"] > 50 * 2**20 and c["heap_extra_peak_bytes"] is not None
        assert (c["cuda_peak_bytes"], c["cuda_extra_peak_bytes"], c["pinned_host_bytes"]) == (None, None, None)
    for rank in run.ranks:
        assert rank["peak_memory_bytes"] > 50 * 2**20 and rank["cuda_peak_bytes"] is None
        assert all(s["snapshot_bytes"] > 0 and s["pinned_bytes"] is None for s in rank["saves"])
    assert json.loads((tmp_path / "run" / "run.json").read_text())["ranks"][0]["pinned_host_bytes"] is None
