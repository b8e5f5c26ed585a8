"""Compare save modes across world sizes: the cost model's predictions against a real run, side by side.

For each world size N one training launch saves a partitioned checkpoint and runs the in-training routes asked
for (16-bit gather, per-parameter gather); the offline routes (zero_to_fp32, HF export) then run on that
checkpoint in this process. Every figure comes from `measure.meters` (files on disk, host heap and RSS peaks, CUDA
allocator peaks on GPU ranks, each its own figure; DeepSpeed's comms logger) and sits next to
`zckpt_nb.plan.costs.predict` in one record per (mode, N, rank).
Results accumulate in `DIR/compare.json`, so asking again reuses what was already measured.
"""

from __future__ import annotations

import json
import os
import platform
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.export import measure_export
from zckpt_nb.convert.inspect import inspect_checkpoint
from zckpt_nb.convert.zero_to_fp32 import measure_offline
from zckpt_nb.errors import LaunchStopped, UsageError
from zckpt_nb.format.records import Route
from zckpt_nb.measure.meters import flush_writes
from zckpt_nb.model import get_preset
from zckpt_nb.plan.costs import Prediction, file_bytes, predict
from zckpt_nb.run.launch import fresh_dir, gpu_count, launch

RESULTS = "compare.json"


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    """Records measured earlier into `out_dir/compare.json` (none when it does not exist, or of an older format)."""
    path = Path(out_dir) / RESULTS
    return [r for r in json.loads(path.read_text()) if "stall_seconds" in r] if path.is_file() else []


def predicted_for(pred: Prediction, mode: str, rank: int) -> dict[str, Any]:
    """One rank's predicted bytes written, collective bytes and extra peak for save `mode`."""
    cost = pred.saves[mode]
    return {"predicted_bytes": cost.written_bytes if mode == "partitioned" or rank == 0 else 0,
            "predicted_comm_bytes": cost.comm_bytes, "predicted_comm_ops": cost.ops,
            "predicted_extra_peak_bytes": cost.extra_peak_bytes(rank)}


def own_terms(pred: Prediction, mode: str, rank: int) -> dict[str, tuple[int, bool]]:
    """A mode's memory terms on `rank`: bytes and whether held where the parameters live."""
    return {m.what: (m.rank0_bytes if rank == 0 else m.other_bytes, m.on_device) for m in pred.saves[mode].memory
            if (m.rank0_bytes if rank == 0 else m.other_bytes)}


IN_TRAINING_OPTIONS = {"gathered16": "save_16bit", "per_param": "save_gathered"}  # routes run by the worker
IN_GPU_RANKS = ("partitioned", *IN_TRAINING_OPTIONS)  # the offline routes run in one CPU process, on any machine


def weights_payload(path: Path) -> int:
    """Tensor bytes in a weights file (.bin or .safetensors), each tensor once (tied weights share one)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return sum(_slice_bytes(f.get_slice(k)) for k in f.keys())
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    # Distinct tensor regions, not whole storages: a tied tensor counts once, and a view into a larger buffer
    # counts only its own bytes (torch.save writes the whole buffer; `measured_bytes` shows that file size).
    regions = {(t.data_ptr(), t.numel() * t.element_size()) for t in state.values()}
    return sum(size for _, size in regions)


def _slice_bytes(sl: Any) -> int:
    """Bytes of one safetensors entry, from its shape and dtype (no data read)."""
    import math

    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
    return math.prod(sl.get_shape()) * sizes[sl.get_dtype()]


def measured_payload(cost: dict[str, Any], shards: dict[int, Any]) -> int:
    """Tensor bytes this save wrote on this rank: shard payload (partitioned) or the weight files' tensors."""
    if cost["mode"] == "partitioned":
        return shards[cost["rank"]].payload_bytes
    weights = [Path(f) for f in cost["files"] if Path(f).suffix in (".bin", ".safetensors")]
    return sum(weights_payload(p) for p in weights)


