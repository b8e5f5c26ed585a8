"""Every save and conversion route on one checkpoint, side by side, against the disk's durable write floor.

    nice -n 5 .venv/bin/python benchmarks/routes.py --model medium --nproc 2 --repeats 3 [--before DIR]
    .venv/bin/python benchmarks/routes.py --quick   # smoke test: tiny, one rank, one round (tests/test_routes_bench.py)

One training run on `--nproc` CPU ranks writes the checkpoint the conversions read. Then `--repeats` rounds, each
running every route once, in an order rotated from round to round (interleaved, so a slow spell of a shared machine
falls on every route alike):

- the floor: the disk's buffered+fsync write rate, `--nproc` processes each writing one rank's checkpoint bytes at
  once (`save_throughput.disk_limit`); every route's floor is its own written bytes at that round's rate;
- one training launch per save mode (`--save_mode plain`, `commit`, `async`, `async_process`): per save, the slowest
  rank's stall and time to durable (plain fsyncs nothing: no durable time); the stall is the median over the saves
  after the first, and the first save's is given apart (an asynchronous saver allocates its host buffers there and
  reuses them after); for the two asynchronous modes, how much
  longer a step takes while a save is written in the background than a step of the same run with none in flight;
- `to-dcp`, `from-dcp` (of to-dcp's output), `export`, DeepSpeed's `zero_to_fp32.py` without and then with an fsync
  of its output, each as its own process (`python -m zckpt_nb ...`, as users run them), wall time;
- `dcp.save` of the same tensors to-dcp writes, already in memory (read before the clock starts), fsynced: what DCP
  itself takes for those bytes;
- with `--before DIR` (a tree holding another version of the package, e.g. `git archive HEAD zckpt_nb | tar -x -C
  DIR`), to-dcp, from-dcp and export run from it too, in the same rounds: before/after on the same machine state.

Prints, per route, the median and the spread (min-max) over the rounds, and each ratio the issue names, computed
per round and summarised the same way: a goal whose spread straddles its threshold is said to sit inside the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_tools import fresh_dir  # benchmarks/bench_tools.py
from dcp_convert import child_env, fsync_tree  # benchmarks/dcp_convert.py
from save_throughput import disk_limit, launch_mode, rank_bytes, run_records, slowest

from zckpt_nb.convert.verify import newest_committed
from zckpt_nb.course.trace import trace_command
from zckpt_nb.format.layout import universal_dir
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.format.records import RunRecord
from zckpt_nb.run.launch import launch

MODES = ("plain", "commit", "async", "async_process")
CONVERSIONS = ("to-dcp", "from-dcp", "dcp.save (in memory)", "export", "zero_to_fp32.py", "zero_to_fp32.py + fsync")
BEFORE = ("to-dcp", "from-dcp", "export")  # the routes issue 37 changes, run from `--before` too
# A round's figures: route -> {"s": seconds, "stall": seconds or None, "bytes": written}
Round = dict[str, dict[str, Any]]


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def cli(args: list[str], before: Path | None) -> list[str]:
    """`python -m zckpt_nb ARGS`, from the package in `before` where given (first on sys.path, ahead of the cwd)."""
    if before is None:
        return [sys.executable, "-m", "zckpt_nb", *args]
    boot = f"import sys, runpy; sys.path.insert(0, {str(before)!r}); runpy.run_module('zckpt_nb', run_name='__main__')"
    return [sys.executable, "-c", boot, *args]


def timed(command: list[str], env: dict[str, str]) -> float:
    """Run `command` (it must succeed) after flushing dirty pages; its wall seconds."""
    os.sync()  # the previous route's output is not written back during this one
    trace = trace_command(command, env=env, timeout=3600)
    if trace.returncode:
        raise SystemExit(f"{command[-6:]} failed: {trace.output.strip().splitlines()[-3:]}")
    return trace.wall


def dcp_in_memory(ckpt: str, out: str) -> None:
    """(Child process) to-dcp's state dict with every tensor read into memory first, then `dcp.save` of it into
    `out`, fsynced, timed: prints {"s": seconds}."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from zckpt_nb.convert.dcp import dcp_state, plain_source
    from zckpt_nb.convert.verify import listed_files

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tag = newest_committed(Path(ckpt), "benchmarking")
    manifest, _ = listed_files(Path(ckpt), tag)
    source = plain_source(Path(ckpt) / tag, manifest)
    state, sources = dcp_state(source)

    def filled(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: filled(v) for k, v in tree.items()}
        return source.read(*sources[id(tree)]) if id(tree) in sources else tree

    state = filled(state)
    start = time.perf_counter()
    dcp.save(state, storage_writer=FileSystemWriter(out, sync_files=True), no_dist=True)
    print(json.dumps({"s": time.perf_counter() - start}))


