"""A failed job shown in a few lines (run.logs.failure_report), and what counts as a peer's failure.

The logs are real `launch.log` files as the launcher writes them (one `[rank N] text` line per printed line).
"""

from __future__ import annotations

import pytest

from zckpt_nb.errors import LaunchError, is_peer_failure, peer_failure
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


def test_a_dead_peer_on_nccl_or_gloo_is_a_peer_failure_and_a_full_disk_is_not():
    import torch.distributed as dist

    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited or there was a network "
                                 "error")
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
    assert is_peer_failure(nccl) and is_peer_failure(gloo) and not is_peer_failure(OSError(28, "No space left"))
    assert str(peer_failure(nccl, 1, "save of global_step8")).startswith("rank 1: save of global_step8")


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


def test_an_error_every_rank_agreed_on_is_said_once_under_the_rank_it_came_from(tmp_path):
    why = "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt does not match its SHA-256 (corrupted)"
    write_log(tmp_path, {0: [f"zckpt_nb.train: error: rank 1: {why}"], 1: [f"zckpt_nb.train: error: rank 1: {why}"],
                         2: ["zckpt_nb.train_fsdp: error: rank 2: cannot read .metadata; refusing it"]})
    report = failure_report(LaunchError("job 'train' failed (exit code 1)"), tmp_path).splitlines()
    assert report[1:-1] == [f"  rank 1: {why}", "  rank 2: cannot read .metadata; refusing it"], report