def file_sizes(run: dict[str, Any], cost: dict[str, Any], shards: dict[int, Any]) -> dict[str, int | None]:
    """A partitioned save's own two files on this rank: predicted (payload + header) and on disk; None otherwise."""
    if cost["mode"] != "partitioned":
        return {"predicted_rank_file_bytes": None, "measured_rank_file_bytes": None}
    predicted = file_bytes(run["model"], run["world_size"], steps=run["steps"][-1] + 1, seed=run["seed"],
                           persistence_threshold=run["persistence_threshold"])
    return {"predicted_rank_file_bytes": predicted, "measured_rank_file_bytes": shards[cost["rank"]].bytes}


def save_times(run: dict[str, Any], cost: dict[str, Any]) -> dict[str, float | None]:
    """A partitioned save's stall and time to durable on this rank (run.json's last save); None for the other routes.

    The other routes run after training (stall is not defined) and none of them fsyncs what it writes.
    """
    if cost["mode"] != "partitioned":
        return {"stall_seconds": None, "durable_seconds": None}
    last = run["ranks"][cost["rank"]]["saves"][-1]
    return {"stall_seconds": last.get("stall_seconds"), "durable_seconds": last.get("durable_seconds")}


def record(run: dict[str, Any], cost: dict[str, Any], shards: dict[int, Any]) -> dict[str, Any]:
    """One comparison row: predicted and measured figures for one (mode, world size, rank) of a run."""
    model, n, threshold = run["model"], run["world_size"], run["persistence_threshold"]
    return {"model": model, "mode": cost["mode"], "world_size": n, "rank": cost["rank"],
            "persistence_threshold": threshold, "dtype": run["dtype"],
            **predicted_for(predict(model, n, run["dtype"], threshold), cost["mode"], cost["rank"]),
            **memory_by_kind(predict(model, n, run["dtype"], threshold), cost, run["device"]),
            **file_sizes(run, cost, shards),
            "measured_bytes": cost["bytes_written"], "measured_payload_bytes": measured_payload(cost, shards),
            "peak_memory_bytes": cost["peak_memory_bytes"], "extra_peak_bytes": cost["extra_peak_bytes"],  # host RSS
            "seconds": cost["seconds"], **save_times(run, cost), "save_mode": run["save_mode"],
            # which machine, and how many cores CPU ranks shared: what a time calibration is fitted per
            "machine": platform.node(), "cpus": os.cpu_count() if run["device"] == "cpu" else None,
            "logged_comm_bytes": cost["comm_bytes"],
            "protocol_comm_bytes": cost.get("protocol_comm_bytes", 0),
            "protocol_comm_ops": cost.get("protocol_comm_ops", 0),
            "logged_comm_ops": {op: v["count"] for op, v in cost["comm_ops"].items()},
            "logged_comm_op_bytes": {op: v["bytes"] for op, v in cost["comm_ops"].items() if v["bytes"]}}


def memory_by_kind(pred: Prediction, cost: dict[str, Any], device: str) -> dict[str, Any]:
    """A save's extra peak memory, predicted and measured, one kind against the same kind only.

    Host: the cost model's host terms against live heap bytes (RSS hides reused pages; RSS only off glibc). CUDA: on
    GPU ranks the terms held where the parameters live (`device_terms`: the gather buffers) against CUDA allocated.
    On CPU ranks every term is host memory. Pinned host bytes (asynchronous snapshots) are kept beside, not compared.
    """
    terms = own_terms(pred, cost["mode"], cost["rank"])
    on_gpu = device.startswith("cuda") and cost["mode"] in IN_GPU_RANKS
    in_cuda = sum(v for v, device_term in terms.values() if device_term) if on_gpu else 0
    heap = cost.get("heap_extra_peak_bytes")
    return {"predicted_extra_peak_bytes": sum(v for v, _ in terms.values()) - in_cuda,
            "measured_extra_peak_bytes": cost["extra_peak_bytes"] if heap is None else heap,
            "measured_memory_kind": "host RSS" if heap is None else "host heap",
            "predicted_cuda_extra_peak_bytes": in_cuda if on_gpu else None,
            "measured_cuda_extra_peak_bytes": cost.get("cuda_extra_peak_bytes"),
            "pinned_host_bytes": cost.get("pinned_host_bytes")}


