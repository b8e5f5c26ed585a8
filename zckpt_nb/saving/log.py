"""This rank's record of its saves for run.json: stalls, time to durable, failures."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import latest_name, rank_files
from zckpt_nb.saving import rotation


def report_failed_save(outcome: Any, output_dir: str | Path, on_save_error: str) -> None:
    """Every rank prints the same single line: what failed where, what is kept, what happens next."""
    kept = latest_name(output_dir) or "none yet"
    then = "training continues (--on_save_error continue)" if on_save_error == "continue" else \
        "stopping every rank (--on_save_error abort)"
    print(f"save {outcome.tag} failed: {outcome.error}; the previous checkpoint ({kept}) and 'latest' are "
          f"untouched; {then}", flush=True)
    if on_save_error == "abort":
        sys.exit(1)


class SaveLog:
    """This rank's saves for run.json: each record, with how long it stopped training and how long until durable.

    `stall_seconds` runs from the save call to the start of the next step (or the end of the loop); a save by
    DeepSpeed's decoupled engine also stops a later step for `commit_wait_seconds` (from `commit_wait_at`);
    `durable_seconds` from the save call to the moment every rank knows the commit is on disk (None when the mode
    never makes it durable, or the save failed). `started_at`, `step_starts` and `loop_seconds` (its end) are seconds
    since the training loop began on this rank (the timeline of notebook 06).
    """

    def __init__(self, output_dir: str | Path, on_save_error: str, rank: int) -> None:
        self.output_dir, self.on_save_error, self.rank = output_dir, on_save_error, rank
        self.saves: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.rotation_errors: list[str] = []
        self.save_seconds = 0.0
        self.started: dict[str, float] = {}  # tag -> when its save was called
        self.costs: dict[str, dict[str, Any]] = {}  # tag -> the save call's SaveCost, as a dict
        self.loop_start = time.perf_counter()
        self.step_starts: list[float] = []
        self.loop_seconds = 0.0  # when the loop ended, on the same clock
        self._stalled: tuple[dict[str, Any], float] | None = None  # the last save's record, until the next step

    def stall_ends(self, step_starts: bool = True) -> None:
        """The next step starts (`step_starts`), or training ends: the last save's stall is over."""
        now = time.perf_counter() - self.loop_start
        if step_starts:
            self.step_starts.append(now)
        else:
            self.loop_seconds = now
        if self._stalled:
            record, start = self._stalled
            record["stall_seconds"] = time.perf_counter() - start
            self._stalled = None

    def add_waits(self, waits: list[tuple[float, float]]) -> None:
        """A later step (or the run's end) waited for the last save: DeepSpeed's decoupled writer finishing it."""
        for start, seconds in waits if self.saves else []:
            self.saves[-1].update(commit_wait_at=start - self.loop_start, commit_wait_seconds=seconds)

    def add(self, outcome: Any, start: float, durable: bool, cost: dict[str, Any]) -> None:
        """A save called at `start` returned; `durable`: once committed it is on disk (not DeepSpeed's plain save).

        An asynchronous save returns neither committed nor failed: `settle` follows when it is, and then completes
        its `cost` (this rank's SaveCost of the call) with the files the background write put on disk.
        """
        record = outcome.record() | {"stall_seconds": None, "durable_seconds": None,
                                     "started_at": start - self.loop_start}
        self.saves.append(record)
        self.save_seconds += outcome.seconds
        self.started[outcome.tag] = start
        self.costs[outcome.tag] = cost
        self._stalled = (record, start)
        if outcome.committed or outcome.error:  # not in flight, nor skipped (the seed's rank-0 guard)
            self.settle(outcome, durable)

    def settle(self, outcome: Any | None, durable: bool = True) -> None:
        """A save's final outcome (None: nothing settled), on every rank: report a failure, or when it was durable."""
        if outcome is None:
            return
        record = next(r for r in reversed(self.saves) if r["tag"] == outcome.tag)
        record.update(committed=outcome.committed, error=outcome.error, timings=record["timings"] | outcome.timings,
                      deleted=outcome.deleted, rotation_error=outcome.rotation_error)
        if not outcome.committed:
            self.failed.append({"tag": outcome.tag, "step": outcome.step, "error": outcome.error})
            report_failed_save(outcome, self.output_dir, self.on_save_error)
            return
        if "snapshot_bytes" in record:  # asynchronous: the files were written after the call was measured
            files = rank_files(self.output_dir, outcome.tag, self.rank)
            root = Path(self.output_dir)
            self.costs[outcome.tag].update(files=[str(root / f["path"]) for f in files],
                                           bytes_written=sum(f["bytes"] for f in files))
        if durable:  # an asynchronous save was durable when its background thread committed it
            record["durable_seconds"] = (getattr(outcome, "durable_at", None) or time.perf_counter()) \
                - self.started[outcome.tag]
        if self.rank == 0:
            print(f"saved checkpoint {outcome.tag} in {outcome.seconds:.2f} s", flush=True)
        if outcome.rotation_error:
            self.rotation_errors.append(rotation.report(outcome))


def ending_problem(saves: list[dict[str, Any]], failed: list[dict[str, Any]], run_json_error: str | None) -> str | None:
    """One line when every save failed (a full or read-only disk to the end) or run.json could not be written."""
    problems = []
    tried = [s for s in saves if not s["skipped"]]
    if tried and len(failed) == len(tried):
        problems.append(f"all {len(tried)} saves failed, so this run committed no checkpoint (the last: "
                        f"{failed[-1]['error']}); free space or choose another --output_dir")
    if run_json_error:
        problems.append(f"run.json was not written ({run_json_error})")
    return "; ".join(problems) or None
