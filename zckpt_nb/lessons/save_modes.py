"""Notebook 06's view of `compare` records: one row per (mode, N, rank), one number per column, units in headers."""

from __future__ import annotations

from typing import Any

from zckpt_nb.format.units import counted
from zckpt_nb.lessons.compare import predicted_for
from zckpt_nb.lessons.stall import NEVER, overlap_verdict, tied_modes
from zckpt_nb.plan.costs import predict

KIB = 1024


def compare_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes written (KiB) and moved by collectives (bytes: a partitioned save's few bytes would round to 0.0 KiB),
    predicted beside measured, and the save's wall time (8 columns)."""
    return [{"mode": r["mode"], "N": r["world_size"], "rank": r["rank"],
             "written KiB, predicted": r["predicted_bytes"] / KIB,
             "written KiB, tensor payload": r["measured_payload_bytes"] / KIB,
             "collective bytes, predicted": f"{int(r['predicted_comm_bytes']):,}",
             "collective bytes, logged": f"{int(r['logged_comm_bytes'] or 0):,}",
             "save s": float(r["seconds"])} for r in records]


def ops_named(record: dict[str, Any]) -> str:
    """The collective ops DeepSpeed's comms logger recorded for one save, with their counts, or 'none'."""
    ops = record["logged_comm_ops"]
    return ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) if ops else "none"


def principle_sentence(records: list[dict[str, Any]]) -> str:
    """The principle's table ('partitioned save: no communication; consolidated: an all-gather') against the
    collectives DeepSpeed logged on rank 0 at the largest world size measured, in short sentences."""
    n = max(r["world_size"] for r in records)
    at_n = {r["mode"]: r for r in records if r["world_size"] == n and r["rank"] == 0}
    said = []
    if "partitioned" in at_n:
        r = at_n["partitioned"]
        moved = r["logged_comm_bytes"] or 0
        said.append(f"The principle's table says a partitioned save needs no communication. At N = {n} " + (
            "rank 0 logged none during it, as it says." if not moved else
            f"that is imprecise: rank 0 logged {moved:,} B in DeepSpeed's collectives during it ({ops_named(r)}), "
            f"and the cost model predicted {r['predicted_comm_bytes']:,} B. Every rank must reach those "
            "collectives, so even this save waits for all ranks."))
    for mode in ("gathered16", "per_param"):
        if mode in at_n:
            r = at_n[mode]
            logged = r["logged_comm_bytes"] or 0
            said.append(f"The {mode} save logged {logged:,} B ({logged / KIB:,.1f} KiB) on rank 0 at N = {n} "
                        f"({ops_named(r)}).")
    return " ".join(said) or "No in-training save mode was compared, so the principle's table is not checked here."


def world_answer(records: list[dict[str, Any]], default_n: int, other_n: int = 3) -> str:
    """Exercise 3 for the world size this run measured: rank 0's logged collective bytes per mode, largest first,
    each beside the cost model's figure at the notebook's `default_n` (at `other_n` when this run is the default)."""
    n = max(r["world_size"] for r in records)
    ref = default_n if n != default_n else other_n
    at_n = sorted((r for r in records if r["world_size"] == n and r["rank"] == 0),
                  key=lambda r: -(r["logged_comm_bytes"] or 0))
    first = at_n[0]
    pred = predict(first["model"], ref, first["dtype"], first["persistence_threshold"])
    each = [f"{r['mode']} {(r['logged_comm_bytes'] or 0) / KIB:,.1f} KiB (the cost model: "
            f"{predicted_for(pred, r['mode'], 0)['predicted_comm_bytes'] / KIB:,.1f} KiB at N = {ref})" for r in at_n
            if r["mode"] in ("gathered16", "per_param")]
    alone = [r["mode"] for r in at_n if r["mode"] in ("offline", "hf")]
    each += [f"{' and '.join(alone)} none (one process after training)"] if alone else []
    part = next((r for r in at_n if r["mode"] == "partitioned"), None)
    top = next((r for r in at_n if r["mode"] in ("gathered16", "per_param")), None)  # the consolidated one moving most
    moved = "" if part is None else f" The partitioned save moved {part['logged_comm_bytes'] or 0:,} B"
    if part is not None and top is not None:
        ratio = (part["logged_comm_bytes"] or 0) / max(top["logged_comm_bytes"] or 0, 1)
        moved += (f", about 1/{round(1 / ratio):,} of {top['mode']}'s: next to nothing, but not nothing."
                  if 0 < ratio < 0.01 else f", none of {top['mode']}'s." if ratio == 0 else
                  f", {ratio:.2f}x {top['mode']}'s: not negligible at these settings.")
    elif part is not None:
        moved += "."
    which = "the default" if n == default_n else f"the default is {default_n}"
    return (f"This run measured N = {n} ({which}). Rank 0's collective bytes, largest first: "
            f"{'; '.join(each) or 'no consolidated route was run'}. Most: {first['mode']}.{moved}")