def check_stop(stop: threading.Event | None, what: str) -> None:
    """Raise LaunchStopped before `what` when `stop` is set."""
    if stop is not None and stop.is_set():
        raise LaunchStopped(f"stopped before {what}")


def measure_world_size(model: str, n: int, modes: list[str], out_dir: Path, *, steps: int = 5,
                       timeout: float | None = None, verbose: bool = False, progress: bool = True,
                       on_line: Callable[[str, str], None] | None = None, stop: threading.Event | None = None,
                       persistence_threshold: int = 0, dtype: str = "auto") -> list[dict[str, Any]]:
    """Run every asked-for mode at world size `n` and return one record per (mode, rank).

    `progress` shows a bar per launch; `on_line` sees the ranks' lines; setting `stop` ends the launch (every rank
    killed) or skips the offline routes, raising LaunchStopped.
    """
    routes = {option: True for mode, option in IN_TRAINING_OPTIONS.items() if mode in modes}
    t = persistence_threshold
    flush_writes()  # the run's partitioned save must not pay for writing back the last world size's files
    run = launch(n, steps, fresh_dir(out_dir / f"{model}_n{n}_t{t}"), save_checkpoint=True, model=model,
                 **routes, timeout=timeout, verbose=verbose, progress=progress, on_line=on_line, stop=stop,
                 persistence_threshold=t, dtype=dtype)
    costs = [c for c in run.data["save_costs"] if c["mode"] in modes]
    if "offline" in modes:
        check_stop(stop, f"the offline conversion at N = {n}")
        costs.append(measure_offline(run.output_dir, run.output_dir / "offline").to_dict())
    if "hf" in modes:
        check_stop(stop, f"the HF export at N = {n}")
        costs.append(measure_export(run.output_dir, run.output_dir / "hf").to_dict())
    shards = {s.rank: s for s in inspect_checkpoint(run.output_dir).ranks}
    return [record(run.data, c, shards) for c in costs]


def missing(records: list[dict[str, Any]], model: str, nprocs: Iterable[int], modes: list[str],
            threshold: int = 0) -> list[int]:
    """World sizes for which some asked-for mode has no record yet (for this persistence threshold)."""
    have = {(r["model"], r["world_size"], r["mode"], r.get("persistence_threshold", 0)) for r in records}
    return [n for n in nprocs if any((model, n, m, threshold) not in have for m in modes)]


def select(records: list[dict[str, Any]], model: str, nprocs: Iterable[int], modes: list[str],
           threshold: int = 0) -> list[dict[str, Any]]:
    """The records for this model, these world sizes and modes and this threshold, in mode order."""
    keep = [r for r in records if r["model"] == model and r["world_size"] in set(nprocs) and r["mode"] in modes
            and r.get("persistence_threshold", 0) == threshold]
    return sorted(keep, key=lambda r: (list(Route).index(r["mode"]), r["world_size"], r["rank"]))


def check_request(nprocs: list[int], model: str, modes: list[str]) -> None:
    """Reject bad input with one line before anything runs."""
    unknown = [m for m in modes if m not in list(Route)]
    if unknown or not modes:
        raise UsageError(f"unknown or no save modes {unknown}; choose from {', '.join(Route)}")
    gpus = gpu_count()
    if not nprocs or min(nprocs) < 1 or (gpus and max(nprocs) > gpus):
        raise UsageError(f"--nproc values must be >= 1{f' and <= {gpus} GPUs' if gpus else ''} (got {nprocs})")
    try:
        get_preset(model)
    except ValueError as e:
        raise UsageError(str(e)) from None


