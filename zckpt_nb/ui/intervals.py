"""The save-interval figure of notebook 06: the fraction of time lost against the interval, each optimum marked."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zckpt_nb.plan.interval import Loss
from zckpt_nb.ui.plots import add_caption


def plot_lost_time(curves: dict[str, list[Loss]], *, title: str, caption: str) -> Figure:
    """Per save mode, the percent of time lost (saves + rework + restarts) against the save interval, both axes on
    a log scale (the curves of modes with close stalls nearly coincide), with each curve's minimum marked."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (mode, curve) in enumerate(curves.items()):
        line, = ax.plot([c.interval for c in curve], [100 * c.total for c in curve], label=mode)
        best = min(curve, key=lambda c: c.total)
        ax.plot(best.interval, 100 * best.total, "o", color=line.get_color())
        ax.annotate(f"{mode}: {best.interval:,.0f} s", (best.interval, 100 * best.total), textcoords="offset points",
                    xytext=(-6, 8) if i % 2 else (6, -12), ha="right" if i % 2 else "left", fontsize=8,
                    color=line.get_color())  # one label above left, the next below right: apart, not over
    lowest = min(100 * c.total for curve in curves.values() for c in curve)
    ax.set_ylim(bottom=0.7 * lowest)  # room for the labels below the minima
    ax.set(xscale="log", yscale="log", title=title, xlabel="seconds of training between saves (s, log scale)",
           ylabel="time lost (% of wall time, log)")
    ax.legend(loc="lower left")  # below the curves, which rise at both ends
    return add_caption(fig, caption)
