"""Sentences that state a figure or a verdict, built from this run's measurements: no fixed outcome text.

A notebook never prints a verdict it did not compute. It passes what it just measured to one of these
functions; the tests feed them data that makes each verdict go the other way.
"""

from __future__ import annotations

from typing import Any


def memory_sentence(rows: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many measured extra peaks lie within `tolerance` of the cost model's terms, and the furthest one."""
    rated = [r for r in rows if r["predicted MiB"]]
    if not rated:
        return "The cost model predicted no extra memory for any record here."
    near = [r for r in rated if abs(r["measured MiB"] / r["predicted MiB"] - 1) <= tolerance]
    worst = max(rated, key=lambda r: abs(r["measured MiB"] / r["predicted MiB"] - 1))
    return (f"{len(near)} of {len(rated)} predicted extra peaks lie within {tolerance:.0%} of the measured ones; the "
            f"furthest is {worst['mode']} at N = {worst['N']}, rank {worst['rank']}: {worst['measured MiB']} MiB "
            f"measured against {worst['predicted MiB']} MiB ({worst['predicted terms (MiB)']}). Records with no "
            "prediction (the partitioned save, ranks that only send) show what was measured.")


def reshard_rows(base: Any, runs: dict[int, Any]) -> list[dict[str, Any]]:
    """Per resumed run (notebook 07): how it loaded, what converting cost, and its losses against `base`'s."""
    by_step = dict(zip(base.steps, base.losses))
    rows = []
    for world, run in runs.items():
        done = run.data["resharded"]
        diffs = [abs(by_step[s] - loss) for s, loss in zip(run.steps, run.losses) if s in by_step]
        rows.append({"resumed on N": world, "saved by N": done["source_world_size"] if done else base.world_size,
                     "loaded from": ("the checkpoint itself" if not done else "a universal copy it made"
                                     if not done["reused"] else "a universal copy it was given"),
                     "accumulation steps": run.data["gradient_accumulation_steps"],
                     "conversion (s)": round(done["conversion"]["seconds"], 2) if done else 0.0,
                     "conversion peak RSS (MiB)": round(done["conversion"]["peak_rss_bytes"] / 2**20) if done else 0,
                     "steps compared": len(diffs), "max |loss difference|": max(diffs, default=float("nan"))})
    return rows


# What a resume on another world size can meet, per training dtype: fp32 sums in another order differ by float
# rounding only; bf16 keeps 8 bits of mantissa. Measured on CPU ranks (tiny, 2 ranks saved at step 3, resumed on 1 and
# 3 ranks to step 6): 7.3e-5 and 6.6e-5; issue 27 reports about 1e-2 on longer runs; tests/test_bf16.py allows 0.05.
RESUME_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05}


def reshard_sentence(rows: list[dict[str, Any]], dtype: str = "fp32") -> str:
    """Whether each resumed run continued the uninterrupted optimisation, within the tolerance `dtype` can meet
    (`RESUME_TOLERANCE`, stated in the sentence)."""
    tolerance = RESUME_TOLERANCE[dtype]
    off = [r for r in rows if not r["max |loss difference|"] <= tolerance]
    worst = max(rows, key=lambda r: r["max |loss difference|"])
    told = (f"the largest difference is {worst['max |loss difference|']:.1e} (resumed on N = {worst['resumed on N']}, "
            f"over {worst['steps compared']} steps)")
    if not off:
        return (f"Every resumed run ({', '.join(str(r['resumed on N']) for r in rows)} ranks) continued the "
                f"uninterrupted optimisation: {told}, within the {tolerance:.0e} that a different order of {dtype} "
                "additions explains.")
    return (f"{len(off)} of {len(rows)} resumed runs left the uninterrupted optimisation (N = "
            f"{', '.join(str(r['resumed on N']) for r in off)}): {told}, above the {tolerance:.0e} {dtype} can meet.")
