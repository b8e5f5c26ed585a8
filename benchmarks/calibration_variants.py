"""Would another time model, or another summary of the repeats, put every measured save within 25%?

    .venv/bin/python benchmarks/calibration_variants.py

Refits notebook 09's leave-one-out calibration (`planning.calibration`) on the shipped records' rank-0 saves with:
- the measured seconds as the median of the repeats (what is shipped) or their minimum (noise only adds time, the
  rule `timeit` follows);
- the shipped terms; plus one term per collective call at any N (Python's cost of entering one gather); or the
  network and ring-step constants split per save mode (each mode gathers differently).
Prints, per variant, how many saves lie within 25% and the worst ones, and the repeats' own spread.
"""

from __future__ import annotations

import statistics
from typing import Any

from calibration import calibration, cpu_share, fit, measured_records, predicted

from zckpt_nb.format.records import Route
from zckpt_nb.plan.costs import predict
from zckpt_nb.plan.planning import Bandwidths, collective_calls

STATISTICS = {"median": statistics.median, "min": min}


def per_call(row: dict[str, Any], record: dict[str, Any]) -> dict[str, float]:
    """The shipped terms plus the save's collective calls (CPU work: scaled by ranks per core)."""
    pred = predict(record["model"], record["world_size"], record["dtype"], record["persistence_threshold"])
    return {**row["features"], "calls": collective_calls(pred, row["mode"]) * cpu_share(record)}


def per_mode(row: dict[str, Any], record: dict[str, Any]) -> dict[str, float]:
    """The shipped terms with the network and ring-step constants of each save mode apart."""
    shared = {k: v for k, v in row["features"].items() if k not in ("net", "steps")}
    return shared | {f"{k} {m}": row["features"][k] * (m == row["mode"]) for k in ("net", "steps")
                     for m in Route}


VARIANTS = {"shipped terms": lambda row, record: row["features"], "+ per call": per_call, "per-mode network": per_mode}


def errors(rows: list[dict[str, Any]]) -> list[float]:
    """Leave-one-out relative error of each row's fitted seconds."""
    return [predicted(row, fit(rows[:i] + rows[i + 1:])) / row["measured s"] - 1
            for i, row in enumerate(rows)]


def main() -> None:
    records = [r for r in measured_records() if r["rank"] == 0]
    base = calibration(records, Bandwidths(1, 1, 1))
    for variant, terms in VARIANTS.items():
        for name, stat in STATISTICS.items():
            rows = [row | {"features": terms(row, record), "measured s": stat(row["repeat s"] or [row["measured s"]])}
                    for row, record in zip(base, records, strict=True)]
            errs = errors(rows)
            worst = sorted(zip(errs, rows, strict=True), key=lambda t: -abs(t[0]))[:4]
            print(f"{variant:17} {name:6} {sum(abs(e) <= 0.25 for e in errs)} of {len(rows)} within 25%; worst: "
                  + ", ".join(f"{r['model']} {r['mode']} N={r['N']} {e:+.0%}" for e, r in worst))
    spread = [x / statistics.median(row["repeat s"]) - 1 for row in base for x in row["repeat s"]]
    print(f"repeats against their own median: {sum(abs(e) <= 0.25 for e in spread)} of {len(spread)} within 25%")


if __name__ == "__main__":
    main()
