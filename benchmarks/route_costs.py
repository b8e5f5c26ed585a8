"""What each route to one full model cost, summarised per route (rank 0 against the others), and the principle's
table row by row against the measurements: the tables benchmarks/consolidation_costs.py prints."""

from __future__ import annotations

from typing import Any

from zckpt_nb.format.records import Route

FP32_BYTES = 4  # the offline route and the export write fp32 masters
WORKING_ROUTES = ("gathered16", "per_param")  # routes 1-2: the weights the engine computes with, in the run's dtype
MASTER_ROUTES = ("offline", "hf")  # routes 3-4: the optimizer's fp32 master weights


def last_per_rank(costs: list[dict[str, Any]], mode: str) -> dict[int, dict[str, Any]]:
    """The newest record of `mode` for each rank (a run with --save_every has several partitioned saves)."""
    return {c["rank"]: c for c in costs if c["mode"] == mode}


def op_bytes(cost: dict[str, Any], prefix: str) -> int:
    """Logged bytes of the collectives whose name starts with `prefix` (e.g. 'all_gather', 'broadcast')."""
    return sum(o["bytes"] for name, o in cost["comm_ops"].items() if name.startswith(prefix))


def largest(records: list[dict[str, Any]], key: str, scale: float = 1.0, digits: int = 3) -> float | str:
    """The largest `key` over `records`, scaled and rounded; '-' when there are none or it was not measured."""
    values = [c.get(key) for c in records]
    if not values or None in values:
        return "-"
    return round(max(values) / scale, digits)


def cost_summary(costs: list[dict[str, Any]], num_params: int, param_bytes: int = 4) -> list[dict[str, Any]]:
    """One row per route: rank 0 against the other ranks, and bytes moved or written against the full model.

    "all-gathered" adds every rank's logged slice, i.e. the bytes each rank ends up receiving once assembled;
    "broadcast" is rank 0's logged tensor bytes. Both are divided by the full model the route moves: P x
    `param_bytes` (the run's working dtype, `bytes_per_param`) for the in-job routes, P x 4 for the fp32 masters.
    """
    rows, m = [], 2**20
    for mode in Route:
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        full = num_params * (FP32_BYTES if mode in MASTER_ROUTES else param_bytes)
        r0, others = [by_rank[0]], [c for r, c in by_rank.items() if r != 0]
        rows.append({
            "route": mode, "seconds, rank 0": largest(r0, "seconds"),
            "seconds, other ranks": largest(others, "seconds"),
            "extra RSS MiB, rank 0": largest(r0, "extra_peak_bytes", m, 1),
            "extra RSS MiB, other ranks": largest(others, "extra_peak_bytes", m, 1),
            "extra heap MiB, rank 0": largest(r0, "heap_extra_peak_bytes", m, 1),
            "extra heap MiB, other ranks": largest(others, "heap_extra_peak_bytes", m, 1),
            "written MiB, rank 0": largest(r0, "bytes_written", m, 2),
            "written MiB, other ranks": largest(others, "bytes_written", m, 2),
            "read MiB": largest(r0, "bytes_read", m, 2),
            "all-gathered / model": round(sum(op_bytes(c, "all_gather") for c in by_rank.values()) / full, 3),
            "broadcast / model": round(op_bytes(r0[0], "broadcast") / full, 3),
            "collective ops, rank 0": sum(o["count"] for o in r0[0]["comm_ops"].values()),
        })
    return rows


def mib(n: float) -> str:
    """Bytes as MiB, for sentences."""
    return f"{n / 2**20:,.2f} MiB"


# The principle's table, verbatim: (scenario, approach, memory required, communication). Routes map to its rows:
# the in-job gathers and the offline conversion are consolidated saves; the HF export is its cross-framework export.
SEED_ROWS = {
    "partitioned": ("Training resumption", "Partitioned save", "P/N per rank", "None (each rank saves locally)"),
    "gathered16": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "per_param": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "offline": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "hf": ("Cross-framework export", "Consolidated + conversion", "Full P on rank 0",
           "All-gather + format conversion"),
}


def memory_agrees(mode: str, by_rank: dict[int, dict[str, Any]], full: int) -> bool:
    """The table's memory claim against the measured heap peaks: P/N per rank, or the full P on rank 0 only."""
    heap = {r: c.get("heap_extra_peak_bytes") or c["extra_peak_bytes"] for r, c in by_rank.items()}
    if mode == "partitioned":  # no rank needs more than its own share (fp32 weights + Adam: 12 B per element)
        return max(heap.values()) <= 3 * full / len(by_rank)
    return heap[0] >= 0.9 * full and all(v < 0.5 * full for r, v in heap.items() if r)


