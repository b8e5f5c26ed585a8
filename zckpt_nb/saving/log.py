"""This rank's record of its saves for run.json: stalls, time to durable, failures."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from zckpt_nb.format.layout import latest_name, rank_files
from zckpt_nb.format.records import Failure, SaveCost, SaveOutcome, SaveRecord


class SaveLog:
    """This rank's saves for run.json (`SaveRecord`): each one's stall and time to durable."""

    def __init__(self, output_dir: str | Path, on_save_error: str, rank: int) -> None:
        self.output_dir, self.on_save_error, self.rank = output_dir, on_save_error, rank
        self.saves: list[SaveRecord] = []
        self.failed: list[Failure] = []
        self.rotation_errors: list[Failure] = []
        self.save_seconds = 0.0
        self.started: dict[str, float] = {}  # tag -> when its save was called
        self.costs: dict[str, SaveCost] = {}  # tag -> what the save call cost on this rank
        self.loop_start = time.perf_counter()
        self.step_starts: list[float] = []
        self.loop_seconds = 0.0  # when the loop ended, on the same clock
        self.stalled: tuple[SaveRecord, float] | None = None  # the last save's record, until the next step

    def stall_ends(self, step_starts: bool = True) -> None:
        """The next step starts (`step_starts`), or training ends: the last save's stall is over."""
        now = time.perf_counter() - self.loop_start
        if step_starts:
            self.step_starts.append(now)
        else:
            self.loop_seconds = now
        if self.stalled:
            record, start = self.stalled
            record.stall_seconds = time.perf_counter() - start
            self.stalled = None

    def add_waits(self, waits: list[float]) -> None:
        """A later step (or the run's end) waited for the last save: DeepSpeed's decoupled writer finishing it."""
        if waits and self.saves:
            self.saves[-1].commit_wait_seconds = waits[-1]

    def add(self, outcome: SaveOutcome, start: float, durable: bool, cost: SaveCost) -> None:
        """A save called at `start` returned; an asynchronous one in flight is completed by `settle`."""
        record = SaveRecord(**vars(outcome), started_at=start - self.loop_start)
        self.saves.append(record)
        self.save_seconds += outcome.seconds
        self.started[outcome.tag], self.costs[outcome.tag], self.stalled = start, cost, (record, start)
        if not outcome.in_flight:
            self.settle(outcome, durable)

    def settle(self, outcome: SaveOutcome | None, durable: bool = True) -> None:
        """A save's final outcome (None: nothing settled), on every rank: report a failure, or when it was durable."""
        if outcome is None:
            return
        record = next(r for r in reversed(self.saves) if r.tag == outcome.tag)
        record.committed, record.error, record.timings = outcome.committed, outcome.error, \
            record.timings | outcome.timings
        record.deleted, record.rotation_error = outcome.deleted, outcome.rotation_error
        if not outcome.committed:
            self.failed.append(Failure(outcome.tag, outcome.step, outcome.error))
            # every rank prints the same single line: what failed where, what is kept, what happens next
            then = "training continues (--on_save_error continue)" if self.on_save_error == "continue" else \
                "stopping every rank (--on_save_error abort)"
            print(f"save {outcome.tag} failed: {outcome.error}; the previous checkpoint "
                  f"({latest_name(self.output_dir) or 'none yet'}) and 'latest' are untouched; {then}", flush=True)
            if self.on_save_error == "abort":
                sys.exit(1)
            return
        if record.snapshot_bytes:  # asynchronous: the files were written after the call was measured
            files = rank_files(self.output_dir, outcome.tag, self.rank)
            cost = self.costs[outcome.tag]
            cost.files = [str(Path(self.output_dir) / f["path"]) for f in files]
            cost.bytes_written = sum(f["bytes"] for f in files)
        if durable:  # an asynchronous save was durable when its background thread committed it
            record.durable_seconds = (outcome.durable_at or time.perf_counter()) - self.started[outcome.tag]
        if self.rank == 0:
            print(f"saved checkpoint {outcome.tag} in {outcome.seconds:.2f} s", flush=True)
        if outcome.rotation_error:  # every rank prints the same single line; run.json records it
            print(f"rotation after {outcome.tag} failed: {outcome.rotation_error}; {outcome.tag} is committed and "
                  "'latest' names it; training continues", flush=True)
            self.rotation_errors.append(Failure(outcome.tag, outcome.step, outcome.rotation_error))

