"""What each route to one full model costs, for one preset and world size, measured side by side in one run.

    python benchmarks/consolidation_costs.py --model medium --nproc 2 [--steps 4] [--output_dir build/bench/medium]

Trains `--steps` steps (the cost of a save does not depend on how long the model trained), then saves with every
route: partitioned, in-training 16-bit gather (route 1), per-parameter gather (route 2) inside the job, then the
offline conversion (route 3) and the Hugging Face export (route 4) in this process. Prints the cost table, the
seed's table against the measurements, and ratios; writes every record to OUTPUT_DIR/costs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from bench_tools import fresh_dir, measure_export, measure_offline  # benchmarks/bench_tools.py
from route_costs import cost_summary, seed_vs_measured, text_table  # benchmarks/route_costs.py

from zckpt_nb.format.units import counted
from zckpt_nb.run.launch import launch


def ratios(summary: list[dict], num_params: int) -> list[dict]:
    """The comparisons the notebook draws, as numbers: each route against the partitioned save and route 2."""
    by = {r["route"]: r for r in summary}
    base, full_mib = by["partitioned"], num_params * 4 / 2**20
    rows = []
    for route, r in by.items():
        rows.append({"route": route,
                     "time / partitioned (rank 0)": round(r["seconds, rank 0"] / base["seconds, rank 0"], 2),
                     "rank-0 extra RSS / model": round(r["extra RSS MiB, rank 0"] / full_mib, 2),
                     "rank-0 extra heap / model": round(r["extra heap MiB, rank 0"] / full_mib, 2),
                     "rank-0 written / model": round(r["written MiB, rank 0"] / full_mib, 2),
                     "collective ops / route 2": round(r["collective ops, rank 0"]
                                                      / max(1, by["per_param"]["collective ops, rank 0"]), 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output_dir", default=None, help="default: build/bench/consolidation_<model>_n<nproc>")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    out = fresh_dir(args.output_dir or f"build/bench/consolidation_{args.model}_n{args.nproc}")

    run = launch(args.nproc, args.steps, out, save_checkpoint=True, model=args.model, timeout=args.timeout,
                 save_16bit=True, save_gathered=True, progress=False)
    costs = run.save_costs + [measure_offline(out, out / "offline").to_dict(),
                                      measure_export(out, out / "hf").to_dict()]
    (out / "costs.json").write_text(json.dumps({"num_params": run.num_params, "world_size": run.world_size,
                                                "device": run.device, "save_costs": costs}, indent=1))

    summary = cost_summary(costs, run.num_params)
    print(f"\n## {args.model}: P = {run.num_params:,} parameters ({run.num_params * 4 / 2**20:,.1f} MiB in fp32), "
          f"N = {counted(run.world_size, run.device + ' rank')}, {os.cpu_count()} CPU cores, "
          f"Python {platform.python_version()}")
    print(f"command: python {' '.join(sys.argv)}\n")
    print(text_table(summary), "\n")
    print(text_table(seed_vs_measured(costs, run.num_params)), "\n")
    print(text_table(ratios(summary, run.num_params)))
    print(f"\nrecords: {Path(out, 'costs.json')}")


if __name__ == "__main__":
    main()
