"""One full model from a ZeRO-3 checkpoint, offline: DeepSpeed's `zero_to_fp32.py` against our streaming `export`.

    python benchmarks/streaming_export.py --models medium large xl --nproc 2 --shard_sizes 5GB 100MB

For each preset: a one-step run on `--nproc` CPU ranks writes a checkpoint; then, in one run and on the same files,
each route runs as its own process at each shard size, in alternating order, `--repeats` times. Each run's wall
time and peak RSS (the kernel's high-water mark, VmHWM) are recorded, and the RSS is sampled every 20 ms from
outside. Prints the medians, the ratios against `zero_to_fp32.py`, and issue 12's memory goal: peak RSS <= the
interpreter's baseline (a process that only imports what the export imports) + 1.25 x the largest output shard.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import offline_routes as offline  # benchmarks/offline_routes.py
from bench_tools import fresh_dir  # benchmarks/bench_tools.py
from route_costs import text_table

from zckpt_nb.run.launch import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["medium", "large", "xl"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shard_sizes", nargs="+", default=["5GB", "100MB"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output_root", default="build/bench/streaming")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}\n{os.cpu_count()} CPU cores, Python {platform.python_version()}")
    for model in args.models:
        out = fresh_dir(f"{args.output_root}/{model}")
        run = launch(args.nproc, 1, out / "ckpt", save_checkpoint=True, model=model, timeout=3600, progress=False,
                     verbose=False)
        measured = offline.measure_routes(out / "ckpt", out, args.shard_sizes, args.repeats)
        base = measured["baseline"]
        optim = sum(p.stat().st_size for p in (out / "ckpt").glob("*/*optim_states.pt"))
        print(f"\n## {model}: P = {run.num_params:,} ({run.num_params * 4 / 1e9:.2f} GB of fp32 weights), "
              f"{args.nproc} ranks' optimizer files {optim / 1e9:.2f} GB; interpreter baseline "
              f"{base['peak'] / 2**20:.0f} MiB in {base['wall']:.1f} s\n")
        print(text_table(offline.memory_summary(measured["records"], base, run.num_params * 4)))
        print(f"records: {out / 'routes.json'}")


if __name__ == "__main__":
    main()