def compare(nprocs: list[int], model: str, modes: list[str], output_dir: str | Path, *, steps: int = 5,
            timeout: float | None = None, reuse: bool = True, verbose: bool = False, progress: bool = True,
            on_start: Callable[[int], None] | None = None, on_line: Callable[[str, str], None] | None = None,
            stop: threading.Event | None = None, persistence_threshold: int = 0,
            dtype: str = "auto") -> list[dict[str, Any]]:
    """Measure what is missing (everything with reuse=False), save DIR/compare.json, return the records asked for.

    `on_start(n)` is called before each world size is measured; `progress`, `on_line` and `stop` go to
    `measure_world_size`. A stop raises LaunchStopped; the world sizes finished before it stay in compare.json.
    """
    check_request(nprocs, model, modes)
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = load_records(out) if reuse else []
    t = persistence_threshold
    for n in missing(records, model, nprocs, modes, t):
        check_stop(stop, f"measuring N = {n}")
        if on_start:
            on_start(n)
        fresh = measure_world_size(model, n, modes, out, steps=steps, timeout=timeout, verbose=verbose,
                                   progress=progress, on_line=on_line, stop=stop, persistence_threshold=t,
                                   dtype=dtype)
        done = {(r["mode"], r["rank"]) for r in fresh}
        records = [r for r in records if not (r["model"] == model and r["world_size"] == n and
                                              r.get("persistence_threshold", 0) == t and
                                              (r["mode"], r["rank"]) in done)] + fresh
        (out / RESULTS).write_text(json.dumps(records, indent=1))  # after each N: an interrupt keeps what was done
    return select(records, model, nprocs, modes, t)


def agreement(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, N): worst payload error against the prediction and whether logged collective bytes matched."""
    rows = []
    for key in sorted({(r["mode"], r["world_size"]) for r in records}, key=lambda k: (list(Route).index(k[0]), k[1])):
        group = [r for r in records if (r["mode"], r["world_size"]) == key]
        errors = [abs(r["measured_payload_bytes"] / r["predicted_bytes"] - 1) for r in group if r["predicted_bytes"]]
        comm = [(r["predicted_comm_bytes"], r["logged_comm_bytes"]) for r in group]
        rows.append({"mode": key[0], "N": key[1], "worst payload error (%)": round(100 * max(errors, default=0), 3),
                     "collective bytes: predicted = logged": all(p == g for p, g in comm),
                     "predicted collective bytes per rank": comm[0][0],
                     "logged per rank": ", ".join(str(g) for _, g in comm),
                     "extra memory, measured / predicted, per rank": ", ".join(memory_ratio(r) for r in group)})
    return rows


def ratio(measured: int, predicted: int) -> str:
    """Measured over predicted, or what was measured when nothing was predicted."""
    return f"{measured / predicted:.2f}" if predicted else f"{measured / 2**20:.2f} MiB (none predicted)"


def memory_ratio(r: dict[str, Any]) -> str:
    """A record's measured extra peak over its predicted one, kind by kind (host; CUDA on GPU ranks)."""
    host = ratio(r["measured_extra_peak_bytes"], r["predicted_extra_peak_bytes"])
    if r.get("measured_cuda_extra_peak_bytes") is None:
        return host
    return f"host {host}, CUDA {ratio(r['measured_cuda_extra_peak_bytes'], r['predicted_cuda_extra_peak_bytes'])}"


def memory_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (mode, N, rank): the cost model's memory terms and their kind beside the measured extra peak, in MiB."""
    rows = []
    for r in records:
        terms = own_terms(predict(r["model"], r["world_size"], r["dtype"], r["persistence_threshold"]), r["mode"],
                          r["rank"])
        cuda = r.get("predicted_cuda_extra_peak_bytes") is not None
        rows.append({"mode": r["mode"], "N": r["world_size"], "rank": r["rank"],
                     "predicted terms (MiB)": "; ".join(f"{t} {v / 2**20:.2f} ({'CUDA' if cuda and on else 'host'})"
                                                        for t, (v, on) in terms.items())
                                              or "none",
                     "predicted host MiB": round(r["predicted_extra_peak_bytes"] / 2**20, 2),
                     f"measured {r.get('measured_memory_kind', 'host heap')} MiB":
                         round(r["measured_extra_peak_bytes"] / 2**20, 2),
                     **cuda_columns(r), "measured / predicted": memory_ratio(r)})
    return rows


