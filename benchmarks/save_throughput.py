"""How fast each save mode makes a checkpoint durable, against what the filesystem itself allows, and its stall.

In one run, on the filesystem of --output_dir:
1. one training launch per save mode (`zckpt_nb.stall.measure_modes`: plain, commit, async), saving every few
   steps; per save, the slowest rank's stall and time to durable;
2. two durable write limits with the same shape as a checkpoint: N processes at once, each writing one file of its
   rank's checkpoint bytes, with O_DIRECT + fsync (no page cache) and buffered + fsync;
3. each mode's durable MB/s (checkpoint bytes over the median time to durable) and its ratios to those limits and
   to the commit protocol's stall.

    PYTHONPATH=. python benchmarks/save_throughput.py --model small --nproc 2 --output_dir build/bench_stall
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from zckpt_nb import stall
from zckpt_nb.launch import RunResult

CHUNK = 8 * 2**20  # one write call; a multiple of 4096, as O_DIRECT requires


def write_file(path: str, size: int, direct: bool) -> float:
    """Write `size` bytes to `path` and fsync; the seconds it took (O_DIRECT bypasses the page cache)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(2**16) * (CHUNK // 2**16))
    size = -(-size // 4096) * 4096  # O_DIRECT writes whole blocks
    start = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        done = 0
        while done < size:
            done += os.write(fd, memoryview(buffer)[:min(CHUNK, size - done)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def disk_limit(root: Path, sizes: list[int], direct: bool) -> float | None:
    """MB/s of len(sizes) processes writing one file each at once, all fsynced; None where O_DIRECT is refused."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        with ProcessPoolExecutor(len(sizes)) as pool:
            seconds = list(pool.map(write_file, [str(root / f"rank{i}.bin") for i in range(len(sizes))], sizes,
                                    [direct] * len(sizes)))
    except OSError:  # tmpfs and some overlay filesystems refuse O_DIRECT (EINVAL)
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sum(sizes) / max(seconds) / 1e6


def rank_bytes(run_dir: Path) -> list[int]:
    """Each rank's bytes of one checkpoint (its two shard files), from run.json."""
    run = RunResult.from_dir(run_dir, [], 0.0)
    return [sum(f["bytes"] for f in r["files"] if "zero_pp_rank" in f["path"]) for r in run.ranks]


def slowest(records: list[dict[str, Any]], mode: str, key: str) -> list[float]:
    """Per save of `mode`, the largest `key` over ranks (None where no rank has it)."""
    by_tag: dict[str, list[float]] = {}
    for r in records:
        if r["mode"] == mode and r[key] is not None:
            by_tag.setdefault(r["tag"], []).append(r[key])
    return [max(v) for v in by_tag.values()]


def measure(model: str, nproc: int, out: Path, steps: int, save_every: int) -> dict[str, Any]:
    """The three save modes, then the two write limits on the same filesystem; every figure and ratio."""
    records = stall.measure_modes(model, nproc, list(stall.SAVE_MODES), out, steps=steps, save_every=save_every)
    sizes = rank_bytes(out / "stall_commit")
    limits = {"o_direct_fsync": disk_limit(out / "limit_direct", sizes, True),
              "buffered_fsync": disk_limit(out / "limit_buffered", sizes, False)}
    result: dict[str, Any] = {"model": model, "nproc": nproc, "checkpoint_bytes": sum(sizes),
                              "limits_mb_s": limits, "modes": {}}
    for mode in stall.SAVE_MODES:
        durable = slowest(records, mode, "durable_seconds")
        row = {"stall_s": statistics.median(slowest(records, mode, "stall_seconds")),
               "durable_s": statistics.median(durable) if durable else None,
               "snapshot_mib": max(r["snapshot_bytes"] for r in records if r["mode"] == mode) / 2**20}
        row["durable_mb_s"] = sum(sizes) / row["durable_s"] / 1e6 if durable else None
        result["modes"][mode] = row
    commit_stall = result["modes"]["commit"]["stall_s"]
    for row in result["modes"].values():
        row["stall_vs_commit"] = row["stall_s"] / commit_stall
        row.update({f"durable_vs_{k}": row["durable_mb_s"] / v if v and row["durable_mb_s"] else None
                    for k, v in limits.items()})
    return result


def markdown(r: dict[str, Any]) -> str:
    """The result as Markdown (what docs/save_stall.md records)."""
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    limits = r["limits_mb_s"]
    lines = [f"{r['model']}, {r['nproc']} ranks, {r['checkpoint_bytes']:,} checkpoint bytes; durable write limits: "
             f"O_DIRECT+fsync {fmt(limits['o_direct_fsync'], '.0f')} MB/s, buffered+fsync "
             f"{fmt(limits['buffered_fsync'], '.0f')} MB/s", "",
             "| mode | stall (s) | stall / commit's | until durable (s) | durable MB/s | / O_DIRECT limit | "
             "/ buffered limit | snapshot MiB per rank |", "|" + "---|" * 8]
    for mode, m in r["modes"].items():
        lines.append(f"| {mode} | {m['stall_s']:.3f} | {m['stall_vs_commit']:.2f} | {fmt(m['durable_s'], '.3f')} | "
                     f"{fmt(m['durable_mb_s'], '.0f')} | {fmt(m['durable_vs_o_direct_fsync'], '.2f')} | "
                     f"{fmt(m['durable_vs_buffered_fsync'], '.2f')} | {m['snapshot_mib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--output_dir", default="build/bench_stall", help="the filesystem measured")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    result = measure(args.model, args.nproc, Path(args.output_dir).resolve(), args.steps, args.save_every)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
