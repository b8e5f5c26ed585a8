"""`--save_mode async_process`: each rank's files written by a writer process from shared memory, committed by the
rank. Real 2-rank ZeRO-3 runs on CPU; the writer processes are found and killed for real."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
from conftest import file_hashes
from test_commit import FAULTS, failed_launch, ref_run, run, same_losses, verify_cli  # noqa: F401

from zckpt_nb.format.layout import committed_tags, latest_name

PROCESS = {"save_mode": "async_process"}


def writers_of(out: Path) -> dict[int, psutil.Process]:
    """Each live rank training into `out` (by RANK) and its writer process (the rank's spawned child)."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "zckpt_nb" in cmd and str(out) in cmd and "RANK" in p.environ():
                for child in p.children():
                    if "spawn_main" in " ".join(child.cmdline()):
                        found[int(p.environ()["RANK"])] = child
        except psutil.Error:
            continue
    return found


class Watcher(threading.Thread):
    """Records every writer process of a run into `out`. With `kill_rank`, it stops (SIGSTOP) that rank's first
    writer as soon as it starts, so the first save's files wait in its queue, and SIGKILLs it once the other rank
    has written its files of that save: the writer dies with a job in hand, as a crash mid-write would."""

    def __init__(self, out: Path, kill_rank: int | None = None) -> None:
        super().__init__(daemon=True)
        self.out, self.kill_rank, self.stop = out, kill_rank, threading.Event()
        self.seen: dict[int, psutil.Process] = {}
        self.killed: psutil.Process | None = None

    def run(self) -> None:
        stopped = None
        while not self.stop.is_set():
            for rank, writer in writers_of(self.out).items():
                self.seen.setdefault(writer.pid, writer)
                if rank == self.kill_rank and stopped is None:
                    writer.suspend()
                    stopped = writer
            others = list(self.out.glob(f"global_step*/zero_pp_rank_{1 - (self.kill_rank or 0)}_*optim_states.pt"))
            if stopped and self.killed is None and others:
                time.sleep(1)
                stopped.kill()
                self.killed = stopped
            time.sleep(0.05)

    def __enter__(self) -> Watcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_writer_processes_write_what_a_committed_save_writes(request, tmp_path):
    committed = request.getfixturevalue("ref_run")  # test_commit's run: same seed and schedule, commit mode
    out = tmp_path / "run"
    with Watcher(out) as watcher:
        done = run(out, keep_last=2, **PROCESS)
    assert committed_tags(out) == ["global_step8", "global_step12"] and latest_name(out) == "global_step12"
    assert verify_cli(out).returncode == 0 and done.failed_saves == []
    assert same_losses(committed, done) <= 1e-5
    for tag in ("global_step8", "global_step12"):  # the same bytes as the synchronous save's, file for file
        mine = file_hashes(out, tag)
        assert len(mine) >= 4 and mine == file_hashes(committed.output_dir, tag), tag
    assert len(watcher.seen) == 2  # one writer per rank, for the whole run
    for rank in done.ranks:
        for save in rank["saves"]:
            assert save["committed"] and 0 < save["stall_seconds"] < save["durable_seconds"]
    time.sleep(1)
    assert all(gone(p) for p in watcher.seen.values())  # none outlives its rank


def test_a_killed_writer_fails_that_save_on_every_rank_and_the_next_save_commits(request, tmp_path):
    committed = request.getfixturevalue("ref_run")
    out = tmp_path / "run"
    with Watcher(out, kill_rank=1) as watcher:
        done = run(out, **PROCESS)
    assert watcher.killed is not None
    failed = {f["tag"] for f in done.failed_saves}
    assert len(failed) == 1  # one save failed; the writer that replaced the dead one wrote the next
    for rank in done.ranks:  # every rank agreed on that save's failure and on its reason
        errors = [s["error"] for s in rank["saves"] if not s["committed"]]
        assert len(errors) == 1 and "writer process" in errors[0] and "died" in errors[0], errors
    assert not failed & set(committed_tags(out)) and "global_step12" in committed_tags(out)
    assert latest_name(out) == "global_step12" and verify_cli(out).returncode == 0
    assert same_losses(committed, done) <= 1e-5


def test_a_rank_killed_mid_save_takes_its_writer_with_it_and_resume_matches(request, tmp_path, monkeypatch):
    committed = request.getfixturevalue("ref_run")
    out = tmp_path / "run"
    monkeypatch.setenv("ZCKPT_FAULT", "before_commit:1:8")  # rank 1 dies with its step-8 files written
    with Watcher(out) as watcher:
        text = failed_launch(out, worker=FAULTS, **PROCESS)
    monkeypatch.delenv("ZCKPT_FAULT")
    assert "rank 1 injects 'before_commit'" in text
    time.sleep(1)
    assert len(watcher.seen) == 2 and all(gone(p) for p in watcher.seen.values())  # no orphan writer
    assert latest_name(out) == "global_step4" and verify_cli(out).returncode == 0
    resumed = run(out, resume=True, **PROCESS)
    assert resumed.resumed_from_step == 4 and same_losses(committed, resumed) <= 1e-5
