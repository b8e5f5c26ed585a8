"""The save-interval calculator: Young's optimum is the minimum of the lost fraction, and bad input is refused."""

from __future__ import annotations

import math

import pytest

from zckpt_nb.errors import UsageError
from zckpt_nb.plan.interval import job_mtbf_seconds, loss_curve, lost_fraction, optimal_interval

pytestmark = pytest.mark.fast


def test_the_optimum_is_the_smallest_loss_on_a_fine_grid():
    stall, mtbf = 0.7, job_mtbf_seconds(50_000, 1024)
    best = optimal_interval(stall, mtbf)
    curve = loss_curve(stall, mtbf, lag=3.0, restart=120.0, points=401)
    assert min(curve, key=lambda loss: loss.total).interval == pytest.approx(best, rel=0.03)
    at_best = lost_fraction(best, stall, mtbf, lag=3.0, restart=120.0)
    # at the optimum the saves and the half-interval of rework cost the same
    assert at_best.saves == pytest.approx(at_best.rework - 3.0 / mtbf)
    assert at_best.total == pytest.approx(at_best.saves + at_best.rework + at_best.restart)


def test_four_times_the_gpus_halves_the_interval():
    stall = 2.0
    one, four = (optimal_interval(stall, job_mtbf_seconds(10_000, g)) for g in (256, 1024))
    assert four / one == pytest.approx(0.5)
    assert one == pytest.approx(math.sqrt(2 * stall * 10_000 * 3600 / 256))


@pytest.mark.parametrize("call", [lambda: optimal_interval(0, 10), lambda: job_mtbf_seconds(-1, 8),
                                  lambda: job_mtbf_seconds(100, 0), lambda: lost_fraction(0, 1, 1)])
def test_bad_input_is_refused_in_one_line(call):
    with pytest.raises(UsageError) as e:
        call()
    assert "\n" not in str(e.value)