def conversion(route: str, ckpt: Path, work: Path, env: dict[str, str], before: Path | None) -> dict[str, Any]:
    """Run one conversion route into a fresh folder under `work`; its seconds and written bytes."""
    name = route.split()[0].replace(".", "_") + ("_before" if before else "")
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    if route == "to-dcp":
        s = timed(cli(["to-dcp", str(ckpt), str(out)], before), env)
    elif route == "from-dcp":
        s = timed(cli(["from-dcp", str(work / "to-dcp"), str(out), "--config", env["ZCKPT_BENCH_MODEL"]], before), env)
    elif route == "export":
        s = timed(cli(["export", str(ckpt), str(out), "--overwrite"], before), env)
    elif route == "dcp.save (in memory)":
        os.sync()
        trace = trace_command([sys.executable, __file__, "--dcp_memory", str(ckpt), str(out)], env=env, timeout=3600)
        if trace.returncode:
            raise SystemExit(f"dcp.save in memory failed: {trace.output.strip().splitlines()[-3:]}")
        s = json.loads(trace.output.strip().splitlines()[-1])["s"]
        return {"s": s, "bytes": folder_bytes(out), "work": s}
    else:  # zero_to_fp32.py, without then with an fsync of its output (one run gives both rows)
        s = timed([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out)], env)
        return {"s": s, "bytes": folder_bytes(out), "fsync_s": fsync_tree(out)}
    return {"s": s, "bytes": folder_bytes(out), "work": work_seconds(route, out)}


def work_seconds(route: str, out: Path) -> float | None:
    """to-dcp's and from-dcp's own seconds (their manifests' `conversion`: the writer, without the process's imports
    and start); None for the other routes."""
    if route == "to-dcp":
        c = read_manifest(out).conversion
        return c["seconds"] + c.get("check_wait_seconds", 0.0)
    if route == "from-dcp":
        return read_manifest(universal_dir(out, newest_committed(out, "benchmarking"))).conversion["seconds"]
    return None


def save_modes(model: str, nproc: int, work: Path, steps: int, save_every: int, order: list[str]) -> Round:
    """One training launch per save mode; per mode the median over its saves after the first of the slowest rank's
    stall, the first save's, the median time to durable, and the checkpoint's bytes."""
    figures: Round = {}
    for mode in order:
        run_dir = launch_mode(model, nproc, mode, work, steps, save_every)
        records = run_records(run_dir, mode)
        durable = slowest(records, mode, "durable_seconds")
        stalls = slowest(records, mode, "stall_seconds")  # per save, in order: the first allocates host buffers
        figures[f"save: {mode}"] = {"stall": statistics.median(stalls[1:] or stalls), "first stall": stalls[0],
                                    "s": statistics.median(durable) if durable else None,
                                    "bytes": sum(rank_bytes(run_dir)), "beside": step_beside_write(run_dir)}
        shutil.rmtree(run_dir, ignore_errors=True)
    return figures


def step_beside_write(run_dir: Path) -> float | None:
    """Median step of every rank that runs while a save is written in the background over its median step with no
    save in flight (the first step, warm-up, and steps that hold a save call left out); None without both kinds."""
    beside, alone = [], []
    for rank in RunRecord.read(run_dir).ranks:
        starts = [*rank.step_starts, rank.loop_seconds]
        saves = [(s.started_at, s.started_at + s.stall_seconds, s.started_at + s.durable_seconds)
                 for s in rank.saves if s.durable_seconds is not None]
        for a, b in zip(starts[1:-1], starts[2:]):
            if any(a <= call < b for call, _, _ in saves):
                continue
            (beside if any(a < durable and b > resumed for _, resumed, durable in saves) else alone).append(b - a)
    return statistics.median(beside) / statistics.median(alone) if beside and alone else None


