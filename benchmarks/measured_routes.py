"""The cost model against a real run: every save route measured at each world size, beside its prediction
(`benchmarks/compare_world_sizes.py` is its command; the calibration benchmarks reuse its records).

For each world size N one training launch saves a partitioned checkpoint and runs the in-training routes asked for
(16-bit gather, per-parameter gather); the offline routes (zero_to_fp32, HF export) then run on that checkpoint in
this process. Every figure comes from `measure.meters` (files on disk, host heap and RSS peaks, CUDA allocator peaks on
GPU ranks, each its own figure; DeepSpeed's comms logger) and sits next to `plan.costs.predict` in one `Measured`
record per (route, N, rank). Records accumulate in `DIR/compare.json`, so asking again reuses what was measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from zckpt_nb.errors import LaunchStopped, UsageError
from zckpt_nb.format.records import Route

RESULTS = "compare.json"
IN_TRAINING = {"gathered16": "save_16bit", "per_param": "save_gathered"}  # the routes the worker runs, its options


@dataclass(frozen=True)
class Measured:
    """One route of one run on one rank: what the cost model predicts and what was measured (bytes, seconds)."""

    model: str
    route: str
    world_size: int
    rank: int
    dtype: str
    persistence_threshold: int
    predicted_bytes: int  # tensor bytes this rank writes
    measured_payload_bytes: int  # tensor bytes in the files it wrote
    measured_bytes: int  # the files' sizes
    measured_rank_file_bytes: int | None
    predicted_comm_bytes: int
    logged_comm_bytes: int | None  # DeepSpeed's comms logger (None: no logger)
    logged_comm_ops: dict[str, int]  # op -> calls
    logged_comm_op_bytes: dict[str, int]  # op -> bytes
    protocol_comm_ops: int  # the commit protocol's object collectives (the logger does not see them)
    predicted_extra_peak_bytes: int  # host memory (every term on CPU ranks)
    measured_extra_peak_bytes: int  # host heap (host RSS off glibc: `measured_memory_kind`)
    measured_memory_kind: str
    predicted_cuda_extra_peak_bytes: int | None  # GPU ranks: the gather buffers
    measured_cuda_extra_peak_bytes: int | None
    peak_rss_bytes: int
    seconds: float
    stall_seconds: float | None  # partitioned: training's stall and time to durable (run.json's last save)
    durable_seconds: float | None
    machine: str
    cpus: int | None  # cores CPU ranks shared (None on GPU ranks)


def weights_payload(path: Path) -> int:
    """Tensor bytes in a weights file (.bin or .safetensors), each tensor once (tied weights share one)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
        with safe_open(str(path), "pt") as f:
            slices = [f.get_slice(k) for k in f.keys()]
            return sum(sizes[s.get_dtype()] * math.prod(s.get_shape()) for s in slices)
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    # distinct tensor regions: a tied tensor counts once, a view into a larger buffer only its own bytes
    return sum(size for _, size in {(t.data_ptr(), t.numel() * t.element_size()) for t in state.values()})


def record(run: dict[str, Any], cost: dict[str, Any], shards: dict[int, Any]) -> Measured:
    """The `Measured` record of one route's cost on one rank of `run` (its run.json)."""
    from zckpt_nb.plan.costs import predict

    route, rank, n = cost["mode"], cost["rank"], run["world_size"]
    pred = predict(run["model"], n, run["dtype"], run["persistence_threshold"])
    predicted = pred.saves[route]
    partitioned = route == "partitioned"
    on_gpu = run["device"].startswith("cuda") and route in ("partitioned", *IN_TRAINING)
    own = [m for m in predicted.memory if (m.rank0_bytes if rank == 0 else m.other_bytes)]
    in_cuda = sum(m.rank0_bytes if rank == 0 else m.other_bytes for m in own if m.on_device) if on_gpu else 0
    heap = cost.get("heap_extra_peak_bytes")
    last = run["ranks"][rank]["saves"][-1] if partitioned else {}
    weights = [Path(f) for f in cost["files"] if Path(f).suffix in (".bin", ".safetensors")]
    return Measured(
        model=run["model"], route=route, world_size=n, rank=rank, dtype=run["dtype"],
        persistence_threshold=run["persistence_threshold"],
        predicted_bytes=predicted.written_bytes if partitioned or rank == 0 else 0,
        measured_payload_bytes=shards[rank].payload_bytes if partitioned else sum(map(weights_payload, weights)),
        measured_bytes=cost["bytes_written"],
        measured_rank_file_bytes=shards[rank].bytes if partitioned else None,
        predicted_comm_bytes=predicted.comm_bytes, logged_comm_bytes=cost["comm_bytes"],
        logged_comm_ops={op: v["count"] for op, v in cost["comm_ops"].items()},
        logged_comm_op_bytes={op: v["bytes"] for op, v in cost["comm_ops"].items() if v["bytes"]},
        protocol_comm_ops=cost.get("protocol_comm_ops", 0),
        predicted_extra_peak_bytes=predicted.extra_peak_bytes(rank) - in_cuda,
        measured_extra_peak_bytes=cost["extra_peak_bytes"] if heap is None else heap,
        measured_memory_kind="host RSS" if heap is None else "host heap",
        predicted_cuda_extra_peak_bytes=in_cuda if on_gpu else None,
        measured_cuda_extra_peak_bytes=cost.get("cuda_extra_peak_bytes"),
        peak_rss_bytes=cost["peak_memory_bytes"], seconds=cost["seconds"],
        stall_seconds=last.get("stall_seconds"), durable_seconds=last.get("durable_seconds"),
        machine=platform.node(), cpus=os.cpu_count() if run["device"] == "cpu" else None)


