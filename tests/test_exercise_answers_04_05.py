"""Notebooks 04-05's exercise answers speak of the parameter the learner changed: the changed run's figure against
the default's (or against the one to try, when the run used the default), and what a crash left on disk."""

from __future__ import annotations

import pytest

from zckpt_nb.format.layout import MANIFEST, tag_for
from zckpt_nb.lessons import failures, offline


def shard_rows(peaks: dict[str, dict[str, int]]) -> list[dict]:
    """`offline.memory_summary`'s rows, only the figures the answer reads: route -> shard size -> MiB above baseline."""
    return [{"route": route, "--max_shard_size": size, "above baseline MiB": mib}
            for size in next(iter(peaks.values())) for route, by in peaks.items() for mib in [by[size]]]


@pytest.mark.fast
def test_the_shard_answer_compares_every_size_with_the_first_and_calls_small_changes_a_tie():
    rows = shard_rows({"zero_to_fp32.py": {"5GB": 32, "1MB": 31}, "export": {"5GB": 15, "1MB": 4}})
    answer = offline.shard_size_answer(rows)
    assert "zero_to_fp32.py peaked 32 MiB at 5GB, 31 MiB at 1MB" in answer
    assert "the same within the sampling noise" in answer.split("export")[0]
    assert "changed by up to 11 MiB with the shard size" in answer


@pytest.mark.fast
def test_with_one_shard_size_the_answer_asks_for_a_second():
    answer = offline.shard_size_answer(shard_rows({"zero_to_fp32.py": {"2MB": 32}, "export": {"2MB": 5}}))
    assert answer.startswith("Only `--max_shard_size 2MB` was measured") and "SHARD_SIZES" in answer
    assert "zero_to_fp32.py peaked 32 MiB and the export 5 MiB above the baseline" in answer  # this run's figures


@pytest.mark.fast
def test_the_hang_answer_splits_the_job_at_the_save_and_predicts_the_other_timeout():
    clock = failures.LineClock(4)
    clock("rank 0", "step 4/12 loss 6.6")
    clock("rank 1", "zckpt_nb.train: error: rank 1: a collective timed out")
    waited = clock.marks["error"] - clock.marks["save"]
    default = failures.hang_answer(20.0, clock, failures.DEFAULT_COLLECTIVE_TIMEOUT, [])
    assert f"{waited:.1f} s later (collective timeout 5 s)" in default and "COLLECTIVE_TIMEOUT = 15 expect" in default
    changed = failures.hang_answer(30.0, clock, 15.0, [])
    assert "COLLECTIVE_TIMEOUT = 5 expect about 20 s" in changed  # the job minus its timeout, plus the default's
    assert "finished" in failures.hang_answer(9.0, failures.LineClock(4), 5.0, [])  # one rank: no error line


@pytest.mark.fast
def test_what_a_killed_save_left_is_read_from_the_files(tmp_path):
    plain, protocol = tmp_path / "plain", tmp_path / "commit"
    for root, latest in ((plain, 8), (protocol, 4)):
        for step, ranks in ((4, 2), (8, 1)):  # step 8: the last rank died after its model file
            folder = root / tag_for(step)
            folder.mkdir(parents=True)
            for r in range(2):
                (folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(b"m")
                if r < ranks:
                    (folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"o")
        (root / tag_for(4) / MANIFEST).write_text("{}")
        (root / "latest").write_text(tag_for(latest))
    rows = failures.crash_rows({"DeepSpeed's save alone": plain, "the commit protocol": protocol}, 8, 2)
    assert [r["`latest` names"] for r in rows] == ["global_step8", "global_step4"]
    assert rows[0]["global_step8 lacks"] == "rank 1 optim" and rows[0]["its manifest"] == "no"
    sentence = failures.crash_sentence(rows, 8)
    assert "`latest` names global_step8, which lacks rank 1 optim" in sentence
    assert "the commit protocol, `latest` names global_step4, the checkpoint before the crash" in sentence


def test_a_dead_peer_on_nccl_or_gloo_is_a_peer_failure_and_a_full_disk_is_not():
    rows = failures.peer_failure_rows(1, "global_step8")
    assert [r["is_peer_failure"] for r in rows] == ["yes", "yes", "no"]
    assert rows[0]["exception"] == "DistBackendError" and rows[0]["the save path then"].startswith("rank 1: save of")
