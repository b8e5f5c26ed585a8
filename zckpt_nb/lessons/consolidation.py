"""Notebooks 04 and 04: the consolidated routes proven equal, and their costs against the principle's table.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import REFERENCE, WEIGHTS
from zckpt_nb.lessons.compare import MODES

FP32_BYTES = 4  # the offline route and the export write fp32 masters


def reference_state_dict(output_dir: str | Path) -> dict[str, Any]:
    """Join the per-rank partitions `save_reference` wrote into full fp32 tensors, with plain torch.

    ZeRO-3 splits each flattened parameter into N equal slices (the last padded), slice r on rank r; written by
    hand on purpose: using DeepSpeed's own consolidation here would make the check circular.
    """
    import torch

    paths = sorted((Path(output_dir) / REFERENCE).glob("partitions_rank*.pt"),
                   key=lambda p: int(p.stem.removeprefix("partitions_rank")))
    ranks = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    state = {}
    for name, part in ranks[0].items():
        flat = torch.cat([r[name]["shard"].reshape(-1) for r in ranks])
        numel = int(torch.Size(part["shape"]).numel())
        state[name] = flat[:numel].view(part["shape"]).clone()
    return state


def load_weights(path: str | Path) -> dict[str, Any]:
    """A state dict from any route's output: a `.bin`/`.safetensors` file, or a folder (sharded or not)."""
    import json

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index_name).is_file():
            shards = sorted(set(json.loads((path / index_name).read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in load_weights(path / shard).items()}
    for name in ("model.safetensors", WEIGHTS):
        if (path / name).is_file():
            return load_weights(path / name)
    raise FileNotFoundError(f"no model weights (model.safetensors, {WEIGHTS} or an index) in {path}")


def compare_weights(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """How `candidate` differs from `reference`: missing names, extra names, and the largest abs difference.

    `exact` is True only when every reference tensor is present with the same shape, dtype-cast and bit-equal.
    """
    import torch

    candidate = {n: t.detach() for n, t in candidate.items()}
    reference = {n: t.detach() for n, t in reference.items()}  # either side may come from a live model
    missing = sorted(set(reference) - set(candidate))
    shared = [n for n in reference if n in candidate]
    bad_shape = sorted(n for n in shared if tuple(candidate[n].shape) != tuple(reference[n].shape))
    diffs = {n: float((candidate[n].float() - reference[n].float()).abs().max()) for n in shared if n not in bad_shape}
    exact = not missing and not bad_shape and all(torch.equal(candidate[n].float(), reference[n].float())
                                                  for n in diffs)
    return {"tensors": len(diffs), "missing": missing, "extra": sorted(set(candidate) - set(reference)),
            "bad_shape": bad_shape, "max_abs_diff": max(diffs.values(), default=0.0),
            "dtypes": sorted({str(candidate[n].dtype) for n in shared}), "exact": exact}


def last_per_rank(costs: list[dict[str, Any]], mode: str) -> dict[int, dict[str, Any]]:
    """The newest record of `mode` for each rank (a run with --save_every has several partitioned saves)."""
    return {c["rank"]: c for c in costs if c["mode"] == mode}


def op_bytes(cost: dict[str, Any], prefix: str) -> int:
    """Logged bytes of the collectives whose name starts with `prefix` (e.g. 'all_gather', 'broadcast')."""
    return sum(o["bytes"] for name, o in cost["comm_ops"].items() if name.startswith(prefix))


def largest(records: list[dict[str, Any]], key: str, scale: float = 1.0, digits: int = 3) -> float | str:
    """The largest `key` over `records`, scaled and rounded; '-' when there are none or it was not measured."""
    values = [c.get(key) for c in records]
    if not values or None in values:
        return "-"
    return round(max(values) / scale, digits)


def cost_summary(costs: list[dict[str, Any]], num_params: int, param_bytes: int = 4) -> list[dict[str, Any]]:
    """One row per route: rank 0 against the other ranks, and bytes moved or written against the full model.

    "all-gathered" adds every rank's logged slice, i.e. the bytes each rank ends up receiving once assembled;
    "broadcast" is rank 0's logged tensor bytes. Both are divided by the full model, P x `param_bytes`.
    """
    full, rows, m = num_params * param_bytes, [], 2**20
    for mode in MODES:
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        r0, others = [by_rank[0]], [c for r, c in by_rank.items() if r != 0]
        rows.append({
            "route": mode, "seconds, rank 0": largest(r0, "seconds"),
            "seconds, other ranks": largest(others, "seconds"),
            "extra RSS MiB, rank 0": largest(r0, "extra_peak_bytes", m, 1),
            "extra RSS MiB, other ranks": largest(others, "extra_peak_bytes", m, 1),
            "extra heap MiB, rank 0": largest(r0, "heap_extra_peak_bytes", m, 1),
            "extra heap MiB, other ranks": largest(others, "heap_extra_peak_bytes", m, 1),
            "written MiB, rank 0": largest(r0, "bytes_written", m, 2),
            "written MiB, other ranks": largest(others, "bytes_written", m, 2),
            "read MiB": largest(r0, "bytes_read", m, 2),
            "all-gathered / model": round(sum(op_bytes(c, "all_gather") for c in by_rank.values()) / full, 3),
            "broadcast / model": round(op_bytes(r0[0], "broadcast") / full, 3),
            "collective ops, rank 0": sum(o["count"] for o in r0[0]["comm_ops"].values()),
        })
    return rows


def mib(n: float) -> str:
    """Bytes as MiB, for sentences."""
    return f"{n / 2**20:,.2f} MiB"


# The principle's table, verbatim: (scenario, approach, memory required, communication). Routes map to its rows:
# the in-job gathers and the offline conversion are consolidated saves; the HF export is its cross-framework export.
SEED_ROWS = {
    "partitioned": ("Training resumption", "Partitioned save", "P/N per rank", "None (each rank saves locally)"),
    "gathered16": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "per_param": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "offline": ("Inference/deployment", "Consolidated save", "Full P on rank 0", "All-gather across N ranks"),
    "hf": ("Cross-framework export", "Consolidated + conversion", "Full P on rank 0",
           "All-gather + format conversion"),
}


def memory_agrees(mode: str, by_rank: dict[int, dict[str, Any]], full: int) -> bool:
    """The table's memory claim against the measured heap peaks: P/N per rank, or the full P on rank 0 only."""
    heap = {r: c.get("heap_extra_peak_bytes") or c["extra_peak_bytes"] for r, c in by_rank.items()}
    if mode == "partitioned":  # no rank needs more than its own share (fp32 weights + Adam: 12 B per element)
        return max(heap.values()) <= 3 * full / len(by_rank)
    return heap[0] >= 0.9 * full and all(v < 0.5 * full for r, v in heap.items() if r)


def comm_agrees(mode: str, by_rank: dict[int, dict[str, Any]], full: int) -> bool:
    """The table's communication claim against DeepSpeed's logged collectives."""
    if mode == "partitioned":
        return all(c["comm_bytes"] == 0 for c in by_rank.values())
    return sum(op_bytes(c, "all_gather") for c in by_rank.values()) >= 0.99 * full  # every element gathered


def seed_vs_measured(costs: list[dict[str, Any]], num_params: int, param_bytes: int = 4) -> list[dict[str, Any]]:
    """The principle's table row by row, what was measured, and whether each claim held (computed)."""
    rows = []
    for mode, (scenario, approach, memory, comm) in SEED_ROWS.items():
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        full = num_params * (param_bytes if mode in ("gathered16", "per_param") else FP32_BYTES)
        got = (partitioned_line(by_rank, num_params) if mode == "partitioned"
               else gathered_line(by_rank, full) if mode in ("gathered16", "per_param")
               else offline_line(by_rank[0]))
        rows.append({"route": mode, "the principle's row": f"{scenario}: {approach}", "memory it states": memory,
                     "memory held": "yes" if memory_agrees(mode, by_rank, full) else "no",
                     "communication it states": comm,
                     "communication held": "yes" if comm_agrees(mode, by_rank, full) else "no", "measured": got})
    return rows


def heap_mib(cost: dict[str, Any]) -> str:
    """A record's extra peak heap as '+x MiB'."""
    return f"+{mib(cost.get('heap_extra_peak_bytes') or 0)}"


def partitioned_line(by_rank: dict[int, dict[str, Any]], num_params: int) -> str:
    """Measured figures of the partitioned save, against P/N x 12 bytes per rank."""
    files = ", ".join(mib(by_rank[r]["bytes_written"]) for r in sorted(by_rank))
    return (f"rank files {files} (P/N x 12 B of fp32 weights and Adam moments = "
            f"{mib(12 * num_params / len(by_rank))}); collectives {by_rank[0]['comm_bytes']} B")


def gathered_line(by_rank: dict[int, dict[str, Any]], full: int) -> str:
    """Measured figures of routes 1 and 2, against the full model on rank 0 and one all-gather of it."""
    r0, others = by_rank[0], [c for r, c in by_rank.items() if r]
    gathered = sum(op_bytes(c, "all_gather") for c in by_rank.values())
    gathers = r0["comm_ops"].get("all_gather_into_tensor", {})
    largest = gathers.get("max_bytes", 0) * len(by_rank)  # the logger records one rank's slice
    other_heap = f"; other ranks {heap_mib(max(others, key=lambda c: c.get('heap_extra_peak_bytes') or 0))}" * bool(
        others)
    return (f"rank 0 wrote {mib(r0['bytes_written'])} (full P = {mib(full)}), heap peak {heap_mib(r0)}{other_heap}; "
            f"all-gathered {gathered / full:.2f} x P in {gathers.get('count', 0)} ops, largest {mib(largest)}; "
            f"broadcast {op_bytes(r0, 'broadcast') / full:.2f} x P")


def offline_line(r0: dict[str, Any]) -> str:
    """Measured figures of routes 3 and 4: no communication, every shard read."""
    return (f"collectives {r0['comm_bytes']} B; read {mib(r0['bytes_read'])} of shards; wrote "
            f"{mib(r0['bytes_written'])}; RSS peak +{mib(r0['extra_peak_bytes'])}, heap peak {heap_mib(r0)}")


def summary_latency(output_dir: str | Path) -> dict[str, dict[str, float]]:
    """Rank 0's `deepspeed.comm.log_summary` table from DIR/launch.log: op -> {'count', 'total_ms'}."""
    import re

    ops: dict[str, dict[str, float]] = {}
    op, in_table = None, False
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        if not line.startswith("[rank 0] "):
            continue
        text = line[len("[rank 0] "):]
        in_table = in_table or text.startswith("Comm. Op")
        m = re.match(r"\s+[\d.]+ [KMG]?B\s+(\d+)\s+([\d.]+)", text)
        if in_table and re.match(r"[a-z_]+$", text.strip()):
            op = text.strip()
        elif in_table and op and m:
            entry = ops.setdefault(op, {"count": 0, "total_ms": 0.0})
            entry["count"] += int(m.group(1))
            entry["total_ms"] += float(m.group(2))
    return ops


def mib_or_dash(n: int | None) -> float | str:
    """Bytes as MiB rounded for a table, or '-' when not measured."""
    return "-" if n is None else round(n / 2**20, 2)


def cost_rows(costs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One display row per (mode, rank): the figures in units people read (s, MiB, KiB)."""
    order = {m: i for i, m in enumerate(MODES)}
    rows = []
    for c in sorted(costs, key=lambda c: (order.get(c["mode"], len(order)), c["rank"])):
        comm = c["comm_bytes"]
        rows.append({"mode": c["mode"], "rank": c["rank"], "seconds": round(c["seconds"], 3),
                     "peak memory (MiB)": round(c["peak_memory_bytes"] / 2**20, 1),
                     "extra peak (MiB)": round(c["extra_peak_bytes"] / 2**20, 2),
                     "extra heap peak (MiB)": mib_or_dash(c.get("heap_extra_peak_bytes")),
                     "written (KiB)": round(c["bytes_written"] / 2**10, 1),
                     "read (KiB)": round(c.get("bytes_read", 0) / 2**10, 1),
                     "collective bytes (KiB)": "not logged" if comm is None else round(comm / 2**10, 1),
                     "collective ops": sum(o["count"] for o in c.get("comm_ops", {}).values())})
    return rows
