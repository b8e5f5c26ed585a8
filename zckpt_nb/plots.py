"""Matplotlib figures for the notebooks. Every figure has a title, axes with units and a caption."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zckpt_nb.inspect import CheckpointInfo


def add_caption(fig: Figure, caption: str) -> Figure:
    """Write `caption` under the axes, wrapped, so a saved figure explains itself."""
    fig.text(0.01, -0.02, caption, ha="left", va="top", wrap=True, fontsize=9)
    return fig


def plot_losses(curves: dict[str, tuple[Sequence[int], Sequence[float]]], *, title: str, caption: str,
                ref: float | None = None) -> Figure:
    """Training loss against step for one or more runs; `ref` draws ln(vocab) as a dashed line."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (name, (steps, losses)) in enumerate(curves.items()):
        style = {"lw": 3, "alpha": 0.35} if i == 0 else {"lw": 1.2, "ls": "--", "marker": ".", "ms": 3}
        ax.plot(steps, losses, label=name, **style)
    if ref is not None:
        ax.axhline(ref, color="grey", ls=":", label=f"ln(vocab) = {ref:.2f}")
    ax.set(title=title, xlabel="optimizer step (count)", ylabel="training loss (nats per token)")
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
    ax.legend()
    return add_caption(fig, caption)


def plot_partition_numel(infos: Sequence[CheckpointInfo], *, title: str, caption: str) -> Figure:
    """Parameter elements held per rank for several world sizes, with P/N marked."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for info in infos:
        xs = [f"N={info.world_size}\nrank {s.rank}" for s in info.ranks]
        ax.bar(xs, [s.partition_numel for s in info.ranks], label=f"N = {info.world_size}")
        ax.hlines(info.num_params / info.world_size, xs[0], xs[-1], colors="black", linestyles=":")
    ax.set(title=title, xlabel="world size and rank", ylabel="parameter elements held (count)")
    ax.legend()
    return add_caption(fig, caption)


def table(rows: list[dict[str, object]]) -> object:
    """Render a list of dicts as a Markdown table in the notebook (numbers with thousands separators)."""
    from IPython.display import Markdown

    def cell(v: object) -> str:
        return f"{v:,}" if isinstance(v, int) else f"{v:.6g}" if isinstance(v, float) else str(v)

    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r[k]) for k in head) + " |" for r in rows]
    return Markdown("\n".join(lines))


def plot_save_outcomes(steps: Sequence[int], losses: Sequence[float], saves: Sequence[dict], *, title: str,
                       caption: str) -> Figure:
    """Loss against step, with every save marked where it happened: committed or failed."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(steps, losses, lw=1.5, label="training loss")
    by_step = dict(zip(steps, losses))
    for ok, marker, color, name in ((True, "^", "tab:green", "save committed"), (False, "X", "tab:red", "save failed")):
        xs = [s["step"] - 1 for s in saves if s["committed"] == ok]  # a save at step k follows step index k-1
        ax.scatter(xs, [by_step[x] for x in xs], marker=marker, s=90, color=color, label=name, zorder=3)
    ax.set(title=title, xlabel="optimizer step (count)", ylabel="training loss (nats per token)")
    ax.legend()
    return add_caption(fig, caption)


def plot_save_timings(saves: Sequence[dict], *, title: str, caption: str) -> Figure:
    """Seconds of each save split into its phases (DeepSpeed's write, fsync, SHA-256, agreement and commit)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    tags = [s["tag"] for s in saves]
    bottom = [0.0] * len(tags)
    for phase in ("write", "fsync", "hash", "protocol"):
        ms = [s["timings"].get(phase, 0.0) * 1000 for s in saves]
        ax.bar(tags, ms, bottom=bottom, label=phase)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set(title=title, xlabel="checkpoint tag", ylabel="time on rank 0 (ms)")
    ax.legend()
    return add_caption(fig, caption)
