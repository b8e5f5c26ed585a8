"""Notebook 03's figures: what each checkpoint's files hold, and what each kind of load brought back.
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zckpt_nb.lessons.contents import KINDS
from zckpt_nb.ui.plots import add_caption


def plot_holdings(rows: list[dict[str, Any]], *, title: str, caption: str) -> Figure:
    """MiB of each checkpoint (every rank summed), stacked by what the bytes hold."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    names = [r["checkpoint"] for r in rows]
    bottom = [0.0] * len(rows)
    for kind in KINDS:
        sizes = [r[kind] for r in rows]
        ax.bar(names, sizes, bottom=bottom, label=kind.replace(" (MiB)", ""))
        bottom = [b + s for b, s in zip(bottom, sizes)]
    ax.set(title=title, xlabel="checkpoint", ylabel="bytes on disk, all ranks (MiB)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    return add_caption(fig, caption)


def plot_restored(grid: dict[str, dict[str, bool | None]], *, title: str, caption: str) -> Figure:
    """A grid: each load (row) against each part of the training state (column): back as saved, not, or n/a."""
    loads, parts = list(grid), list(next(iter(grid.values())))
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(loads) + 1.4))
    colours = {True: "#4caf50", False: "#e53935", None: "#e0e0e0"}
    words = {True: "as saved", False: "not restored", None: "nothing frozen"}
    for i, load in enumerate(loads):
        for j, part in enumerate(parts):
            value = grid[load][part]
            ax.add_patch(plt.Rectangle((j, i), 0.96, 0.92, color=colours[value]))
            ax.text(j + 0.48, i + 0.46, words[value], ha="center", va="center", fontsize=8)
    ax.set(xlim=(0, len(parts)), ylim=(len(loads), 0), title=title)
    ax.set_xticks([j + 0.48 for j in range(len(parts))], parts)
    ax.set_yticks([i + 0.46 for i in range(len(loads))], loads)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return add_caption(fig, caption)
