"""How often to save: Young's optimum interval from a save's stall and the job's mean time between failures.

A job that saves every `interval` seconds of training, each save stopping training for `stall` seconds, loses on
average, per second of wall time (first order, as Young 1974 and Daly 2006 derive it):
- `stall / interval` to the saves;
- `(interval / 2 + lag + restart) / mtbf` to failures: a failure lands on average half an interval after the last
  save, the work done while that save was not yet durable (`lag`, its time to durable beyond the stall) is lost
  too, and every failure costs a restart (relaunch, load).
The sum is smallest at `interval = sqrt(2 * stall * mtbf)`; `lag` and `restart` shift the loss, not the optimum.
Daly's higher-order correction matters only when the interval nears the MTBF (not for a stall of seconds).
No library computes this (DeepSpeed and PyTorch leave the interval to the user), hence these few lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zckpt_nb.errors import UsageError

HOUR = 3600.0


def job_mtbf_seconds(gpu_mtbf_hours: float, gpus: int) -> float:
    """The job's mean time between failures: any of `gpus` independent GPUs, each failing every `gpu_mtbf_hours`."""
    if gpu_mtbf_hours <= 0 or gpus < 1:
        raise UsageError(f"GPU MTBF must be > 0 hours and GPUs >= 1 (got {gpu_mtbf_hours} h, {gpus} GPUs)")
    return gpu_mtbf_hours * HOUR / gpus


def optimal_interval(stall: float, mtbf: float) -> float:
    """Young's optimum seconds of training between saves: sqrt(2 * stall * mtbf)."""
    if stall <= 0 or mtbf <= 0:
        raise UsageError(f"a save's stall and the MTBF must be > 0 seconds (got {stall} s, {mtbf} s)")
    return math.sqrt(2 * stall * mtbf)


@dataclass(frozen=True)
class Loss:
    """The fraction of wall time lost at one save interval, split by cause."""

    interval: float
    saves: float  # stall / interval
    rework: float  # (interval / 2 + lag) / mtbf
    restart: float  # restart / mtbf

    @property
    def total(self) -> float:
        """Every cause together."""
        return self.saves + self.rework + self.restart


def lost_fraction(interval: float, stall: float, mtbf: float, *, lag: float = 0.0, restart: float = 0.0) -> Loss:
    """The fraction of time lost when saving every `interval` s (see the module's docstring for each term)."""
    if interval <= 0:
        raise UsageError(f"the save interval must be > 0 seconds (got {interval} s)")
    return Loss(interval, stall / interval, (interval / 2 + lag) / mtbf, restart / mtbf)


def loss_curve(stall: float, mtbf: float, *, lag: float = 0.0, restart: float = 0.0,
               points: int = 61) -> list[Loss]:
    """`lost_fraction` at intervals spaced evenly on a log scale, 100x either side of the optimum."""
    best = optimal_interval(stall, mtbf)
    return [lost_fraction(best * 10 ** (4 * i / (points - 1) - 2), stall, mtbf, lag=lag, restart=restart)
            for i in range(points)]
