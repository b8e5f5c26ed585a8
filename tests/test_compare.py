"""`compare` and the widget: predicted against measured for every save mode, real 2-rank and 1-rank runs."""

import json
import subprocess
import sys
import time

import pytest
from conftest import procs_mentioning

from zckpt_nb.format.records import Route
from zckpt_nb.lessons.compare import RESULTS, compare
from zckpt_nb.plan.costs import predict
from zckpt_nb.ui.widgets import CompareWidget


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, compare([2], "tiny", list(Route), out)


def test_every_mode_has_a_record_per_rank(compared):
    _, records = compared
    saved = json.loads((compared[0] / RESULTS).read_text())
    assert {(r["mode"], r["rank"]) for r in saved} == {(m, 0) for m in Route} | {
        ("partitioned", 1), ("gathered16", 1), ("per_param", 1)}
    for r in records:
        for key in ("mode", "world_size", "rank", "predicted_bytes", "measured_bytes", "peak_memory_bytes",
                    "seconds", "predicted_comm_bytes", "logged_comm_bytes"):
            assert key in r
        assert r["peak_memory_bytes"] > 0 and r["seconds"] > 0
        if r["mode"] == "partitioned":  # the commit protocol: training waits until the save is durable
            assert r["save_mode"] == "commit" and r["stall_seconds"] >= r["durable_seconds"] > 0


def test_predicted_bytes_are_within_1_percent_of_measured_payloads(compared):
    for r in compared[1]:
        if r["predicted_bytes"]:
            assert abs(r["measured_payload_bytes"] / r["predicted_bytes"] - 1) <= 0.01, r
        else:
            assert r["measured_bytes"] == 0, r  # ranks other than 0 write nothing in the gathered modes


def test_predicted_collective_bytes_equal_the_comms_logger(compared):
    for r in compared[1]:
        assert r["logged_comm_bytes"] == r["predicted_comm_bytes"], r
    gathered = [r for r in compared[1] if r["mode"] == "gathered16"]
    assert all(r["logged_comm_bytes"] > r["measured_bytes"] / 2 for r in gathered if r["rank"] == 0)


def test_widget_runs_only_what_is_missing_and_redraws(compared):
    out, first = compared
    panel = CompareWidget(out, default_sizes=(2,))
    panel.sizes.value = (1, 2)
    panel.modes.value = tuple(Route)
    assert panel.pending() == [1]
    panel.button.click()  # runs in a background thread: the kernel stays free while ranks train
    panel.wait(timeout=600)
    assert not panel.running and not panel.button.disabled and panel.stop_button.disabled
    assert "failed" not in panel.status.value, panel.status.value
    assert {r["world_size"] for r in panel.records} == {1, 2}
    reused = [r for r in panel.records if r["world_size"] == 2]
    assert [r["seconds"] for r in reused] == [r["seconds"] for r in first]  # not measured again
    assert panel.pending() == []
    assert len(panel.figure.axes) == 4
    assert len(panel.summary) == len(panel.records) == 2 * len(first) - 3  # N=1 has one rank per in-training mode
    assert {(row["mode"], row["N"]) for row in panel.agreement} == {(m, n) for m in Route for n in (1, 2)}
    for row in panel.agreement:
        assert row["worst payload error (%)"] <= 1.0
        assert row["collective bytes: predicted = logged"] or (row["mode"], row["N"]) == ("gathered16", 1)
    # One rank: DeepSpeed leaves most parameters whole after the step, so save_16bit_model gathers only the ones it
    # had released; every module is still broadcast back from rank 0.
    (single,) = [r for r in panel.records if (r["mode"], r["world_size"]) == ("gathered16", 1)]
    pred = predict("tiny", 1).saves["gathered16"]
    assert pred.ops["broadcast"] <= single["logged_comm_bytes"] <= pred.comm_bytes


def test_widget_offers_any_world_size_and_adds_typed_ones(tmp_path):
    panel = CompareWidget(tmp_path, default_sizes=(3,), model="tiny", presets=("tiny", "small"))
    assert list(panel.sizes.options) == [1, 2, 3, 4] and panel.sizes.value == (3,)
    assert list(panel.model.options) == ["small", "tiny"]
    panel.new_size.value = 6
    panel.add_button.click()
    assert list(panel.sizes.options) == [1, 2, 3, 4, 6] and panel.sizes.value == (3, 6)
    assert list(CompareWidget(tmp_path, default_sizes=(2,), world_sizes=(8,)).sizes.options) == [2, 8]


def test_stop_kills_every_rank_and_keeps_what_was_measured(compared, tmp_path):
    out, first = compared
    (tmp_path / RESULTS).write_text((out / RESULTS).read_text())
    kept = (tmp_path / RESULTS).read_text()
    panel = CompareWidget(tmp_path, default_sizes=(2, 3), default_modes=("partitioned",), steps=100_000)
    started = time.monotonic()
    panel.button.click()
    assert time.monotonic() - started < 1 and panel.running  # the click returns at once; the job runs behind it
    deadline = time.monotonic() + 300
    while panel.progress.value < 1 and panel.running and time.monotonic() < deadline:
        time.sleep(0.5)  # wait for rank 0's first step: every rank is up and training
    assert panel.progress.value >= 1 and panel.progress.description == "N = 3", panel.status.value
    assert len(procs_mentioning(str(tmp_path))) >= 3  # torchrun and its 3 ranks
    panel.stop_button.click()
    panel.wait(timeout=60)
    assert not panel.running, "Stop did not end the job"
    assert "stopped" in panel.status.value and "N = [2]" in panel.status.value, panel.status.value
    assert procs_mentioning(str(tmp_path)) == []
    assert (tmp_path / RESULTS).read_text() == kept
    assert [r["seconds"] for r in panel.records] == [r["seconds"] for r in first if r["mode"] == "partitioned"]
    assert "N = [2, 3]" in panel.title.value and bytes(panel.chart.value).startswith(b"\x89PNG")


def test_compare_cli_refuses_bad_world_sizes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zckpt_nb", "compare", "--nproc", "0", "--output_dir",
                           str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--nproc values must be >= 1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_compare_command_prints_each_route_beside_its_prediction(tmp_path):
    out = tmp_path / "c"
    done = subprocess.run([sys.executable, "-m", "zckpt_nb", "compare", "--nproc", "1", "--routes", "partitioned",
                           "gathered16", "hf", "--output_dir", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from zckpt_nb.compare import load_records

    records = load_records(out)
    assert {(r.route, r.rank) for r in records} == {("partitioned", 0), ("gathered16", 0), ("hf", 0)}
    for r in records:
        assert abs(r.measured_payload_bytes / r.predicted_bytes - 1) <= 0.01, r
        assert r.route != "partitioned" or r.logged_comm_bytes == r.predicted_comm_bytes == 40
        assert f"{r.route:<11}" in done.stdout
    assert f"3 records in {out / 'compare.json'}" in done.stdout
