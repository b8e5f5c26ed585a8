"""Matplotlib figures for the notebooks. Every figure has a title, axes with units and a caption.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from zckpt_nb.convert.inspect import CheckpointInfo
from zckpt_nb.format.records import Route
from zckpt_nb.lessons.compare import IN_GPU_RANKS


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


def _paired_bars(ax, labels: list[str], first: list[float], second: list[float] | None, names: tuple[str, str],
                 legend: bool = True) -> None:
    """Bars for `first` (and `second` beside it, when given) over the same labels; `legend`: one in the axes."""
    xs = range(len(labels))
    width = 0.4 if second is not None else 0.8
    ax.bar([x - (width / 2 if second is not None else 0) for x in xs], first, width, label=names[0])
    if second is not None:
        ax.bar([x + width / 2 for x in xs], second, width, label=names[1])
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    if legend:
        ax.legend(fontsize=7)


def plot_compare(records: list[dict], *, title: str, caption: str) -> Figure:
    """Four panels per (mode, N, rank): bytes written, peak memory, seconds, collective bytes; predicted vs measured."""
    labels = [f"{r['mode']} N={r['world_size']} " + ("process" if r["mode"] not in IN_GPU_RANKS else f"r{r['rank']}")
              for r in records]  # the offline routes run in one process after training, not on a rank
    kib, mib = 2**10, 2**20
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    (a, b), (c, d) = axes
    _paired_bars(a, labels, [r["predicted_bytes"] / kib for r in records],
                 [r["measured_payload_bytes"] / kib for r in records], ("predicted", "measured payload"), False)
    a.set(title="Bytes written per rank", ylabel="bytes written (KiB)")
    _paired_bars(b, labels, [r["predicted_extra_peak_bytes"] / mib for r in records],
                 [r["measured_extra_peak_bytes"] / mib for r in records], ("predicted", "measured"), False)
    kind = records[0].get("measured_memory_kind", "host heap") if records else "host heap"  # never CUDA bytes
    b.set(title="Extra host memory at the save's peak, per rank", ylabel=f"extra peak {kind} (MiB)")
    _paired_bars(c, labels, [r["seconds"] for r in records], None, ("wall time", ""), False)
    for bar in c.patches:  # measured only: the colour of the measured bars
        bar.set_color("C1")
    c.set(title="Time per rank, measured", ylabel="wall time (s)")
    _paired_bars(d, labels, [r["predicted_comm_bytes"] / kib for r in records],
                 [(r["logged_comm_bytes"] or 0) / kib for r in records], ("predicted", "comms logger"), False)
    d.set(title="Bytes moved by collectives per rank", ylabel="collective bytes (KiB)")
    for ax in axes.flat:
        ax.set_xlabel("save mode, world size, rank (or the one process of an offline route)")
    fig.suptitle(title)
    from matplotlib.patches import Patch

    # one legend for the four panels, beside the top right one: never over a bar (each y label names the kind)
    b.legend(handles=[Patch(color="C0", label="cost model\n(left bar)"),
                      Patch(color="C1", label="measured\n(right bar)")], loc="upper left", bbox_to_anchor=(1.01, 1),
             fontsize=8)
    return add_caption(fig, caption)


def plot_against_model(summary: Sequence[dict], model_bytes: int, *, title: str, caption: str) -> Figure:
    """Per route, what was gathered, broadcast, allocated on rank 0 and written by rank 0, in units of the full
    model (P x bytes per parameter): the seed's table predicts 1 for a consolidated save."""
    mib = model_bytes / 2**20
    metrics = {"all-gathered": lambda r: r["all-gathered / model"], "broadcast": lambda r: r["broadcast / model"],
               "rank-0 extra heap": lambda r: (r["extra heap MiB, rank 0"] if r["extra heap MiB, rank 0"] != "-"
                                               else 0) / mib,
               "rank-0 written": lambda r: r["written MiB, rank 0"] / mib}
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(metrics)
    for i, (name, value) in enumerate(metrics.items()):
        ax.bar([x + i * width for x in range(len(summary))], [value(r) for r in summary], width, label=name)
    ax.set_xticks([x + width * (len(metrics) - 1) / 2 for x in range(len(summary))], [r["route"] for r in summary])
    ax.axhline(1.0, color="black", ls=":", lw=1, label="one full model (P x 4 B)")
    ax.set(title=title, xlabel="route", ylabel="bytes / full model bytes (ratio)")
    ax.legend(fontsize=8, ncol=2)
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


def plot_stall(records: list[dict], *, title: str, caption: str) -> Figure:
    """Per save mode and rank, the median over its saves: seconds training stopped, and seconds until durable."""
    labels = list(dict.fromkeys(f"{r['mode']} r{r['rank']}" for r in records))

    def med(label: str, key: str) -> float:
        values = [r[key] for r in records if f"{r['mode']} r{r['rank']}" == label and r[key] is not None]
        return median(values) if values else 0.0  # 0: never durable (DeepSpeed's plain save)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    _paired_bars(ax, labels, [med(x, "stall_seconds") for x in labels], [med(x, "durable_seconds") for x in labels],
                 ("training stopped", "until durable (0: never)"))
    ax.set(title=title, xlabel="save mode and rank", ylabel="median over saves (s)")
    return add_caption(fig, caption)


def plot_save_timeline(runs: dict[str, dict], *, title: str, caption: str) -> Figure:
    """Per save mode (one panel) and rank (one lane), the training loop on that rank's clock: step starts (ticks),
    each save's stall (red) and, below it, the time until that save was durable (orange)."""
    from matplotlib.patches import Patch

    lanes = sum(len(run["ranks"]) for run in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.2 + 0.7 * lanes), sharex=True, squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        for y, rank in enumerate(run["ranks"]):
            saves = rank["saves"]
            ax.broken_barh([(0, rank["loop_seconds"])], (y - 0.25, 0.5), color="lightgray")
            ax.vlines(rank["step_starts"], y - 0.25, y + 0.25, color="dimgray", lw=0.6)
            stalls = [(s["started_at"], s["stall_seconds"]) for s in saves]  # and a later step's wait (decoupled)
            stalls += [(s["commit_wait_at"], s["commit_wait_seconds"]) for s in saves if "commit_wait_at" in s]
            ax.broken_barh(stalls, (y - 0.25, 0.5), color="tab:red")
            ax.broken_barh([(s["started_at"], s["durable_seconds"]) for s in saves if s["durable_seconds"]],
                           (y - 0.42, 0.12), color="tab:orange")
        ax.set_yticks(range(len(run["ranks"])), [f"rank {r['rank']}" for r in run["ranks"]])
        ax.set_title(f"--save_mode {mode}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the training loop began on each rank (s)")
    axes[0, 0].legend(handles=[Patch(color="lightgray", label="training (ticks: step starts)"),
                               Patch(color="tab:red", label="stall: training stopped by the save"),
                               Patch(color="tab:orange", label="save call until durable")],
                      fontsize=7, loc="upper right", bbox_to_anchor=(1, 1.6), ncol=3)
    fig.suptitle(title)
    fig.tight_layout()
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
