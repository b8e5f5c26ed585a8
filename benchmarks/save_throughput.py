"""How fast each save mode makes a checkpoint durable, against what the filesystem itself allows, and its stall.

In one run, on the filesystem of --output_dir:
1. one training launch per save mode (`measure_all` below: plain, commit, async), saving every few
   steps; per save, the slowest rank's stall and time to durable;
2. two durable write limits with the same shape as a checkpoint: N processes at once, each writing one file of its
   rank's checkpoint bytes, with O_DIRECT + fsync (no page cache) and buffered + fsync;
3. each mode's durable MB/s (checkpoint bytes over the median time to durable) and its ratios to those limits and
   to the commit protocol's stall;
4. anchors from PyTorch: `torch.distributed.checkpoint.save` (fsynced) and `async_save` on N ranks, each rank
   saving tensors of its checkpoint bytes (fp32 weights and two Adam moments, under keys of its own so nothing is
   deduplicated), `--dcp_repeats` times each: the seconds the call blocks and the seconds until it is durable.

    PYTHONPATH=. python benchmarks/save_throughput.py --model small --nproc 2 --output_dir build/bench_stall
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench_tools import fresh_dir, rank_errors  # benchmarks/bench_tools.py

from zckpt_nb.errors import LaunchError
from zckpt_nb.format.records import SaveMode
from zckpt_nb.run.launch import RunResult, launch

NEEDS_ACCELERATOR = ("ds_fast",)  # FastPersist's writer: pinned buffers and async I/O, refused on CPU ranks


def run_records(run_dir: Path, mode: str) -> list[dict[str, Any]]:
    """Every save of every rank of the run in `run_dir` (its run.json), with the mode that made it; a later step's
    wait for DeepSpeed's decoupled writer counts in the stall."""
    run = RunResult.from_dir(Path(run_dir), [], 0.0)
    return [{"mode": mode, "rank": r["rank"], "tag": s["tag"], "durable_seconds": s["durable_seconds"],
             "stall_seconds": s["stall_seconds"] + (s.get("commit_wait_seconds") or 0.0),
             "snapshot_bytes": s.get("snapshot_bytes") or 0} for r in run.ranks for s in r["saves"]]


def launch_mode(model: str, nproc: int, mode: str, out: Path, steps: int, save_every: int) -> Path:
    """One training launch with `--save_mode mode` into a fresh OUT/stall_<mode>; that folder."""
    return launch(nproc, steps, fresh_dir(out / f"stall_{mode}"), save_every=save_every, model=model, save_mode=mode,
                  verbose=False, progress=False, timeout=600).output_dir


def measure_all(model: str, nproc: int, modes: list[str], tries: list[str], out: Path, *, steps: int,
                save_every: int) -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    """One launch per mode of `modes`; each of `tries` once, its error line kept if it cannot run."""
    records = [r for m in modes for r in run_records(launch_mode(model, nproc, m, out, steps, save_every), m)]
    tried: dict[str, str | None] = {}
    for mode in tries:
        try:
            records += run_records(launch_mode(model, nproc, mode, out, steps, save_every), mode)
            tried[mode] = None
        except LaunchError:
            tried[mode] = rank_errors(out / f"stall_{mode}").get("rank 0", "no line from rank 0")
    return records, tried

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


def dcp_worker(sizes: list[int], root: Path, repeats: int) -> None:
    """One rank of the DCP anchor (run under torchrun): `dcp.save` and `dcp.async_save` of this rank's bytes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = sizes[rank] // 12  # fp32 weights + two Adam moments, 4 bytes each
    state = {f"rank{rank}.{k}": torch.randn(n) for k in ("fp32", "exp_avg", "exp_avg_sq")}
    figures = []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=str(root / f"save{i}"))
        saved = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / f"async{i}"))
        returned = time.perf_counter() - start
        future.result()
        figures.append({"save_s": saved, "async_stall_s": returned, "async_durable_s": time.perf_counter() - start})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        print("DCP " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank


def dcp_anchor(sizes: list[int], root: Path, repeats: int, timeout: float = 900) -> dict[str, float]:
    """Median over repeats of the slowest rank's `dcp.save` seconds and `async_save` stall and durable seconds."""
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(sizes)}",
               __file__, "--dcp_worker", json.dumps(sizes), str(root), str(repeats)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank, not just torchrun
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    line = next((x for x in out.splitlines() if x.startswith("DCP ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"the DCP anchor failed ({proc.returncode}): {out[-2000:]}")
    per_rank = json.loads(line[4:])
    return {key: statistics.median(max(rank[i][key] for rank in per_rank) for i in range(repeats))
            for key in ("save_s", "async_stall_s", "async_durable_s")}


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


def measure(model: str, nproc: int, out: Path, steps: int, save_every: int, dcp_repeats: int) -> dict[str, Any]:
    """The save modes, then the two write limits and the DCP anchors on the same filesystem; every figure and
    ratio."""
    runs_here = [m for m in SaveMode if m not in NEEDS_ACCELERATOR]
    records, tried = measure_all(model, nproc, runs_here, list(NEEDS_ACCELERATOR), out, steps=steps,
                                       save_every=save_every)
    sizes = rank_bytes(out / "stall_commit")
    limits = {"o_direct_fsync": disk_limit(out / "limit_direct", sizes, True),
              "buffered_fsync": disk_limit(out / "limit_buffered", sizes, False)}
    result: dict[str, Any] = {"model": model, "nproc": nproc, "checkpoint_bytes": sum(sizes),
                              "limits_mb_s": limits, "modes": {},
                              "could_not_run": {m: why for m, why in tried.items() if why},
                              "dcp": dcp_anchor(sizes, out / "dcp", dcp_repeats) if dcp_repeats else None}
    for mode in dict.fromkeys(r["mode"] for r in records):
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
    if r["dcp"]:
        d, size = r["dcp"], r["checkpoint_bytes"]
        for name, stall_s, durable_s in (("dcp.save", d["save_s"], d["save_s"]),
                                         ("dcp.async_save", d["async_stall_s"], d["async_durable_s"])):
            mb_s = size / durable_s / 1e6
            direct = mb_s / limits["o_direct_fsync"] if limits["o_direct_fsync"] else None
            lines.append(f"| {name} (anchor) | {stall_s:.3f} | {stall_s / r['modes']['commit']['stall_s']:.2f} | "
                         f"{durable_s:.3f} | {mb_s:.0f} | {fmt(direct, '.2f')} | "
                         f"{mb_s / limits['buffered_fsync']:.2f} | - |")
    lines += [f"| {mode} | could not run here: {why} |" + " |" * 6 for mode, why in r["could_not_run"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--output_dir", default="build/bench_stall", help="the filesystem measured")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--dcp_repeats", type=int, default=3, help="saves per DCP anchor (0: skip the anchors)")
    parser.add_argument("--dcp_worker", nargs=3, help=argparse.SUPPRESS)  # one rank of the anchor, under torchrun
    args = parser.parse_args()
    if args.dcp_worker:
        return dcp_worker(json.loads(args.dcp_worker[0]), Path(args.dcp_worker[1]), int(args.dcp_worker[2]))
    result = measure(args.model, args.nproc, Path(args.output_dir).resolve(), args.steps, args.save_every,
                     args.dcp_repeats)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
