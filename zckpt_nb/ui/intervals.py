"""The save-interval figure of notebook 06: the fraction of time lost against the interval, each optimum marked."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from zckpt_nb.plan.interval import Loss
from zckpt_nb.ui.plots import add_caption


def plot_lost_time(curves: dict[str, list[Loss]], *, title: str, caption: str) -> Figure:
    """Per save mode, the percent of time lost (saves + rework + restarts) against the save interval, both axes on
    a log scale (the curves of modes with close stalls nearly coincide), with each curve's minimum marked."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for mode, curve in curves.items():
        best = min(curve, key=lambda c: c.total)
        # the optimum named in the legend, not beside its dot: curves of close stalls run through each other's dots
        line, = ax.plot([c.interval for c in curve], [100 * c.total for c in curve],
                        label=f"{mode}: optimum every {best.interval:,.0f} s")
        ax.plot(best.interval, 100 * best.total, "o", color=line.get_color())
    ax.set(xscale="log", yscale="log", title=title, xlabel="seconds of training between saves (s, log scale)",
           ylabel="time lost (% of wall time, log)")
    # plain percentages, not powers of ten, on the log axis; on a short axis also 2 and 5 times each power of ten
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
    between = FuncFormatter(lambda v, _: f"{v:g}%" if f"{v:.0e}"[0] in "25" else "")
    ax.yaxis.set_minor_formatter(between if ax.get_ylim()[1] / ax.get_ylim()[0] < 100 else NullFormatter())
    ax.legend(loc="upper center")  # between the curves' two ends, which rise away from the minimum
    return add_caption(fig, caption)
