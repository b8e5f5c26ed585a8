"""Save modes at N = 1, 2, 4 (CPU ranks by default): the cost model against measurement, side by side in one run.

    .venv/bin/python benchmarks/compare_world_sizes.py --model tiny --nproc 1 2 4 --output_dir build/bench/compare

Prints, per (mode, N): predicted and measured bytes per rank, collective bytes predicted and logged, extra peak
memory and wall time, then the ratios a reader checks: measured/predicted, and how each figure scales with N.
"""

from __future__ import annotations

import argparse

from zckpt_nb import compare
from zckpt_nb.measure import MODES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--output_dir", default="build/bench/compare")
    parser.add_argument("--fresh", action="store_true", help="measure again instead of reusing compare.json")
    args = parser.parse_args()
    records = compare.compare(args.nproc, args.model, args.modes, args.output_dir, reuse=not args.fresh)
    print(f"{'mode':<12}{'N':>3}{'rank':>5}{'pred B':>13}{'meas B':>13}{'ratio':>8}{'pred comm':>12}"
          f"{'logged':>12}{'extra MiB':>10}{'s':>8}")
    for r in records:
        ratio = r["measured_payload_bytes"] / r["predicted_bytes"] if r["predicted_bytes"] else float("nan")
        print(f"{r['mode']:<12}{r['world_size']:>3}{r['rank']:>5}{r['predicted_bytes']:>13,}"
              f"{r['measured_payload_bytes']:>13,}{ratio:>8.4f}{r['predicted_comm_bytes']:>12,}"
              f"{r['logged_comm_bytes'] or 0:>12,}{r['measured_extra_peak_bytes'] / 2**20:>10.2f}{r['seconds']:>8.3f}")
    print("\nagreement per (mode, N):")
    for row in compare.agreement(records):
        print("  " + "  ".join(f"{k}: {v}" for k, v in row.items()))
    base = min(args.nproc)
    print(f"\nscaling of rank 0's partitioned bytes against N = {base}:")
    rank0 = [r for r in records if r["mode"] == "partitioned" and r["rank"] == 0]
    part = {r["world_size"]: r["measured_payload_bytes"] for r in rank0}
    for n, size in sorted(part.items()):
        print(f"  N = {n}: {size:,} bytes, {size / part[base]:.3f} x (ideal {base / n:.3f} x)")
    for line in compare.explain_differences(records):
        print("note: " + line)


if __name__ == "__main__":
    main()
