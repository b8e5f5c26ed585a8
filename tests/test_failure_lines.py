"""A failed job shown in a few lines (run.logs.failure_report), and notebook 04's route table and bytes per parameter.

The logs are real `launch.log` files as the launcher writes them (one `[rank N] text` line per printed line).
"""

from __future__ import annotations

import pytest

from zckpt_nb.errors import LaunchError
from zckpt_nb.lessons import consolidation
from zckpt_nb.run.logs import failure_report, rank_error_line

pytestmark = pytest.mark.fast

TRACEBACK = [f'  File "deepspeed/runtime/engine.py", line {n}, in save_checkpoint' for n in range(40)]


def write_log(folder, per_rank: dict[int, list[str]]) -> None:
    """A launch.log with each rank's lines, interleaved as torchrun delivers them."""
    lines = [f"[rank {r}] {text}" for r, texts in per_rank.items() for text in texts]
    (folder / "launch.log").write_text("\n".join(lines) + "\n")


def test_a_ranks_own_error_is_the_workers_line_else_its_last_exception_else_none():
    worker = ["step 1/4 loss 7.1", "zckpt_nb.train: error: rank 0: save gave up after 5 s", "Traceback:",
              "RuntimeError: later"]
    assert rank_error_line(worker) == "rank 0: save gave up after 5 s"
    assert rank_error_line([*TRACEBACK, "torch.distributed.DistBackendError: closed by peer", "  raise x"]) == \
        "torch.distributed.DistBackendError: closed by peer"
    assert rank_error_line(["step 1/4 loss 7.1"]).startswith("printed no error")


def test_a_failed_job_is_one_line_per_rank_between_its_outcome_and_its_log(tmp_path):
    write_log(tmp_path, {0: [*TRACEBACK, "RuntimeError: " + "x" * 500],
                         1: ["rank 1/3 on cpu (gloo): holds 10 elements", "step 1/4 loss 7.1"],
                         2: ["zckpt_nb.train: error: rank 2: ENOSPC writing shard"]})
    err = LaunchError("job 'train' failed (exit code 1)\n" + "\n".join(TRACEBACK * 3))
    report = failure_report(err, tmp_path, width=120).splitlines()
    assert len(report) == 3 + 2, report
    assert report[0] == "job 'train' failed (exit code 1)"
    assert report[1].startswith("  rank 0: RuntimeError: x") and len(report[1]) <= len("  rank 0: ") + 120
    assert report[2].startswith("  rank 1: printed no error") and report[3] == "  rank 2: ENOSPC writing shard"
    assert report[-1].endswith(str(tmp_path / "launch.log"))


def test_the_route_table_has_at_most_eight_columns_one_format_each():
    costs = [{"mode": "per_param", "rank": r, "seconds": 0.1 + r, "extra_peak_bytes": 2**20, "bytes_written": 3 * 2**20,
              "heap_extra_peak_bytes": 2**21, "bytes_read": 0, "comm_bytes": 2**21,
              "comm_ops": {"all_gather_into_tensor": {"count": 2, "bytes": 2**20, "max_bytes": 2**19}}}
             for r in range(2)]
    num_params = 2**20
    fp32, bf16 = (consolidation.cost_summary(costs, num_params, consolidation.bytes_per_param(d)) for d in
                  ("fp32", "bf16"))
    assert bf16[0]["all-gathered / model"] == 2 * fp32[0]["all-gathered / model"]  # half the bytes per parameter
    rows = consolidation.route_table(bf16)
    assert len(rows[0]) <= 8 and all(isinstance(v, str) for v in rows[0].values())
    assert rows[0]["all-gathered / model"] == f"{2**21 / (num_params * 2):.2f}"


def test_a_gloo_line_loses_its_source_folders_and_is_cut_between_words(tmp_path):
    gloo = ("zckpt_nb.train: error: rank 0: save stopped (RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
            "transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:31937); every rank stops")
    long = "waiting for ranks that never joined " * 9
    write_log(tmp_path, {0: [gloo], 1: ["zckpt_nb.train: error: rank 1: " + long]})
    report = failure_report(LaunchError("job 'train' failed (exit code 1)"), tmp_path, width=120).splitlines()
    assert "(RuntimeError: [pair.cc:553] Connection closed by peer" in report[1] and "__w" not in report[1]
    kept = report[2].removeprefix("  rank 1: ").removesuffix("...")
    assert report[2].endswith("...") and long.startswith(kept + " "), report[2]  # cut between two words


def test_an_exceptions_gist_is_its_first_sentence_without_source_folders():
    from zckpt_nb.errors import gist

    lost = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:40656. This is typically caused by a remote worker crashing. Check the logs.")
    assert gist(lost) == "[pair.cc:553] Connection closed by peer [127.0.0.1]:40656"
    assert gist(RuntimeError("Timed out. x")) == "Timed out. x"  # a first sentence too short to stand alone
