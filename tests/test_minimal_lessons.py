"""Notebooks 02 and 03's helpers: reading a minimal worker's log, the resume verdict, what each load restored, and
the entry point that runs a file on every rank."""

from __future__ import annotations

import sys

import pytest

from zckpt_nb.lessons import contents, minimal
from zckpt_nb.run import script

pytestmark = pytest.mark.fast


def test_step_losses_reads_rank_0s_lines_only():
    log = ["[rank 0] step 1 loss 6.5", "[rank 1] step 1 loss 9.0", "[launcher] step 2 loss 1.0",
           "[rank 0] step 2 loss 6.25", "[rank 0] rank 0: resumed at step 1"]
    assert minimal.step_losses(log) == {1: 6.5, 2: 6.25}
    assert minimal.said(log, "resumed") == ["[rank 0] resumed at step 1"]  # the rank named once


def test_resume_sentence_says_exact_only_when_every_shared_loss_is_equal():
    full = {1: 6.5, 2: 6.25, 3: 6.0}
    assert "bit for bit" in minimal.resume_sentence(full, {2: 6.25, 3: 6.0})
    assert "Resumed at step 1" in minimal.resume_sentence(full, {2: 6.25, 3: 6.0})
    differs = minimal.resume_sentence(full, {2: 6.25, 3: 6.5})
    assert "not an exact resume" in differs and "5.00e-01" in differs
    assert "nothing to compare" in minimal.resume_sentence(full, {7: 1.0})


def test_restored_compares_each_load_with_the_run_that_saved():
    saved = {"adam_step": 2, "lr": 0.003, "global_steps": 2, "exp_avg_abs_sum": 1.0}
    fresh = {"adam_step": 0, "lr": 0.0, "global_steps": 0, "exp_avg_abs_sum": 0.0}
    loads = {"saved": saved, **{name: {**saved, "trainable_max_diff": 0.0, "frozen_max_diff": 0.0}
                                for name in contents.LOADS}}
    loads["frozen_excluded"]["frozen_max_diff"] = 0.1
    loads["load_module_only=True"] |= {**fresh, "trainable_max_diff": 0.2}
    grid = contents.restored(loads)
    assert grid["frozen"] == dict.fromkeys(contents.PARTS, True)
    assert grid["frozen_excluded"]["frozen weights"] is False and grid["frozen_excluded"]["trainable weights"]
    assert grid["full resume"]["frozen weights"] is None  # that model froze nothing
    assert not any(grid["load_module_only=True"][p] for p in ("trainable weights", "Adam's state", "LR schedule"))
    warm = contents.load_label(contents.WARM_START, ",\n")  # the row names both switches: why its LR is not back
    assert "load_lr_scheduler_states=False" in warm and grid[warm]["LR schedule"]


def test_rank_bytes_sentence_names_the_run_files_rank_0_wrote_beside_its_shard():
    shard = [{"path": f"global_step2/zero_pp_rank_{r}_mp_rank_00_{k}_states.pt", "bytes": 1000}
             for r in (0, 1) for k in ("model", "optim")]
    ranks = [{"files": shard[:2] + [{"path": "tokenizer.json", "bytes": 2**20}, {"path": "latest", "bytes": 13}]},
             {"files": shard[2:]}]
    said = minimal.rank_bytes_sentence(ranks)
    assert f"{(2**20 + 13) / 2**20:.3f} MiB beside its shard" in said and "tokenizer.json, latest" in said
    assert minimal.rank_bytes_sentence(ranks[1:]) == "Every rank wrote only its own shard files."


def test_the_script_entry_point_runs_a_file_as_main_with_its_arguments(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nif __name__ == '__main__':\n    open(sys.argv[1], 'w').write(sys.argv[0])\n")
    out = tmp_path / "said.txt"
    monkeypatch.setattr(sys, "argv", ["zckpt_nb.run.script", str(worker), str(out)])
    script.main()
    assert out.read_text() == str(worker)