def summary_rows(rows: list[dict[str, Any]], records: list[dict[str, Any]], stalls: list[dict[str, Any]],
                 steps: list[dict[str, Any]], memory: list[dict[str, Any]],
                 intervals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The notebook's findings in one table, each a short figure from this run and the section that says it whole."""
    held = max(memory, key=lambda r: r["snapshot MiB"])
    best = min(intervals, key=lambda r: r["lost at optimum %"]) if intervals else None
    tied = tied_modes(best, intervals, stalls) if best else []
    tie = f", a tie with {', '.join(tied)}" if tied else ""
    found = [
        ("1", "bytes written and collective bytes: as predicted?",
         f"{sum(r['collective bytes: predicted = logged'] for r in rows)} of {len(rows)} (mode, N) collectives "
         f"equal; worst payload error {max(r['worst payload error (%)'] for r in rows)}%"),
        ("1", "extra memory against the cost model", memory_summary(records)),
        ("2", "mean stall per save", "; ".join(f"{r['mode']} {r['mean stall s']:.3f} s" for r in stalls)),
        ("2", "time to durable", "; ".join(f"{r['mode']} " + (r["median durable s"] if r["median durable s"] == NEVER
                                                              else f"{r['median durable s']:.3f} s") for r in stalls)),
        ("3", "a step while an async save is written", overlap_ratio(steps)),
        ("4", "host memory the async snapshot holds",
         f"{held['snapshot MiB']} MiB per rank" if held["snapshot MiB"] else "none (no async save ran)"),
        ("5", "least time lost at Young's interval",
         f"{best['mode']}{tie}: every {best['optimum interval s']:,.0f} s, "
         f"{best['lost at optimum %']:.3f}% lost" if best else "no durable mode ran")]
    return [{"section": s, "question": q, "this run": a} for s, q, a in found]


def memory_summary(records: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """Section 1's memory finding in one short sentence: how many predicted peaks matched, and what lay outside."""
    sides, missed = memory_sides(records, tolerance), unpredicted(records)
    rated = sum(len(side) for side in sides.values())
    said = [f"{len(sides['within'])} of {rated} predicted peaks within {tolerance:.0%}"]
    said += [f"{r['mode']} rank {r['rank']} {direction} it" + (" (a miss)" if direction == "above" else
                                                                " (a sampled peak: a lower bound)")
             for direction in ("above", "below") for r in sides[direction]]
    if missed:
        said.append(f"{len(missed)} measured where none was predicted (misses)")
    return "; ".join(said)


def overlap_ratio(steps: list[dict[str, Any]]) -> str:
    """The async run's median step while a save is written over its median without, against the steps' noise
    (`stall.overlap_verdict`), or 'not measured'."""
    found = overlap_verdict(steps)
    if found is None:
        return "not measured"
    ratio, noise, word = found
    return f"{ratio:.2f}x a step without; " + (f"within the steps' {noise:.2f}x spread: no slowdown over {noise:.2f}x"
                                              if word == "tie" else f"{word} beyond the steps' {noise:.2f}x spread")


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


def memory_sides(records: list[dict[str, Any]], tolerance: float = 0.25) -> dict[str, list[dict[str, Any]]]:
    """The records with a predicted extra peak, by where the measured one lies: within `tolerance`, above, below."""
    rated = [r for r in records if r["predicted_extra_peak_bytes"]]
    ratio = {id(r): r["measured_extra_peak_bytes"] / r["predicted_extra_peak_bytes"] for r in rated}
    return {"within": [r for r in rated if abs(ratio[id(r)] - 1) <= tolerance],
            "above": [r for r in rated if ratio[id(r)] > 1 + tolerance],
            "below": [r for r in rated if ratio[id(r)] < 1 - tolerance]}


def unpredicted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records whose save the cost model predicts no extra peak for but which measured one, largest first."""
    return sorted((r for r in records if not r["predicted_extra_peak_bytes"] and r["measured_extra_peak_bytes"]),
                  key=lambda r: -r["measured_extra_peak_bytes"])


def memory_agreement(records: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many predicted extra peaks the measurement matched within `tolerance`, then each one outside it named in
    plain words (above: a miss of the model; below: maybe the sampler's, a sampled peak being a lower bound), and the
    saves that measured a peak where none was predicted (misses too)."""
    sides, missed = memory_sides(records, tolerance), unpredicted(records)
    rated = [r for side in sides.values() for r in side]
    if not rated:
        return "The cost model predicted no extra memory for any save here."
    def said(r: dict[str, Any]) -> str:
        return (f"{r['mode']} at N = {r['world_size']}, rank {r['rank']}, measured "
                f"{r['measured_extra_peak_bytes'] / 2**20:.3f} MiB against "
                f"{r['predicted_extra_peak_bytes'] / 2**20:.3f} MiB predicted "
                f"({r['measured_extra_peak_bytes'] / r['predicted_extra_peak_bytes']:.2f}x)")
    worst = max(rated, key=lambda r: abs(r["measured_extra_peak_bytes"] / r["predicted_extra_peak_bytes"] - 1))
    above = (" Above it: " + "; ".join(map(said, sides["above"])) + ": more than the model's terms count, a miss "
             "of the model." if sides["above"] else "")
    below = (" Below it: " + "; ".join(map(said, sides["below"])) + ". The heap is sampled (every millisecond at "
             "first), so a measured peak is a lower bound: a buffer that lived less than a millisecond can be "
             "missed, so a peak below is not counted as a miss." if sides["below"] else "")
    furthest = "" if above or below else f" The furthest: {said(worst)}."
    saves = counted(len(missed), 'more save')
    unseen = (f" The model predicts no extra memory for {saves} that measured some, which its terms do not count: "
              + "; ".join(f"{r['mode']} at N = {r['world_size']}, rank {r['rank']}, "
                          f"{r['measured_extra_peak_bytes'] / 2**20:.3f} MiB" for r in missed) + "."
              if missed else "")
    refutes = "" if sides["above"] or missed else " Nothing here refutes the memory model."
    return (f"Memory: {len(sides['within'])} of {len(rated)} predicted extra peaks lie within {tolerance:.0%} of the "
            f"measured {memory_kind(records)} peak.{above}{below}{furthest}{unseen}{refutes}")


def fixed(rows: list[dict[str, Any]], places: int = 3, **per_column: int) -> list[dict[str, Any]]:
    """The rows with every float written with `places` decimals (`per_column`: another count for a column whose
    name starts with the key), so a column reads in one number format."""
    def text(key: str, v: Any) -> Any:
        n = next((p for k, p in per_column.items() if key.startswith(k)), places)
        return f"{v:,.{n}f}" if isinstance(v, float) else v
    return [{k: text(k, v) for k, v in r.items()} for r in rows]
