"""`benchmarks/measured_routes.py` and its command `benchmarks/compare_world_sizes.py`: every save route measured in
real 2-rank and 1-rank runs, beside the cost model's prediction."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zckpt_nb.format.records import Route
from zckpt_nb.plan.costs import predict

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from measured_routes import RESULTS, compare, load_records, select  # noqa: E402


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, compare([2], "tiny", list(Route), out, verbose=False, progress=False)


def test_every_route_has_a_record_per_rank(compared):
    out, records = compared
    saved = json.loads((out / RESULTS).read_text())
    assert {(r["route"], r["rank"]) for r in saved} == {(m, 0) for m in Route} | {
        ("partitioned", 1), ("gathered16", 1), ("per_param", 1)}
    assert select(load_records(out), "tiny", [2], list(Route)) == records  # the file reads back as written
    for r in records:
        assert r.peak_rss_bytes > 0 and r.seconds > 0
        if r.route == "partitioned":  # the commit protocol: training waits until the save is durable
            assert r.stall_seconds >= r.durable_seconds > 0


def test_predicted_bytes_are_within_1_percent_of_measured_payloads(compared):
    for r in compared[1]:
        if r.predicted_bytes:
            assert abs(r.measured_payload_bytes / r.predicted_bytes - 1) <= 0.01, r
        else:
            assert r.measured_bytes == 0, r  # ranks other than 0 write nothing in the gathered routes


def test_predicted_collective_bytes_equal_the_comms_logger(compared):
    for r in compared[1]:
        assert r.logged_comm_bytes == r.predicted_comm_bytes, r
    gathered = [r for r in compared[1] if r.route == "gathered16"]
    assert all(r.logged_comm_bytes > r.measured_bytes / 2 for r in gathered if r.rank == 0)


def test_what_was_measured_is_reused_and_a_new_world_size_measured(compared, tmp_path):
    out, first = compared
    (tmp_path / RESULTS).write_text((out / RESULTS).read_text())
    again = compare([2], "tiny", list(Route), tmp_path, verbose=False, progress=False)
    assert [r.seconds for r in again] == [r.seconds for r in first]  # not measured again


def test_compare_cli_refuses_bad_world_sizes(tmp_path):
    done = subprocess.run([sys.executable, BENCHMARKS / "compare_world_sizes.py", "--nproc", "0", "--output_dir",
                           str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "--nproc values must be >= 1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_compare_command_prints_each_route_beside_its_prediction(tmp_path):
    out = tmp_path / "c"
    done = subprocess.run([sys.executable, BENCHMARKS / "compare_world_sizes.py", "--nproc", "1", "--routes",
                           "partitioned", "gathered16", "hf", "--output_dir", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = load_records(out)
    assert {(r.route, r.rank) for r in records} == {("partitioned", 0), ("gathered16", 0), ("hf", 0)}
    for r in records:
        assert abs(r.measured_payload_bytes / r.predicted_bytes - 1) <= 0.01, r
        assert r.route != "partitioned" or r.logged_comm_bytes == r.predicted_comm_bytes == 40
        assert f"{r.route:<11}" in done.stdout
    assert f"3 records in {out / 'compare.json'}" in done.stdout
    # One rank: DeepSpeed leaves most parameters whole after the step, so save_16bit_model gathers only the ones it
    # had released; every module is still broadcast back from rank 0.
    (single,) = [r for r in records if r.route == "gathered16"]
    pred = predict("tiny", 1).saves["gathered16"]
    assert pred.ops["broadcast"] <= single.logged_comm_bytes <= pred.comm_bytes
