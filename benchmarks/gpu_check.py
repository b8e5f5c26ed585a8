"""`make gpu-check`: what the first GPU machine should measure, in one command, into docs/gpu.md.

On the GPUs present (NCCL, one rank per GPU): every notebook, in fp32 and in bf16 where it takes a `DTYPE` parameter
(once, with its defaults, where it does not), then `benchmarks/save_throughput.py` on as many ranks as GPUs (its
asynchronous saves snapshot into pinned host memory there). Writes one report, docs/gpu.md.

Without a GPU it prints one line saying so and exits 0: nothing failed, there is nothing to measure, and `make
gpu-check` stays safe to call from any script (CPU ranks are what every other target measures).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

from zckpt_nb.course.notebooks import execute, notebook_paths, parameter_names
from zckpt_nb.run.devices import machine

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("fp32", "bf16")


def run_notebooks(nb_dir: Path, build: Path) -> list[dict[str, str]]:
    """Every notebook once per dtype (or once, where it takes no DTYPE); one row each: dtype, name, seconds, status."""
    rows = []
    for path in notebook_paths(nb_dir):
        takes = "DTYPE" in parameter_names(path)
        for dtype in DTYPES if takes else ("its default",):
            start = time.perf_counter()
            try:
                execute(path, build / dtype.replace(" ", "_"), {"DTYPE": dtype} if takes else {})
                status = "ok"
            except Exception as e:  # report and go on: one broken notebook must not hide the others
                status = "FAILED: " + (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            rows.append({"dtype": dtype, "notebook": path.name, "seconds": f"{time.perf_counter() - start:.0f}",
                         "status": status})
            print(f"{path.name:<40} {dtype:<12} {rows[-1]['seconds']:>6} s  {status}", flush=True)
    return rows


def run_throughput(gpus: int, build: Path, timeout: float) -> str:
    """benchmarks/save_throughput.py on `gpus` ranks; its printed table, or why it did not finish."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "save_throughput.py"), "--nproc", str(gpus),
           "--output_dir", str(build / "throughput"), "--json", str(build / "throughput.json")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:.0f} s"
    return done.stdout.strip() if done.returncode == 0 else f"failed (exit {done.returncode}): {done.stderr[-2000:]}"


def report(gpus: int, names: list[str], rows: list[dict[str, str]], throughput: str) -> str:
    """docs/gpu.md: the machine, every notebook's outcome per dtype, the throughput benchmark's table."""
    import deepspeed
    import torch

    table = "\n".join(f"| {r['notebook']} | {r['dtype']} | {r['seconds']} | {r['status']} |" for r in rows)
    return (f"# Measured on GPUs\n\nWritten by `make gpu-check` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
            f" on {platform.node()}: {gpus} x {', '.join(sorted(set(names)))}; torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, DeepSpeed {deepspeed.__version__}. NCCL, one rank per GPU.\n\n"
            f"## Notebooks\n\n| notebook | dtype | seconds | outcome |\n|---|---|---|---|\n{table}\n\n"
            f"## Save throughput (benchmarks/save_throughput.py, {gpus} ranks; pinned snapshots)\n\n"
            f"```\n{throughput}\n```\n")


def main(argv: list[str] | None = None) -> int:
    """Measure on the GPUs present and write the report; one line and exit 0 where there is no GPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(ROOT / "docs" / "gpu.md"))
    parser.add_argument("--build", default=str(ROOT / "build" / "gpu"))
    parser.add_argument("--throughput_timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    _, gpus = machine()
    if not gpus:
        print("gpu-check: no CUDA GPU visible here (or DS_ACCELERATOR=cpu): nothing measured, "
              f"{args.report} left as it is; run `make gpu-check` on a machine with GPUs", flush=True)
        return 0
    import torch

    build = Path(args.build)
    rows = run_notebooks(ROOT / "notebooks", build)
    throughput = run_throughput(gpus, build, args.throughput_timeout)
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    Path(args.report).write_text(report(gpus, names, rows, throughput))
    print(f"gpu-check: {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} notebook runs ok; wrote {args.report}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