def one_round(i: int, args: argparse.Namespace, ckpt: Path, work: Path, env: dict[str, str]) -> Round:
    """Round `i`: the floor, the save modes and the conversions, each list rotated by `i`."""
    def rot(xs: Any) -> list[Any]:
        return list(xs)[i % len(xs):] + list(xs)[:i % len(xs)]

    sizes = rank_bytes_of(ckpt)
    rate = disk_limit(work / "floor", sizes, direct=False) * 1e6  # bytes per second, buffered + fsync
    fig: Round = {"floor: buffered+fsync": {"s": sum(sizes) / rate, "bytes": sum(sizes), "rate": rate}}
    fig |= save_modes(args.model, args.nproc, work, args.steps, args.save_every, rot(MODES))
    jobs = [(r, None) for r in CONVERSIONS if r != "zero_to_fp32.py + fsync"]
    jobs += [(r, Path(args.before).resolve()) for r in BEFORE] if args.before else []
    for route, before in rot(jobs):
        if route == "from-dcp" and not (work / "to-dcp").is_dir():
            continue  # run after to-dcp below
        fig[route + (" (before)" if before else "")] = conversion(route, ckpt, work, env, before)
    for route, before in jobs:  # from-dcp reads to-dcp's output: where the rotation put it first, it runs now
        key = route + (" (before)" if before else "")
        if key not in fig:
            fig[key] = conversion(route, ckpt, work, env, before)
    z = fig["zero_to_fp32.py"]
    fig["zero_to_fp32.py + fsync"] = {"s": z["s"] + z.pop("fsync_s"), "bytes": z["bytes"]}
    for row in fig.values():
        row.setdefault("stall", None)
        row.setdefault("work", None)
    return fig


def rank_bytes_of(ckpt: Path) -> list[int]:
    """Each rank's bytes in the checkpoint's newest tag (its model-states and optimizer files)."""
    tag = newest_committed(ckpt, "benchmarking")
    per_rank: dict[str, int] = {}
    for p in (ckpt / tag).glob("*zero_pp_rank_*"):
        rank = p.name.split("zero_pp_rank_")[1].split("_")[0]
        per_rank[rank] = per_rank.get(rank, 0) + p.stat().st_size
    return list(per_rank.values())


def spread(values: list[float | None], spec: str = ".2f") -> str:
    """'median (min-max)' of the rounds' values; '-' where there are none."""
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    return f"{statistics.median(v):{spec}} ({min(v):{spec}}-{max(v):{spec}})" if len(v) > 1 else f"{v[0]:{spec}}"


def table(rounds: list[Round]) -> list[dict[str, str]]:
    """Per route: MB written, stall, seconds (wall, or until durable for a save; in-process where the route records
    it), its floor (its bytes at the round's floor rate), seconds (in-process where known) / floor."""
    rows = []
    for route in rounds[0]:
        runs = [r[route] for r in rounds]
        floors = [r["floor: buffered+fsync"]["rate"] for r in rounds]
        over = [(x["work"] or x["s"]) / (x["bytes"] / f) if x["s"] else None for x, f in zip(runs, floors)]
        rows.append({"route": route, "MB written": f"{statistics.median(x['bytes'] for x in runs) / 1e6:.0f}",
                     "stall s": spread([x["stall"] for x in runs]),
                     "wall (durable) s": spread([x["s"] for x in runs]),
                     "in-process s": spread([x["work"] for x in runs]),
                     "floor s": spread([x["bytes"] / f for x, f in zip(runs, floors)]),
                     "x floor": spread(over)})
    return rows


