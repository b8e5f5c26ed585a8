"""Notebook 06's view of `compare` records: one row per (mode, N, rank), one number per column, units in headers."""

from __future__ import annotations

from typing import Any

KIB = 1024


def compare_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes written and moved by collectives, predicted beside measured, and the save's wall time (8 columns)."""
    return [{"mode": r["mode"], "N": r["world_size"], "rank": r["rank"],
             "written KiB, predicted": r["predicted_bytes"] / KIB,
             "written KiB, tensor payload": r["measured_payload_bytes"] / KIB,
             "collective KiB, predicted": r["predicted_comm_bytes"] / KIB,
             "collective KiB, logged": (r["logged_comm_bytes"] or 0) / KIB,
             "save s": float(r["seconds"])} for r in records]


def ops_named(record: dict[str, Any]) -> str:
    """The collective ops DeepSpeed's comms logger recorded for one save, with their counts, or 'none'."""
    ops = record["logged_comm_ops"]
    return ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) if ops else "none"


def principle_sentence(records: list[dict[str, Any]]) -> str:
    """The principle's table ('partitioned save: no communication; consolidated: an all-gather') against the
    collectives DeepSpeed logged on rank 0 at the largest world size measured."""
    n = max(r["world_size"] for r in records)
    at_n = {r["mode"]: r for r in records if r["world_size"] == n and r["rank"] == 0}
    parts = []
    if "partitioned" in at_n:
        r = at_n["partitioned"]
        moved = r["logged_comm_bytes"] or 0
        parts.append("a partitioned save needs no communication: " + (
            "confirmed, rank 0 logged none" if not moved else
            f"imprecise, rank 0 logged {moved:,} B in DeepSpeed's collectives during it ({ops_named(r)}; the cost "
            f"model predicted {r['predicted_comm_bytes']:,} B): every rank must reach them, so even this save waits "
            "for all ranks"))
    for mode in ("gathered16", "per_param"):
        if mode in at_n:
            r = at_n[mode]
            parts.append(f"{mode} logged {(r['logged_comm_bytes'] or 0) / KIB:,.1f} KiB on rank 0 in {ops_named(r)}")
    if not parts:
        return "No in-training save mode was compared, so the principle's table is not checked here."
    return f"The principle's table at N = {n}: " + "; ".join(parts) + "."


def memory_kind(records: list[dict[str, Any]]) -> str:
    """What the measured extra peak of these records is: the host heap on CPU ranks, as `compare.record` labels it."""
    return next((r["measured_memory_kind"] for r in records if r.get("measured_memory_kind")), "host heap")


def memory_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (mode, N, rank): the cost model's extra peak beside the measured one, in MiB, and their ratio."""
    kind = memory_kind(records)
    return [{"mode": r["mode"], "N": r["world_size"], "rank": r["rank"],
             "predicted extra MiB": round(r["predicted_extra_peak_bytes"] / 2**20, 3),
             f"measured extra {kind} MiB": round(r["measured_extra_peak_bytes"] / 2**20, 3),
             "measured / predicted": round(r["measured_extra_peak_bytes"] / r["predicted_extra_peak_bytes"], 2)
             if r["predicted_extra_peak_bytes"] else "- (none predicted)"} for r in records]


def memory_agreement(records: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many predicted extra peaks the measurement matched within `tolerance`, and the furthest one, in words."""
    rated = [r for r in records if r["predicted_extra_peak_bytes"]]
    if not rated:
        return "The cost model predicted no extra memory for any save here."
    ratio = {id(r): r["measured_extra_peak_bytes"] / r["predicted_extra_peak_bytes"] for r in rated}
    near = [r for r in rated if abs(ratio[id(r)] - 1) <= tolerance]
    worst = max(rated, key=lambda r: abs(ratio[id(r)] - 1))
    verdict = "the memory model holds here" if len(near) == len(rated) else "the memory model does not hold here"
    return (f"Memory: {len(near)} of {len(rated)} predicted extra peaks lie within {tolerance:.0%} of the measured "
            f"{memory_kind(records)} peaks, so {verdict}; the furthest is {worst['mode']} at N = "
            f"{worst['world_size']}, rank {worst['rank']}: {worst['measured_extra_peak_bytes'] / 2**20:.3f} MiB "
            f"measured against {worst['predicted_extra_peak_bytes'] / 2**20:.3f} MiB predicted "
            f"({ratio[id(worst)]:.2f}x).")


def fixed(rows: list[dict[str, Any]], places: int = 3, **per_column: int) -> list[dict[str, Any]]:
    """The rows with every float written with `places` decimals (`per_column`: another count for a column whose
    name starts with the key), so a column reads in one number format."""
    def text(key: str, v: Any) -> Any:
        n = next((p for k, p in per_column.items() if key.startswith(k)), places)
        return f"{v:,.{n}f}" if isinstance(v, float) else v
    return [{k: text(k, v) for k, v in r.items()} for r in rows]
