"""`--save_mode async`: snapshot, background write, commit at a later step. Real 2-rank ZeRO-3 runs on CPU."""

from pathlib import Path

import pytest
from conftest import file_hashes
from test_commit import FAULTS, failed_launch, ref_run, run, same_losses, small_disk, verify_cli  # noqa: F401

from zckpt_nb.convert.zero_to_fp32 import run_zero_to_fp32
from zckpt_nb.format.layout import committed_tags, latest_name

ASYNC = {"save_mode": "async"}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """An uninterrupted tiny run saving asynchronously every 4 of 12 steps, keeping the last 2 checkpoints."""
    return run(tmp_path_factory.mktemp("async"), **ASYNC, keep_last=2)


def test_every_async_save_commits_and_records_its_stall_and_time_to_durable(async_run):
    out = async_run.output_dir
    assert committed_tags(out) == ["global_step8", "global_step12"]  # rotation followed each commit
    assert [s["deleted"] for s in async_run.ranks[0]["saves"]] == [[], [], ["global_step4"]]
    assert latest_name(out) == "global_step12" and verify_cli(out).returncode == 0
    assert async_run.save_mode == "async" and async_run.failed_saves == []
    for rank in async_run.ranks:
        for save in rank["saves"]:
            assert save["committed"] and save["error"] is None
            # training resumed after the snapshot; the commit came at a later step boundary (or the run's end)
            assert 0 < save["stall_seconds"] < save["durable_seconds"]
            assert save["snapshot_bytes"] >= save["estimated_bytes"] * 0.95
            assert {"snapshot", "write", "fsync", "hash", "protocol"} <= set(save["timings"])
    for cost in async_run.save_costs:  # the files the background write put on disk, not the call's
        shards = [Path(f) for f in cost["files"] if "zero_pp_rank" in f]
        assert len(shards) == 2
        if shards[0].parent.name != "global_step4":  # rotated away since
            assert cost["bytes_written"] >= sum(f.stat().st_size for f in shards)


def test_deepspeeds_zero_to_fp32_reads_an_async_checkpoint(async_run, tmp_path):
    import torch

    converted = run_zero_to_fp32(async_run.output_dir, tmp_path / "fp32")
    state = torch.load(converted / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert sum({t.data_ptr(): t.numel() for t in state.values()}.values()) == async_run.num_params


def test_kill_9_during_the_background_write_keeps_the_previous_commit(async_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("ZCKPT_FAULT", "background:1:8")  # rank 1 dies between its two files of the step-8 save
    text = failed_launch(out, **ASYNC, worker=FAULTS)
    assert "rank 1 injects 'background'" in text
    monkeypatch.delenv("ZCKPT_FAULT")
    assert latest_name(out) == "global_step4" and verify_cli(out).returncode == 0
    assert "global_step8" not in committed_tags(out)
    resumed = run(out, resume=True, **ASYNC)  # DeepSpeed's load_checkpoint reads the async checkpoint
    assert resumed.resumed_from_step == 4 and resumed.steps == list(range(4, 12))
    assert same_losses(async_run, resumed) <= 1e-5
    assert latest_name(out) == "global_step12" and verify_cli(out).returncode == 0


def test_a_full_disk_during_the_background_write_fails_that_save_on_every_rank(tmp_path, monkeypatch):
    with small_disk(tmp_path / "disk", "size=24m") as disk:
        out = disk / "run"
        monkeypatch.setenv("ZCKPT_FAULT", "fill:0:8")  # a neighbour fills the disk once the step-8 save has begun
        result = run(out, **ASYNC, worker=FAULTS)
        assert result.steps == list(range(12)), "training went on after the failed save"
        assert [f["step"] for f in result.failed_saves] == [8]
        assert "ENOSPC" in result.failed_saves[0]["error"]
        assert not (out / "global_step8").exists(), "the failed save's partial files are removed"
        assert committed_tags(out) == ["global_step4", "global_step12"] and verify_cli(out).returncode == 0
        printed = [line for line in result.log if "save global_step8 failed" in line]
        assert len(printed) == 2 and all("training continues" in line for line in printed)  # one line per rank


def test_async_files_are_byte_for_byte_those_of_the_committed_save(async_run, request):
    """The snapshot is a copy of DeepSpeed's state dicts, serialised later: the same files as the synchronous save."""
    committed = request.getfixturevalue("ref_run")  # test_commit's run: same seed and schedule, --save_mode commit
    for tag in ("global_step8", "global_step12"):
        mine = file_hashes(async_run.output_dir, tag)
        assert len(mine) >= 4 and mine == file_hashes(committed.output_dir, tag), tag