def ratios(rounds: list[Round]) -> list[dict[str, str]]:
    """The issue's ratios per round, their median and spread, and the goal each is held to (met, not met, or
    inside the noise where the spread straddles it)."""
    def s(r: Round, k: str) -> float:
        return r[k]["work"] or r[k]["s"]

    def floor(r: Round, k: str) -> float:
        return r[k]["bytes"] / r["floor: buffered+fsync"]["rate"]

    wanted: list[tuple[str, Any, float | None, str]] = [
        ("to-dcp / its floor", lambda r: s(r, "to-dcp") / floor(r, "to-dcp"), 1.3, "<="),
        ("from-dcp / its floor", lambda r: s(r, "from-dcp") / floor(r, "from-dcp"), 1.3, "<="),
        ("to-dcp / dcp.save in memory", lambda r: s(r, "to-dcp") / s(r, "dcp.save (in memory)"), 1.2, "<="),
        ("from-dcp / dcp.save in memory", lambda r: s(r, "from-dcp") / s(r, "dcp.save (in memory)"), 1.2, "<="),
        ("export / zero_to_fp32.py + fsync", lambda r: s(r, "export") / s(r, "zero_to_fp32.py + fsync"), 1.0, "<="),
        ("export / zero_to_fp32.py", lambda r: s(r, "export") / s(r, "zero_to_fp32.py"), None, ""),
        ("async stall / plain stall", lambda r: r["save: async"]["stall"] / r["save: plain"]["stall"], 0.10, "<="),
        ("async_process stall / plain stall",
         lambda r: r["save: async_process"]["stall"] / r["save: plain"]["stall"], 0.10, "<="),
        ("async first save's stall / plain stall",
         lambda r: r["save: async"]["first stall"] / r["save: plain"]["stall"], None, ""),
        ("async_process first save's stall / plain stall",
         lambda r: r["save: async_process"]["first stall"] / r["save: plain"]["stall"], None, ""),
        ("commit rate / floor rate", lambda r: floor(r, "save: commit") / s(r, "save: commit"), 0.8, ">="),
        ("async: step beside a write / alone", lambda r: r["save: async"]["beside"], 1.15, "<="),
        ("async_process: step beside a write / alone", lambda r: r["save: async_process"]["beside"], 1.15, "<="),
    ]
    if "to-dcp (before)" in rounds[0]:
        wanted += [(f"{k} after / before", lambda r, k=k: s(r, k) / s(r, f"{k} (before)"), None, "") for k in BEFORE]
    rows = []
    for name, f, goal, op in wanted:
        v = [x for x in (f(r) for r in rounds) if x is not None]  # a run too short for a figure has none
        ok = [x <= goal if op == "<=" else x >= goal for x in v] if goal is not None else []
        verdict = "-" if not ok else "met" if all(ok) else "not met" if not any(ok) else "inside the noise"
        rows.append({"ratio": name, "median (min-max)": spread(v), "goal": f"{op} {goal}" if goal else "-",
                     "verdict": verdict})
    return rows


def text_table(rows: list[dict[str, str]]) -> str:
    """Rows as aligned plain text."""
    cells = [list(rows[0]), *[list(r.values()) for r in rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps of each save-mode launch")
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--before", help="a tree holding another zckpt_nb: to-dcp, from-dcp and export from it too")
    parser.add_argument("--output_root", default="build/bench/routes")
    parser.add_argument("--json", help="also write every round's figures here")
    parser.add_argument("--pycache", default="~/.cache/zckpt_nb/pycache",
                        help="the routes' bytecode cache, kept between runs (each process would compile torch else)")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny on one rank, one round, one save")
    parser.add_argument("--dcp_memory", nargs=2, help=argparse.SUPPRESS)  # the in-memory dcp.save, in a child
    args = parser.parse_args()
    if args.dcp_memory:
        return dcp_in_memory(*args.dcp_memory)
    if args.quick:
        args.model, args.nproc, args.repeats, args.steps, args.save_every = "tiny", 1, 1, 1, 1
    print(f"command: python {' '.join(sys.argv)}\n{os.cpu_count()} CPU cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    work = fresh_dir(Path(args.output_root, args.model).resolve())
    ckpt = work / "ckpt"
    launch(args.nproc, 1, ckpt, save_checkpoint=True, model=args.model, timeout=3600, progress=False, verbose=False)
    env = child_env(Path(args.pycache).expanduser()) | {"ZCKPT_BENCH_MODEL": args.model}
    timed([sys.executable, "-c", "import zckpt_nb.cli, zckpt_nb.convert.dcp, zckpt_nb.convert.export, "
           "torch.distributed.checkpoint, deepspeed.utils.zero_to_fp32"], env)  # warm the bytecode cache
    rounds = [one_round(i, args, ckpt, work, env) for i in range(args.repeats)]
    print(f"\n{args.model}, {args.nproc} ranks, {len(rounds)} rounds interleaved: median (min-max); load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print(text_table(table(rounds)), "", text_table(ratios(rounds)), sep="\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
