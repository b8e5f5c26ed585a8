"""Save routes at several N (CPU ranks by default): the cost model against measurement, side by side in one run.

    .venv/bin/python benchmarks/compare_world_sizes.py --model tiny --nproc 1 2 3 4 --output_dir build/bench/compare

Prints, per (route, N, rank): predicted and measured payload bytes, the measured whole files, collective bytes
predicted and logged, extra peak memory predicted (the cost model's terms) and measured, and wall time; then how many
predictions hold and how rank 0's partitioned bytes scale with N. Tables of its output: docs/cost_model.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from measured_routes import RESULTS, compare  # benchmarks/measured_routes.py

from zckpt_nb.errors import UsageError
from zckpt_nb.format.records import Route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--routes", nargs="+", default=list(Route))
    parser.add_argument("--output_dir", default="build/bench/compare")
    parser.add_argument("--fresh", action="store_true", help="measure again instead of reusing compare.json")
    parser.add_argument("--persistence_threshold", type=int, default=0,
                        help="stage3_param_persistence_threshold (DeepSpeed's default: 100000)")
    parser.add_argument("--steps", type=int, default=5, help="training steps before the saves")
    parser.add_argument("--timeout", type=float, default=1800, help="per world size; kills every rank when passed")
    args = parser.parse_args()
    try:
        records = compare(args.nproc, args.model, args.routes, args.output_dir, steps=args.steps,
                          timeout=args.timeout, reuse=not args.fresh, persistence_threshold=args.persistence_threshold,
                          verbose=False)
    except UsageError as e:
        sys.exit(f"compare_world_sizes: error: {e}")
    print(f"{'route':<12}{'N':>3}{'rank':>5}{'pred B':>13}{'meas B':>13}{'ratio':>8}{'rank file B':>13}"
          f"{'pred comm':>12}{'logged':>12}{'pred MiB':>9}{'meas MiB':>9}{'s':>8}")
    for r in records:
        ratio = r.measured_payload_bytes / r.predicted_bytes if r.predicted_bytes else float("nan")
        print(f"{r.route:<12}{r.world_size:>3}{r.rank:>5}{r.predicted_bytes:>13,}{r.measured_payload_bytes:>13,}"
              f"{ratio:>8.4f}{r.measured_rank_file_bytes or 0:>13,}{r.predicted_comm_bytes:>12,}"
              f"{r.logged_comm_bytes or 0:>12,}{r.predicted_extra_peak_bytes / 2**20:>9.2f}"
              f"{r.measured_extra_peak_bytes / 2**20:>9.2f}{r.seconds:>8.3f}")
    predicted = [r for r in records if r.predicted_extra_peak_bytes]
    near = sum(abs(r.measured_extra_peak_bytes / r.predicted_extra_peak_bytes - 1) <= 0.25 for r in predicted)
    exact = sum(r.measured_payload_bytes == r.predicted_bytes for r in records)
    logged = [r for r in records if r.logged_comm_bytes is not None]
    same = sum(r.logged_comm_bytes == r.predicted_comm_bytes for r in logged)
    print(f"\n{exact} of {len(records)} payloads equal their prediction; {same} of {len(logged)} logged collective "
          f"bytes do; {near} of {len(predicted)} predicted extra peaks lie within 25% of the measured ones")
    base = min(args.nproc)
    part = {r.world_size: r.measured_payload_bytes for r in records if r.route == "partitioned" and r.rank == 0}
    if part:
        print(f"\nscaling of rank 0's partitioned bytes against N = {base}:")
    for n, size in sorted(part.items()):
        print(f"  N = {n}: {size:,} bytes, {size / part[base]:.3f} x (ideal {base / n:.3f} x)")
    print(f"{len(records)} records in {Path(args.output_dir) / RESULTS}")


if __name__ == "__main__":
    main()
