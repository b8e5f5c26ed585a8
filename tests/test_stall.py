"""Stall and time to durable from run.json records, and the peak-memory counters they sit beside (no launches)."""

import pytest
import torch

from zckpt_nb.lessons import stall
from zckpt_nb.measure import meters


def save(tag, started_at, stall_s, durable_s, snapshot=0):
    return {"tag": tag, "committed": True, "started_at": started_at, "stall_seconds": stall_s,
            "durable_seconds": durable_s, "snapshot_bytes": snapshot}


def test_steps_lose_the_stall_and_are_marked_while_a_save_is_written():
    # steps start at 0, 1, 2.5, 3.5; a save at 1.9 stalls 0.5 s and is durable 1.2 s after its call (at 3.1)
    rank = {"step_starts": [0.0, 1.0, 2.5, 3.5], "saves": [save("global_step2", 1.9, 0.5, 1.2)]}
    assert stall.step_seconds(rank) == [(1.0, False), (1.0, True), (1.0, True)]


def test_a_later_steps_wait_for_a_decoupled_writer_is_stall_and_leaves_that_step():
    # steps start at 0, 1, 2.5, 3.9; a save at 2.0 stalls until 2.5 (DeepSpeed queues the state for its writer
    # process), then the step from 2.5 waits 0.4 s at 2.6 for the writer to finish: three 1-second steps
    decoupled = save("global_step2", 2.0, 0.5, None) | {"commit_wait_at": 2.6, "commit_wait_seconds": 0.4}
    rank = {"step_starts": [0.0, 1.0, 2.5, 3.9], "saves": [decoupled]}
    assert stall.step_seconds(rank) == [(1.0, False), (1.0, False), pytest.approx((1.0, False))]
    record = stall.save_record("ds_decoupled", 0, decoupled)
    assert record["stall_seconds"] == pytest.approx(0.9) and record["later_wait_seconds"] == 0.4
    row = stall.summary([record])[0]
    assert row["of which later steps waited s"] == 0.4 and row["median durable s"] == stall.NEVER


@pytest.mark.parametrize("message, line", [
    ("job 'train' failed (exit code 1)\n--- last lines of rank 0 ---\n[rank0]: Traceback (most recent call last):\n"
     "[rank0]: KeyError: 'CROSS_SIZE'\n--- last lines of rank 1 ---\nRuntimeError: gloo: connection closed",
     "RuntimeError: gloo: connection closed"),
    ("job 'train' timed out after 5 s", "job 'train' timed out after 5 s"),
])
def test_a_failed_launch_is_told_in_its_last_exception_line(message, line):
    assert stall.failure_line(message) == line


def test_summary_and_sentences_follow_the_records():
    records = [stall.save_record("plain", 0, save("a", 0, 0.1, None)),
               stall.save_record("commit", 0, save("a", 0, 0.4, 0.4)),
               stall.save_record("async", 0, save("a", 0, 0.05, 0.9, snapshot=3 * 2**20))]
    rows = stall.summary(records)
    assert [r["median durable s"] for r in rows] == [stall.NEVER, 0.4, 0.9]
    sentence = stall.stall_sentence(rows)
    assert "plain stops training 0.100 s per save (± 0.000 s) and never makes it durable" in sentence
    assert "Least stall: async, beyond chance" in sentence and "snapshot" not in sentence  # memory_sentence says it


def test_a_difference_within_chance_is_called_a_tie_and_a_rare_long_wait_is_not():
    plain = [stall.save_record("plain", 0, save(t, 0, s, None)) for t, s in (("a", 0.0271), ("b", 0.020), ("c", 0.03))]
    commit = [stall.save_record("commit", 0, save(t, 0, s, s)) for t, s in (("a", 0.0275), ("b", 0.021), ("c", 0.04))]
    sentence = stall.stall_sentence(stall.summary(plain + commit))
    assert "a tie between plain and commit" in sentence
    # one call of 0.03 s and one later wait of 0.77 s per save: the mean counts the waits, so no tie with plain
    waits = [stall.save_record("ds_decoupled", 0, save(t, 0, 0.03, None) | {"commit_wait_seconds": w})
             for t, w in (("a", 0.74), ("b", 0.0), ("c", 0.74))]
    assert "Least stall: plain, beyond chance" in stall.stall_sentence(stall.summary(plain + waits))


def test_the_decoupled_engines_wait_at_the_run_end_counts_in_its_total():
    # two saves on one rank: each call 0.1 s; a later step waits 0.2 s for the first, the run's end 0.6 s for the last
    first = save("a", 1.0, 0.1, None) | {"commit_wait_at": 1.5, "commit_wait_seconds": 0.2}
    last = save("b", 3.0, 0.1, None) | {"commit_wait_at": 4.0, "commit_wait_seconds": 0.6}
    records = [stall.save_record("ds_decoupled", 0, s) for s in (first, last)]
    records += [stall.save_record("plain", 0, save(t, 0, 0.3, None)) for t in "ab"]
    assert stall.summary(records)[0]["total stall, slowest rank s"] == pytest.approx(1.0)
    sentence = stall.decoupled_sentence(records)
    assert "1.000 s in all" in sentence and "0.600 s of it at the run's end" in sentence and "1.67x" in sentence