def cuda_columns(r: dict[str, Any]) -> dict[str, float]:
    """A GPU rank's CUDA allocated extra peak, predicted and measured, in MiB; nothing on CPU ranks."""
    if r.get("measured_cuda_extra_peak_bytes") is None:
        return {}
    return {"predicted CUDA MiB": round((r["predicted_cuda_extra_peak_bytes"] or 0) / 2**20, 2),
            "measured CUDA allocated MiB": round(r["measured_cuda_extra_peak_bytes"] / 2**20, 2)}


def summary_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The comparison as a table a person reads: one row per (mode, N, rank), sizes in KiB."""
    kib = 1024
    return [{"mode": r["mode"], "N": r["world_size"], "rank": r["rank"],
             "written KiB (pred / meas payload)": f"{r['predicted_bytes'] / kib:,.1f} / "
                                                  f"{r['measured_payload_bytes'] / kib:,.1f}",
             "file KiB": round(r["measured_bytes"] / kib, 1),
             "collective KiB (pred / logged)": f"{r['predicted_comm_bytes'] / kib:,.1f} / "
                                               f"{(r['logged_comm_bytes'] or 0) / kib:,.1f}",
             "commit protocol's object collectives KiB": round(r.get("protocol_comm_bytes", 0) / kib, 1),
             "peak host RSS MiB": round(r["peak_memory_bytes"] / 2**20, 1),
             "extra host peak MiB (pred / meas)": f"{r['predicted_extra_peak_bytes'] / 2**20:.2f} / "
                                                  f"{r['measured_extra_peak_bytes'] / 2**20:.2f}",
             **cuda_columns(r),
             "seconds": round(r["seconds"], 3),
             "stall s / durable s": seconds_pair(r.get("stall_seconds"), r.get("durable_seconds"))} for r in records]


def seconds_pair(stall: float | None, durable: float | None) -> str:
    """'stall / durable' in seconds; '-' for a figure not measured (a route after training, an unsynced save)."""
    return " / ".join("-" if v is None else f"{v:.3f}" for v in (stall, durable))


def op_differences(r: dict[str, Any]) -> list[str]:
    """Each collective op whose logged bytes differ from the prediction, with both figures and the op count."""
    predicted, logged = r["predicted_comm_ops"], r.get("logged_comm_op_bytes", {})
    return [f"{op}: logged {logged.get(op, 0):,} B in {r['logged_comm_ops'].get(op, 0)} ops, predicted "
            f"{predicted.get(op, 0):,} B" for op in sorted(set(predicted) | set(logged))
            if predicted.get(op, 0) != logged.get(op, 0)]


def explain_differences(records: list[dict[str, Any]]) -> list[str]:
    """For every figure that does not equal its prediction: where, and the measured evidence (no guessed cause)."""
    lines = []
    for r in records:
        where = f"{r['mode']} N={r['world_size']} rank {r['rank']}"
        if r["logged_comm_bytes"] is not None and r["logged_comm_bytes"] != r["predicted_comm_bytes"]:
            lines.append(f"{where}: collective bytes differ by op: " + "; ".join(op_differences(r)))
        predicted, files = r.get("predicted_rank_file_bytes"), r.get("measured_rank_file_bytes")
        if predicted and abs(files - predicted) > 0.01 * files:
            lines.append(f"{where}: its two files hold {files:,} bytes against {predicted:,} predicted "
                         f"({predicted / files - 1:+.2%})")
        extra = r["measured_bytes"] - r["measured_payload_bytes"]
        if not predicted and r["measured_payload_bytes"] and extra > 0.01 * r["measured_payload_bytes"]:
            lines.append(f"{where}: the files hold {extra:,} bytes beyond the tensors' {r['measured_payload_bytes']:,} "
                         f"({extra / r['measured_payload_bytes']:.1%}); for this mode the model predicts the tensor "
                         "payload only")
    return lines