def check_stop(stop: threading.Event | None, what: str) -> None:
    """Raise LaunchStopped before `what` when `stop` is set."""
    if stop is not None and stop.is_set():
        raise LaunchStopped(f"stopped before {what}")


def measure_world_size(model: str, n: int, routes: list[str], out_dir: Path, *, steps: int = 5,
                       persistence_threshold: int = 0, dtype: str = "auto", stop: threading.Event | None = None,
                       **launch_options: Any) -> list[Measured]:
    """Run every asked-for route at world size `n`: one record per (route, rank). `stop` ends the launch (every
    rank killed) or skips the offline routes, raising LaunchStopped; `launch_options` go to `run.launch.launch`."""
    from bench_tools import fresh_dir, measure_export, measure_offline  # benchmarks/bench_tools.py

    from zckpt_nb.convert.inspect import inspect_checkpoint
    from zckpt_nb.measure.meters import flush_writes
    from zckpt_nb.run.launch import launch

    flush_writes()  # the run's partitioned save must not pay for writing back the last world size's files
    run = launch(n, steps, fresh_dir(out_dir / f"{model}_n{n}_t{persistence_threshold}"), save_checkpoint=True,
                 model=model, **{IN_TRAINING[r]: True for r in routes if r in IN_TRAINING}, stop=stop,
                 persistence_threshold=persistence_threshold, dtype=dtype, **launch_options)
    costs = [c for c in run.save_costs if c["mode"] in routes]
    for route, measure in (("offline", measure_offline), ("hf", measure_export)):
        if route in routes:
            check_stop(stop, f"the {route} route at N = {n}")
            costs.append(measure(run.output_dir, run.output_dir / route).to_dict())
    shards = {s.rank: s for s in inspect_checkpoint(run.output_dir).ranks}
    return [record(run, c, shards) for c in costs]


def load_records(out_dir: str | Path) -> list[Measured]:
    """The records measured earlier into `out_dir/compare.json` (none when there is none, or of an older format)."""
    path = Path(out_dir) / RESULTS
    names = {f.name for f in fields(Measured)}
    found = json.loads(path.read_text()) if path.is_file() else []
    return [Measured(**r) for r in found if set(r) == names]


def select(records: Iterable[Measured], model: str, sizes: Iterable[int], routes: Iterable[str],
           threshold: int = 0) -> list[Measured]:
    """The records of this model, these world sizes and routes and this threshold, in route order."""
    sizes, routes = set(sizes), set(routes)
    keep = [r for r in records if r.model == model and r.world_size in sizes and r.route in routes
            and r.persistence_threshold == threshold]
    return sorted(keep, key=lambda r: (list(Route).index(r.route), r.world_size, r.rank))


def missing(records: list[Measured], model: str, sizes: Iterable[int], routes: list[str], threshold: int = 0
            ) -> list[int]:
    """World sizes for which some asked-for route has no record yet (for this persistence threshold)."""
    have = {(r.model, r.world_size, r.route, r.persistence_threshold) for r in records}
    return [n for n in sizes if any((model, n, route, threshold) not in have for route in routes)]


def check_request(sizes: list[int], model: str, routes: list[str]) -> None:
    """Reject bad input with one line before anything runs."""
    from zckpt_nb.model import get_preset
    from zckpt_nb.run.launch import gpu_count

    unknown = [r for r in routes if r not in list(Route)]
    if unknown or not routes:
        raise UsageError(f"unknown or no save routes {unknown}; choose from {', '.join(Route)}")
    gpus = gpu_count()
    if not sizes or min(sizes) < 1 or (gpus and max(sizes) > gpus):
        raise UsageError(f"--nproc values must be >= 1{f' and <= {gpus} GPUs' if gpus else ''} (got {sizes})")
    try:
        get_preset(model)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compare(sizes: list[int], model: str, routes: list[str], output_dir: str | Path, *, reuse: bool = True,
            persistence_threshold: int = 0, on_start: Callable[[int], None] | None = None,
            **options: Any) -> list[Measured]:
    """Measure what is missing (everything with reuse=False), save DIR/compare.json, return the records asked for.

    `on_start(n)` is called before each world size; `options` go to `measure_world_size` (steps, dtype, stop,
    timeout, progress, on_line, ...). A stop raises LaunchStopped; the world sizes done before it stay saved.
    """
    check_request(sizes, model, routes)
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(out) if reuse else []
    t = persistence_threshold
    for n in missing(records, model, sizes, routes, t):
        check_stop(options.get("stop"), f"measuring N = {n}")
        if on_start:
            on_start(n)
        fresh = measure_world_size(model, n, routes, out, persistence_threshold=t, **options)
        done = {(r.route, r.rank) for r in fresh}
        records = [r for r in records if (r.model, r.world_size, r.persistence_threshold) != (model, n, t)
                   or (r.route, r.rank) not in done] + fresh
        (out / RESULTS).write_text(json.dumps([asdict(r) for r in records], indent=1))  # after each N
    return select(records, model, sizes, routes, t)