def test_the_interval_calculator_uses_each_durable_modes_mean_stall_and_lag():
    records = [stall.save_record("plain", 0, save("a", 0, 0.1, None)),
               *(stall.save_record("commit", 0, save(t, 0, s, s + 0.5)) for t, s in (("a", 1.0), ("b", 3.0)))]
    rows = stall.interval_rows(records, mtbf=3600.0 * 10, restart=60.0)
    assert [r["mode"] for r in rows] == ["commit"]  # plain is never durable: no interval
    assert rows[0]["mean stall per save s"] == 2.0 and rows[0]["durable lag s"] == 0.5
    assert rows[0]["optimum interval s"] == round((2 * 2.0 * 36000) ** 0.5, 1)
    said = stall.interval_sentence(rows, 10_000, 1024, 3600.0 * 10)
    assert "The least time is lost with commit, and" in said  # one durable mode: no tie to call
    twin = [stall.save_record("async", 0, save(t, 0, s, s + 0.5)) for t, s in (("a", 1.1), ("b", 2.9))]
    rows = stall.interval_rows(records + twin, mtbf=3600.0 * 10, restart=60.0)
    said = stall.interval_sentence(rows, 10_000, 1024, 3600.0 * 10, stall.summary(records + twin))
    assert "a tie with" in said  # means 2.0 and 2.0 +- 1.0: within chance
    answer = stall.interval_answer(records, 10_000, 1024, default_gpus=1024)  # the default: what 4x would do
    assert "to 4,096 GPUs" in answer and "commit from" in answer and "(0.50x)" in answer
    answer = stall.interval_answer(records, 10_000, 256, default_gpus=1024)  # the learner's own: against the default
    assert "From 1,024 to 256 GPUs" in answer and "(2.00x)" in answer and "This run used 256 GPUs" in answer


def test_the_steps_before_the_first_save_are_left_out_of_the_overlap_comparison():
    # a slow warm-up step, then a step holding a save (0.1 s stall) written until 2.5, then one more
    rank = {"step_starts": [0.0, 1.0, 2.2, 3.2], "saves": [{"started_at": 2.0, "stall_seconds": 0.1,
                                                           "durable_seconds": 0.5, "commit_wait_seconds": 0.0}]}
    assert [round(t, 3) for t, _ in stall.after_first_save(rank)] == [1.1, 1.0]
    row = stall.step_rows({"async": {"ranks": [rank]}})[0]
    assert row["steps x ranks, a save being written"] == 2 and row["steps x ranks, no save being written"] == 0


def test_overlap_sentence_says_slower_only_beyond_the_spread_of_steps_without_a_save():
    def row(mode, idle, busy, spread):
        return {"mode": mode, "steps x ranks, no save being written": 6, "median step s, no save being written": idle,
                "slowest / fastest step, no save being written": spread, "steps x ranks, a save being written": 3,
                "median step s, a save being written": busy}
    plain = row("plain", 1.0, stall.NONE, 1.27)
    tie = stall.overlap_sentence([plain, row("async", 1.0, 1.21, 1.5)])
    assert "only detect a slowdown larger than 1.27x" in tie
    assert "1.21x is within that noise" in tie and "spread 1.27x" in tie and "(3 steps x ranks)" in tie
    assert "beyond that noise: slower" in stall.overlap_sentence([plain, row("async", 1.0, 1.4, 1.1)])
    alone = stall.overlap_sentence([row("async", 1.0, 1.4, 1.5)])  # no plain run: the async run's own spread
    assert "spread 1.50x from fastest to slowest in this run" in alone and "within that noise" in alone
    assert "cannot tell" in stall.overlap_sentence([plain, row("async", 1.0, 0.57, 1.5)])
    assert "not measured" in stall.overlap_sentence([row("async", 1.0, stall.NONE, 1.5)])


def test_the_standard_error_counts_each_save_once_at_its_ranks_mean():
    # two ranks of one save wait for each other: saves a, b, c with both ranks close, so 3 samples, not 6
    records = [stall.save_record("commit", rank, save(t, 0, s + 0.001 * rank, s)) for t, s in
               (("a", 0.03), ("b", 0.04), ("c", 0.05)) for rank in (0, 1)]
    row = stall.summary(records)[0]
    assert row["saves"] == 3 and row["mean stall s"] == 0.0405
    assert row["standard error s"] == round(stall.standard_error([0.0305, 0.0405, 0.0505]), 4)


def test_resetting_the_kernel_rss_peak_keeps_the_run_wide_peak():
    big = torch.ones(25_000_000)  # 100 MB resident
    before = meters.host_peak_bytes()
    del big
    if not meters.reset_rss_high_water():
        pytest.skip("this kernel refuses /proc/self/clear_refs (HostMemory samples RSS instead)")
    assert meters.rss_high_water() < before - 50 * 2**20  # the kernel's counter restarted ...
    assert meters.host_peak_bytes() >= before  # ... and run.json's peak did not


def test_an_async_save_slower_than_plain_is_explained_and_the_decoupled_answer_names_plains_total():
    plain = [stall.save_record("plain", 0, save(t, 0, s, None)) for t, s in (("a", 0.015), ("b", 0.016), ("c", 0.017))]
    slow = [stall.save_record("async", 0, save(t, 0, s, 0.08, snapshot=2**20))
            for t, s in (("a", 0.033), ("b", 0.034), ("c", 0.035))]
    sentence = stall.stall_sentence(stall.summary(plain + slow))
    assert "Here async stopped training 2.1x as long as plain" in sentence and "(1.00 MiB)" in sentence
    fast = [{**r, "stall_seconds": 0.005} for r in slow]
    assert "Here async" not in stall.stall_sentence(stall.summary(plain + fast))
    assert "plain stopped training 0.048 s in all on its slowest rank over 3 saves" in stall.decoupled_sentence(plain)
