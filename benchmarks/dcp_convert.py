"""to-dcp against DeepSpeed's `zero_to_fp32.py` on the same ZeRO-3 checkpoint: time, and peak memory against its bound.

    python benchmarks/dcp_convert.py --model large --nproc 2
    python benchmarks/dcp_convert.py --ckpt DIR          # an existing committed checkpoint instead of a new run

A one-step run on `--nproc` CPU ranks writes the checkpoint (unless `--ckpt`); then, in this one run and on the same
files, `zero_to_fp32.py` (weights only) and `python -m zckpt_nb to-dcp` (weights and both Adam moments) each run as
their own process. to-dcp has two stages: DeepSpeed's `ds_to_universal` (in a child process, measured there) and the
DCP writer, whose peak RSS above its baseline (the kernel's VmHWM after a reset) is held to issue 26's bound: 2x the
largest parameter's fp32 state (weights and both moments). Prints both routes side by side and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from zckpt_nb.convert.dcp import largest_state_bytes
from zckpt_nb.convert.verify import newest_committed
from zckpt_nb.convert.zero_to_fp32 import zero_to_fp32_script
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.run.launch import fresh_dir, launch


def timed(command: list[str]) -> float:
    """Run `command` to the end (it must succeed); its wall seconds."""
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="large")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ckpt", default=None, help="a committed checkpoint folder to convert (skips the run)")
    parser.add_argument("--output_root", default="build/bench/dcp")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}\n{os.cpu_count()} CPU cores, Python {platform.python_version()}")
    out = fresh_dir(f"{args.output_root}/{args.model}")
    ckpt = Path(args.ckpt) if args.ckpt else out / "ckpt"
    if not args.ckpt:
        launch(args.nproc, 1, ckpt, save_checkpoint=True, model=args.model, timeout=3600, progress=False,
               verbose=False)
    tag = newest_committed(ckpt, "benchmarking")
    start = time.perf_counter()
    done = zero_to_fp32_script(ckpt, out / "fp32", "--tag", tag, timeout=3600)
    fp32_seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"zero_to_fp32.py failed: {done.stderr.strip().splitlines()[-1:]}")
    fp32_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the only child so far
    dcp_seconds = timed([sys.executable, "-m", "zckpt_nb", "to-dcp", str(ckpt), str(out / "dcp"), "--tag", tag])
    cost = read_manifest(out / "dcp")["conversion"]
    universal, bound = cost["universal"], 2 * largest_state_bytes(ckpt, tag)
    extra = cost["peak_rss_bytes"] - cost["baseline_rss_bytes"]
    fp32_bytes = sum(p.stat().st_size for p in (out / "fp32").rglob("*") if p.is_file())
    rows = [("zero_to_fp32.py (weights)", fp32_seconds, fp32_peak, fp32_bytes),
            ("to-dcp: ds_to_universal" + (" (reused)" if universal["reused"] else ""), universal["seconds"],
             universal["peak_rss_bytes"], universal["bytes"]),
            ("to-dcp: DCP writer", cost["seconds"], cost["peak_rss_bytes"], cost["bytes"]),
            ("to-dcp, whole command", dcp_seconds, max(universal["peak_rss_bytes"], cost["peak_rss_bytes"]),
             cost["bytes"])]
    print(f"\n{'route':30} {'time (s)':>9} {'peak RSS (MiB)':>15} {'written (MiB)':>14}")
    for name, seconds, peak, written in rows:
        print(f"{name:30} {seconds:9.1f} {peak / 2**20:15.0f} {written / 2**20:14.1f}")
    print(f"\nto-dcp / zero_to_fp32.py time: {dcp_seconds / fp32_seconds:.2f}x (goal: <= 1); the DCP writer's peak "
          f"above its baseline: {extra / 2**20:.1f} MiB against the bound {bound / 2**20:.1f} MiB "
          f"(2x the largest parameter's fp32 state): {extra / bound:.2f} of it "
          f"({'within' if extra <= bound else 'OVER'} the bound)")
    (out / "dcp_convert.json").write_text(json.dumps({"rows": rows, "bound_bytes": bound, "extra_bytes": extra}))


if __name__ == "__main__":
    main()
