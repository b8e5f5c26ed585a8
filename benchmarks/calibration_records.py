"""The measured saves the time model is calibrated on (benchmarks/calibration.py): every route at several N, repeated.

    .venv/bin/python benchmarks/calibration_records.py --repeats 7 --output benchmarks/data/measured_cpu_compare.json

Runs `compare` (real ZeRO-3 runs, every save mode, every rank) for each model and world size `--repeats` times, into
`OUTPUT_DIR/r{i}/compare_{model}` (reused when already there), then keeps, per (model, mode, N, rank), the record
whose seconds are the median of the repeats: one save's figures, all measured together. Prints the spread.
Each route but the in-training partitioned save starts after `measure.flush_writes()` (see there). The repeats'
checkpoints take about 5 GB each; only each `compare.json` is reused, so the rest can be deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import asdict
from pathlib import Path

from measured_routes import compare  # benchmarks/measured_routes.py

from zckpt_nb.format.records import Route

PLAN = {"tiny": [1, 2, 3, 4], "small": [1, 2, 3], "medium": [1, 2, 3]}


def median_records(runs: list[list[dict]], machine: str) -> list[dict]:
    """Per (model, mode, N, rank), the record with the median seconds over the repeats (a lower median if even)."""
    groups: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            groups.setdefault((r["model"], r["mode"], r["world_size"], r["rank"]), []).append(r)
    out = []
    for group in groups.values():
        kept = sorted(group, key=lambda r: r["seconds"])[(len(group) - 1) // 2]
        out.append({**kept, "machine": machine, "cpus": kept.get("cpus") or os.cpu_count(),
                    "repeat_seconds": [round(r["seconds"], 5) for r in group]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output_dir", default="build/bench/calibration")
    parser.add_argument("--output", default="build/bench/calibration/measured_cpu_compare.json")
    parser.add_argument("--machine", default=platform.node(), help="label the records' machine (default: hostname)")
    args = parser.parse_args()
    renamed = {"route": "mode", "peak_rss_bytes": "peak_memory_bytes"}  # the shipped records' keys
    runs = [[{renamed.get(k, k): v for k, v in asdict(r).items()}
             for r in compare(sizes, model, list(Route), Path(args.output_dir, f"r{i}", f"compare_{model}"),
                              progress=False, verbose=False)]
            for i in range(1, args.repeats + 1) for model, sizes in PLAN.items()]
    records = median_records(runs, args.machine)
    Path(args.output).write_text(json.dumps(records, indent=1))
    spreads = []
    for r in (r for r in records if r["rank"] == 0):
        spreads.append(max(r["repeat_seconds"]) / min(r["repeat_seconds"]))
        print(f"{r['model']:<7}{r['mode']:<12}N={r['world_size']}  median {r['seconds']:.4f} s  "
              f"max/min over repeats {spreads[-1]:.2f}")
    print(f"{len(records)} records -> {args.output}; rank 0's max/min over repeats: median "
          f"{statistics.median(spreads):.2f}, largest {max(spreads):.2f}")

if __name__ == "__main__":
    main()
