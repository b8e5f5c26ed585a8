"""Matplotlib figures for the notebooks. Every figure has a title, axes with units and a caption.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from zckpt_nb.convert.inspect import CheckpointInfo
from zckpt_nb.format.records import Route


def add_caption(fig: Figure, caption: str) -> Figure:
    """Write `caption` under the axes, wrapped, so a saved figure explains itself.

    `tight_layout` first pulls tick and axis labels inside the figure, so the caption below it never overlaps them.
    """
    fig.tight_layout()
    fig.text(0.01, -0.01, caption, ha="left", va="top", wrap=True, fontsize=9)
    return fig


def plot_losses(curves: dict[str, tuple[Sequence[int], Sequence[float]]], *, title: str, caption: str,
                ref: float | None = None, ylabel: str = "training loss (nats per token)",
                first_color: int = 0) -> Figure:
    """Training loss (or another per-step figure, `ylabel`) against step for one or more runs; `ref`: ln(vocab).
    The first curve is drawn thick as the reference, unless `first_color` > 0: then the curves are the runs after
    the reference of an earlier plot, drawn alike in colours C{first_color}, ... so each run keeps its colour."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (name, (steps, losses)) in enumerate(curves.items()):
        style = ({"lw": 3, "alpha": 0.35} if i == 0 and not first_color else
                 {"lw": 1.2, "ls": "--", "marker": ".", "ms": 3})
        ax.plot(steps, losses, label=name, color=f"C{i + first_color}", **style)
    if ref is not None:
        ax.axhline(ref, color="grey", ls=":", label=f"ln(vocab) = {ref:.2f}")
    ax.set(title=title, xlabel="optimizer step (count)", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.legend()
    return add_caption(fig, caption)


def plot_shard_bytes(info: CheckpointInfo, *, title: str, caption: str) -> Figure:
    """Bytes each rank wrote, stacked by file kind (model states, optimizer states)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ranks = [f"rank {s.rank}" for s in info.ranks]
    bottom = [0.0] * len(ranks)
    for kind in ("model_states", "optim_states"):
        sizes = [sum(b for n, b in s.files.items() if kind in n) / 2**20 for s in info.ranks]
        ax.bar(ranks, sizes, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + s for b, s in zip(bottom, sizes)]
    ax.set(title=title, xlabel="rank", ylabel="bytes written (MiB)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never over them
    return add_caption(fig, caption)


def plot_partition_numel(infos: Sequence[CheckpointInfo], *, title: str, caption: str) -> Figure:
    """Parameter elements held per rank for several world sizes, with P/N marked."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for info in infos:
        xs = [f"N={info.world_size}\nrank {s.rank}" for s in info.ranks]
        bars = ax.bar(xs, [s.partition_numel for s in info.ranks], label=f"N = {info.world_size}")
        left, right = bars[0].get_x(), bars[-1].get_x() + bars[-1].get_width()  # across the bars, one bar too
        ax.hlines(info.num_params / info.world_size, left, right, colors="black", linestyles=":", lw=1.5, zorder=3)
    ax.set(title=title, xlabel="world size and rank", ylabel="parameter elements held (count)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return add_caption(fig, caption)


def plot_save_outcomes(steps: Sequence[int], losses: Sequence[float], saves: Sequence[dict], *, title: str,
                       caption: str) -> Figure:
    """Loss against step, with every save marked where it happened: committed or failed."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    done = [s + 1 for s in steps]  # steps as the log counts them: "step k" is the k-th update, and a save follows it
    ax.plot(done, losses, lw=1.5, label="training loss")
    by_step = dict(zip(done, losses))
    for ok, marker, color, name in ((True, "^", "tab:green", "save committed"), (False, "X", "tab:red", "save failed")):
        xs = [s["step"] for s in saves if s["committed"] == ok]
        ax.scatter(xs, [by_step[x] for x in xs], marker=marker, s=90, color=color, label=name, zorder=3)
    ax.set(title=title, xlabel="optimizer step (count)", ylabel="training loss (nats per token)")
    ax.legend()
    return add_caption(fig, caption)


def plot_save_timings(saves: Sequence[dict], *, title: str, caption: str) -> Figure:
    """Seconds of each save split into its phases (DeepSpeed's write, fsync, agreement and commit), stacked; beside
    them, the SHA-256 time, which ran on the writer's thread during the write."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = list(range(len(saves)))
    bottom = [0.0] * len(saves)
    for phase in ("write", "fsync", "protocol"):
        ms = [s["timings"].get(phase, 0.0) * 1000 for s in saves]
        ax.bar([x - 0.15 for x in xs], ms, width=0.5, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.bar([x + 0.3 for x in xs], [s["timings"].get("hash", 0.0) * 1000 for s in saves], width=0.2, color="grey",
           hatch="//", label="SHA-256 (beside the write)")
    ax.set_xticks(xs, [s["tag"] for s in saves])
    ax.set(title=title, xlabel="checkpoint tag", ylabel="time on rank 0 (ms)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: inside it covers a bar
    return add_caption(fig, caption)


def plot_save_costs(costs: Sequence[dict], *, title: str, caption: str) -> Figure:
    """Six panels of grouped bars, one group per route and one bar per rank: time, extra peak RSS, extra peak heap
    allocations, bytes written, bytes read, bytes moved by collectives (as DeepSpeed's comms logger recorded them)."""
    modes = [m for m in Route if any(c["mode"] == m for c in costs)]
    ranks = sorted({c["rank"] for c in costs})
    last = {(c["mode"], c["rank"]): c for c in costs}  # the newest save of each (mode, rank)
    panels = [("seconds", 1, "wall time (s)"), ("extra_peak_bytes", 2**20, "extra peak RSS (MiB)"),
              ("heap_extra_peak_bytes", 2**20, "extra peak heap allocations (MiB)"),
              ("bytes_written", 2**20, "bytes written (MiB)"), ("bytes_read", 2**20, "checkpoint bytes read (MiB)"),
              ("comm_bytes", 2**20, "collective bytes logged (MiB)")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 6.6))
    width = 0.8 / len(ranks)
    for ax, (key, scale, ylabel) in zip(axes.flat, panels):
        for i, rank in enumerate(ranks):
            values = [((last.get((m, rank)) or {}).get(key) or 0) / scale for m in modes]
            ax.bar([x + i * width for x in range(len(modes))], values, width, label=f"rank {rank}")
        ax.set_xticks([x + width * (len(ranks) - 1) / 2 for x in range(len(modes))], modes, rotation=20, fontsize=8)
        ax.set(title=ylabel.split(" (")[0], xlabel="route", ylabel=ylabel)
    axes.flat[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return add_caption(fig, caption)


def plot_bytes_by_kind(parts: dict[str, dict[str, int]], *, title: str, caption: str) -> Figure:
    """One stacked bar per checkpoint layout (e.g. a save and its universal copy), split by kind of file."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    kinds = sorted({k for part in parts.values() for k in part})
    bottom = [0.0] * len(parts)
    for kind in kinds:
        sizes = [part.get(kind, 0) / 2**20 for part in parts.values()]
        ax.bar(list(parts), sizes, bottom=bottom, label=kind)
        bottom = [b + s for b, s in zip(bottom, sizes)]
    ax.set(title=title, xlabel="checkpoint layout", ylabel="bytes on disk (MiB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return add_caption(fig, caption)


def plot_rss_traces(records: Sequence[dict], baseline_bytes: float, model_bytes: int, *, title: str,
                    caption: str) -> Figure:
    """Resident memory above the interpreter's baseline over time, one line per offline route and shard size."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    styles = {}
    for r in records:
        t = r["trace"]
        style = styles.setdefault(r["shard_size"], ["-", "--", ":", "-."][len(styles) % 4])
        color = "tab:blue" if r["route"] == "export" else "tab:red"
        rss = [(a + f - baseline_bytes) / 2**20 for a, f in zip(t["anon"], t["file"])]
        ax.plot(t["seconds"], rss, ls=style, color=color, label=f"{r['route']}, --max_shard_size {r['shard_size']}")
    ax.axhline(model_bytes / 2**20, color="grey", ls=":", label="the model in fp32 (P x 4 B)")
    top = 1.1 * max([model_bytes / 2**20] + [max(line.get_ydata()) for line in ax.get_lines()])
    ax.set_ylim(-0.1 * top, top)  # the start-up, below the baseline, would squash the peaks: cut it off
    ax.set(title=title, xlabel="seconds since the process started (s)",
           ylabel="RSS above the baseline (MiB)")
    ax.legend(fontsize=8)
    return add_caption(fig, caption)
