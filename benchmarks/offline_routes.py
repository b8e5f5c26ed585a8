"""The offline routes to one full model, run as their users run them and traced: time and memory over time.

DeepSpeed's `zero_to_fp32.py` and our `export` each run as their own process on the same checkpoint, so each pays
its own imports and nothing else; this process samples their resident memory from outside (`course.trace.trace_command`)
and takes the exact peak from the kernel. A process that only imports what the export imports gives the baseline
(the interpreter with its libraries) that the export's memory goal is measured from.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from zckpt_nb.course.trace import trace_command

ROUTES = {"zero_to_fp32.py": "pytorch_model*.bin", "export": "model*.safetensors"}  # route -> its weight files


# Everything `python -m zckpt_nb export` imports (transformers loads its modules on first access)
IMPORTS = ("import deepspeed.utils.zero_to_fp32, huggingface_hub, transformers, zckpt_nb.cli, zckpt_nb.convert.export, "
           "zckpt_nb.convert.model_card, zckpt_nb.convert.safeload, zckpt_nb.convert.streaming; "
           "from transformers.models.auto import modeling_auto; "
           "transformers.AutoConfig, transformers.AutoTokenizer, transformers.GenerationConfig")


def baseline_command() -> list[str]:
    """A process that imports what the export imports and exits: the memory it holds before any work."""
    return [sys.executable, "-c", IMPORTS]


def commands(ckpt_dir: str | Path, out_root: str | Path, max_shard_size: str) -> dict[str, list[str]]:
    """Both routes as commands, each writing into its own folder of `out_root`.

    `zero_to_fp32.py` is the copy DeepSpeed writes into every checkpoint folder, run as its users run it. It writes
    pickled `pytorch_model*.bin` shards: its `--safe_serialization` fails on GPT-2's tied head in DeepSpeed 0.19.8
    (notebook 04); our export writes safetensors.
    """
    out = Path(out_root)
    return {"zero_to_fp32.py": [sys.executable, str(Path(ckpt_dir) / "zero_to_fp32.py"), str(ckpt_dir),
                                str(out / f"zero_to_fp32_{max_shard_size}"), "--max_shard_size", max_shard_size],
            "export": [sys.executable, "-m", "zckpt_nb", "export", str(ckpt_dir), str(out / f"export_{max_shard_size}"),
                       "--max_shard_size", max_shard_size, "--overwrite"]}


def largest_file(folder: str | Path, pattern: str) -> int:
    """Bytes of the largest file matching `pattern` in `folder` (the largest output shard)."""
    return max((p.stat().st_size for p in Path(folder).glob(pattern)), default=0)


def memory_goal(baseline_bytes: float, largest_shard_bytes: int) -> int:
    """Issue 12's goal for an offline route's peak RSS: the interpreter's baseline plus 1.25 x the largest shard."""
    return int(baseline_bytes + 1.25 * largest_shard_bytes)


def baseline(repeats: int = 3) -> dict[str, float]:
    """Median peak RSS and wall time of `baseline_command` over `repeats` runs."""
    traces = [trace_command(baseline_command()) for _ in range(repeats)]
    return {"peak": statistics.median(t.peak_bytes for t in traces), "wall": statistics.median(t.wall for t in traces)}


def run_route(route: str, command: list[str], shard_size: str, timeout: float) -> dict[str, Any]:
    """Run one route and return its record; a failure raises RuntimeError with the end of its output.

    Dirty pages are flushed first (`sync`), so the previous route's output is not written back during this one.
    """
    os.sync()
    trace = trace_command(command, timeout=timeout)
    if trace.returncode:
        raise RuntimeError(f"{route} --max_shard_size {shard_size} exited with {trace.returncode}: "
                           f"{trace.output.strip().splitlines()[-1:]}")
    folder = command[command.index("--max_shard_size") - 1]
    return {"route": route, "shard_size": shard_size, "wall": trace.wall, "peak": trace.peak_bytes,
            "peak_anon": max(trace.anon, default=0), "peak_file": max(trace.file, default=0),
            "largest_shard": largest_file(folder, ROUTES[route]),
            "trace": {k: getattr(trace, k) for k in ("seconds", "anon", "file")}}


def run_routes(ckpt_dir: str | Path, out_root: str | Path, shard_sizes: list[str], repeats: int = 1,
               timeout: float = 1800) -> list[dict[str, Any]]:
    """Every route at every shard size, `repeats` times, alternating which goes first; one record per run."""
    records = []
    for i in range(repeats):
        for size in shard_sizes:
            pairs = list(commands(ckpt_dir, out_root, size).items())
            records += [run_route(route, cmd, size, timeout) for route, cmd in (pairs[::-1] if i % 2 else pairs)]
    return records


def measure_routes(ckpt_dir: str | Path, out_root: str | Path, shard_sizes: list[str], repeats: int = 1,
            timeout: float = 1800) -> dict[str, Any]:
    """The baseline and every route at every shard size, `repeats` times each; also written to OUT_ROOT/routes.json."""
    result = {"baseline": baseline(repeats), "records": run_routes(ckpt_dir, out_root, shard_sizes, repeats, timeout)}
    Path(out_root, "routes.json").write_text(json.dumps(result))
    return result


def memory_summary(records: list[dict[str, Any]], base: dict[str, float], model_bytes: int) -> list[dict[str, Any]]:
    """Median wall time and peak per route and shard size, against `zero_to_fp32.py` and issue 12's memory goal."""
    rows = []
    for size in dict.fromkeys(r["shard_size"] for r in records):
        ref = [r for r in records if r["shard_size"] == size and r["route"] == "zero_to_fp32.py"]
        for route in ROUTES:
            mine = [r for r in records if r["shard_size"] == size and r["route"] == route]
            wall, peak = (statistics.median(r[k] for r in mine) for k in ("wall", "peak"))
            largest = max(r["largest_shard"] for r in mine)
            goal = memory_goal(base["peak"], largest)
            rows.append({"route": route, "--max_shard_size": size, "runs": len(mine), "wall s": f"{wall:.2f}",
                         "peak RSS MiB": round(peak / 2**20),
                         "above baseline MiB": round((peak - base["peak"]) / 2**20),
                         "largest shard MiB": round(largest / 2**20),
                         "goal MiB": round(goal / 2**20), "within goal": "yes" if peak <= goal else "no",
                         "(peak - baseline) / model": round((peak - base["peak"]) / model_bytes, 2),
                         "wall / zero_to_fp32.py": round(wall / statistics.median(r["wall"] for r in ref), 2),
                         "peak / zero_to_fp32.py": round(peak / statistics.median(r["peak"] for r in ref), 2)})
    return rows