def comm_agrees(mode: str, by_rank: dict[int, dict[str, Any]], full: int) -> str:
    """The table's communication claim against DeepSpeed's logged collectives: 'yes', 'no', or for a partitioned
    save that moved under 1% of the model (DeepSpeed's tag checks), 'imprecise' with the bytes."""
    if mode == "partitioned":
        moved = max((c["comm_bytes"] or 0) for c in by_rank.values())
        return "yes" if moved == 0 else f"imprecise: {moved:,} B per rank" if moved < 0.01 * full else "no"
    return "yes" if sum(op_bytes(c, "all_gather") for c in by_rank.values()) >= 0.99 * full else "no"


def seed_vs_measured(costs: list[dict[str, Any]], num_params: int, param_bytes: int = 4) -> list[dict[str, Any]]:
    """The principle's table row by row, what was measured, and whether each claim held (computed)."""
    rows = []
    for mode, (scenario, approach, memory, comm) in SEED_ROWS.items():
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        full = num_params * (param_bytes if mode in WORKING_ROUTES else FP32_BYTES)
        got = (partitioned_line(by_rank, num_params) if mode == "partitioned"
               else gathered_line(by_rank, full) if mode in ("gathered16", "per_param")
               else offline_line(by_rank[0]))
        rows.append({"route": mode, "the principle's row": f"{scenario}: {approach}", "memory it states": memory,
                     "memory claim holds?": "yes" if memory_agrees(mode, by_rank, full) else "no",
                     "communication it states": comm,
                     "communication claim holds?": comm_agrees(mode, by_rank, full), "measured": got})
    return rows


def heap_mib(cost: dict[str, Any]) -> str:
    """A record's extra peak heap as '+x.x MiB' (one decimal, as `ROUTE_COLUMNS` shows heap)."""
    return f"+{(cost.get('heap_extra_peak_bytes') or 0) / 2**20:,.1f} MiB"


def partitioned_line(by_rank: dict[int, dict[str, Any]], num_params: int) -> str:
    """Measured figures of the partitioned save, against P/N x 12 bytes per rank."""
    files = ", ".join(mib(by_rank[r]["bytes_written"]) for r in sorted(by_rank))
    return (f"rank files {files} (P/N x 12 B of fp32 weights and Adam moments = "
            f"{mib(12 * num_params / len(by_rank))}); collectives {by_rank[0]['comm_bytes']} B")


def gathered_line(by_rank: dict[int, dict[str, Any]], full: int) -> str:
    """Measured figures of routes 1 and 2, against the full model on rank 0 and one all-gather of it."""
    r0, others = by_rank[0], [c for r, c in by_rank.items() if r]
    gathered = sum(op_bytes(c, "all_gather") for c in by_rank.values())
    gathers = r0["comm_ops"].get("all_gather_into_tensor", {})
    largest = gathers.get("max_bytes", 0) * len(by_rank)  # the logger records one rank's slice
    other_heap = f"; other ranks {heap_mib(max(others, key=lambda c: c.get('heap_extra_peak_bytes') or 0))}" * bool(
        others)
    return (f"rank 0 wrote {mib(r0['bytes_written'])} (full P = {mib(full)}), heap peak {heap_mib(r0)}{other_heap}; "
            f"all-gathered {gathered / full:.2f} x P in {gathers.get('count', 0)} ops, largest {mib(largest)}; "
            f"broadcast {op_bytes(r0, 'broadcast') / full:.2f} x P")


def offline_line(r0: dict[str, Any]) -> str:
    """Measured figures of routes 3 and 4: no communication, every shard read."""
    return (f"collectives {r0['comm_bytes']} B; read {mib(r0['bytes_read'])} of shards; wrote "
            f"{mib(r0['bytes_written'])}; RSS peak +{mib(r0['extra_peak_bytes'])}, heap peak {heap_mib(r0)}")


def text_table(rows: list[dict[str, Any]]) -> str:
    """Rows as aligned plain text for a terminal (a benchmark's tables may be wider than a notebook's)."""
    cells = [[f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v) for v in r.values()] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(list(rows[0]), *cells)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [list(rows[0]), *cells])
