"""The figures several notebooks draw. Every figure has a title, axes with units and a caption under it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter


def caption(fig: Figure, text: str) -> Figure:
    """Write `text` under the axes, wrapped, so a saved figure explains itself (after `tight_layout`, so the caption
    never overlaps a tick label)."""
    fig.tight_layout()
    fig.text(0.01, -0.01, text, ha="left", va="top", wrap=True, fontsize=9)
    return fig


def rank_bars(values: Mapping[str, Sequence[float]], labels: Sequence[str], *, title: str, ylabel: str, note: str,
              xlabel: str = "rank", stacked: bool = False, lines: Mapping[str, float] | None = None) -> Figure:
    """Bars per rank (or any group in `labels`): one series per key of `values`, side by side or `stacked`;
    `lines`: labelled horizontal references (a prediction, P/N)."""
    fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(labels) + 4), 3.4))
    xs = range(len(labels))
    width = 0.8 if stacked else 0.8 / max(1, len(values))
    bottom = [0.0] * len(labels)
    for i, (name, ys) in enumerate(values.items()):
        shift = 0.0 if stacked else (i - (len(values) - 1) / 2) * width
        ax.bar([x + shift for x in xs], ys, width=width, bottom=bottom if stacked else None, label=name)
        if stacked:
            bottom = [b + y for b, y in zip(bottom, ys)]
    for i, (name, y) in enumerate((lines or {}).items()):
        ax.axhline(y, color="black", ls=(":", "--", "-.")[i % 3], lw=1.2, label=name)
    ax.set_xticks(list(xs), list(labels))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if max((max(ys, default=0) for ys in values.values()), default=0) >= 1000:
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))  # counts as the tables write them
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return caption(fig, note)
