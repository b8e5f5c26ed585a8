"""DeepSpeed's own checkpoint engines as save modes under torchrun: real 2-rank runs, what they write, their stall."""

import sys
from pathlib import Path

import pytest

from zckpt_nb.errors import LaunchError
from zckpt_nb.format.layout import latest_name
from zckpt_nb.run.launch import launch
from zckpt_nb.saving import engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_tools import rank_errors  # noqa: E402  (benchmarks/bench_tools.py)


def run_saves(run) -> list[dict]:
    """Every save of every rank of `run` (its run.json), in rank order."""
    return [{"rank": r["rank"], "tag": s["tag"], "durable_seconds": s["durable_seconds"],
             "later_wait_seconds": s.get("commit_wait_seconds") or 0.0,
             "stall_seconds": s["stall_seconds"] + (s.get("commit_wait_seconds") or 0.0)}
            for r in run.ranks for s in r["saves"]]


def test_the_launcher_variables_are_set_as_deepspeeds_launcher_would(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert engine.launcher_env() == {"CROSS_RANK": "1", "CROSS_SIZE": "2"}


def test_only_deepspeeds_writers_get_a_writer_section():
    assert engine.writer_section("ds_decoupled") == {"writer": {"type": "python", "decoupled": True}}
    assert engine.writer_section("commit") == {}


@pytest.mark.parametrize("mode", ["ds_python", "ds_decoupled"])
def test_deepspeeds_engines_save_under_torchrun(mode, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run = launch(2, 4, tmp_path / mode, save_every=2, model="tiny", save_mode=mode, verbose=False,
                 progress=False, timeout=300)
    saves = run_saves(run)
    assert [(s["rank"], s["tag"]) for s in saves] == [(0, "global_step2"), (0, "global_step4"),
                                                      (1, "global_step2"), (1, "global_step4")]
    assert all(s["durable_seconds"] is None for s in saves)  # nothing is fsynced
    for tag in ("global_step2", "global_step4"):  # every file complete: DeepSpeed's own converter reads them
        weights = get_fp32_state_dict_from_zero_checkpoint(str(run.output_dir), tag=tag)
        assert sum(t.numel() for t in {id(t): t for t in weights.values()}.values()) == run.num_params
    waited = [s for s in saves if s["later_wait_seconds"] > 0]
    if mode == "ds_decoupled":  # the step after a save, and the run's end, waited for the writer process
        assert len(waited) == 4 and all(s["stall_seconds"] > s["later_wait_seconds"] for s in waited)
        assert latest_name(run.output_dir) == "global_step2"  # DeepSpeed writes no `latest` for the last one
    else:
        assert not waited and latest_name(run.output_dir) == "global_step4"


def test_fastpersists_writer_is_tried_and_its_error_told_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the fast writer may run: this checks the CPU-only answer")
    with pytest.raises(LaunchError):
        launch(2, 2, tmp_path / "ds_fast", save_every=1, model="tiny", save_mode="ds_fast", verbose=False,
               progress=False, timeout=300)
    assert set(rank_errors(tmp_path / "ds_fast").values()) == {
        "RuntimeError: Cannot access accelerator device when none is available."}
    assert not (tmp_path / "ds_fast" / "latest").exists()
