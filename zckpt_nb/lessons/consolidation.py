"""Notebook 04: the consolidated routes proven equal, their costs against the principle's table, the reload checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import REFERENCE, WEIGHTS
from zckpt_nb.format.records import Route
from zckpt_nb.format.units import counted

FP32_BYTES = 4  # the offline route and the export write fp32 masters
WORKING_ROUTES = ("gathered16", "per_param")  # routes 1-2: the weights the engine computes with, in the run's dtype
MASTER_ROUTES = ("offline", "hf")  # routes 3-4: the optimizer's fp32 master weights


def bytes_per_param(dtype: str) -> int:
    """Bytes of one working weight in a run's dtype (run.json's `dtype`): 2 for bf16, 4 for fp32."""
    return 2 if dtype == "bf16" else FP32_BYTES


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
    "broadcast" is rank 0's logged tensor bytes. Both are divided by the full model the route moves: P x
    `param_bytes` (the run's working dtype, `bytes_per_param`) for the in-job routes, P x 4 for the fp32 masters.
    """
    rows, m = [], 2**20
    for mode in Route:
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        full = num_params * (FP32_BYTES if mode in MASTER_ROUTES else param_bytes)
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


# The columns a notebook shows of `cost_summary` (at most 8; the benchmark prints them all), each with its format
ROUTE_COLUMNS = {"route": "{}", "seconds, rank 0": "{:.3f}", "extra heap MiB, rank 0": "{:.1f}",
                 "extra heap MiB, other ranks": "{:.1f}", "written MiB, rank 0": "{:.2f}", "read MiB": "{:.2f}",
                 "all-gathered / model": "{:.2f}", "broadcast / model": "{:.2f}"}


def route_table(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`cost_summary`'s rows narrowed to `ROUTE_COLUMNS`, one number format per column, for display."""
    return [{k: "-" if r[k] == "-" else v.format(r[k]) for k, v in ROUTE_COLUMNS.items()} for r in summary]


def offline_costs(ckpt_dir: str | Path, out_root: str | Path) -> tuple[Any, Any]:
    """Routes 3 and 4 run and measured in this process (OUT_ROOT/offline, OUT_ROOT/hf), DeepSpeed's progress
    lines and bars kept off the notebook (they describe its loop, not the result)."""
    import contextlib
    import io

    from zckpt_nb.convert.export import measure_export
    from zckpt_nb.convert.zero_to_fp32 import measure_offline

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        offline = measure_offline(ckpt_dir, Path(out_root) / "offline")
        hf = measure_export(ckpt_dir, Path(out_root) / "hf", overwrite=True)
    return offline, hf


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


def comm_agrees(mode: str, by_rank: dict[int, dict[str, Any]], full: int) -> str:
    """The table's communication claim against DeepSpeed's logged collectives: 'yes', 'no', or for a partitioned
    save that moved under 1% of the model (DeepSpeed's tag checks), 'imprecise' with the bytes."""
    if mode == "partitioned":
        moved = max((c["comm_bytes"] or 0) for c in by_rank.values())
        return "yes" if moved == 0 else f"imprecise: {moved:,} B per rank" if moved < 0.01 * full else "no"
    return "yes" if sum(op_bytes(c, "all_gather") for c in by_rank.values()) >= 0.99 * full else "no"


def seed_vs_measured(costs: list[dict[str, Any]], num_params: int, param_bytes: int = 4) -> list[dict[str, Any]]:
    """The principle's table row by row, what was measured, and whether each claim held (computed)."""
    rows = []
    for mode, (scenario, approach, memory, comm) in SEED_ROWS.items():
        by_rank = last_per_rank(costs, mode)
        if not by_rank:
            continue
        full = num_params * (param_bytes if mode in WORKING_ROUTES else FP32_BYTES)
        got = (partitioned_line(by_rank, num_params) if mode == "partitioned"
               else gathered_line(by_rank, full) if mode in ("gathered16", "per_param")
               else offline_line(by_rank[0]))
        rows.append({"route": mode, "the principle's row": f"{scenario}: {approach}", "memory it states": memory,
                     "memory claim holds?": "yes" if memory_agrees(mode, by_rank, full) else "no",
                     "communication it states": comm,
                     "communication claim holds?": comm_agrees(mode, by_rank, full), "measured": got})
    return rows


def heap_mib(cost: dict[str, Any]) -> str:
    """A record's extra peak heap as '+x.x MiB' (one decimal, as `ROUTE_COLUMNS` shows heap)."""
    return f"+{(cost.get('heap_extra_peak_bytes') or 0) / 2**20:,.1f} MiB"


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


SIZE_UNITS = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}  # deepspeed.utils.comms_logging.convert_size's units


def deepspeed_comms_table(output_dir: str | Path) -> dict[str, dict[str, float]]:
    """Rank 0's `deepspeed.comm.log_summary` table from DIR/launch.log: op -> {'count', 'bytes'} (message sizes as
    DeepSpeed prints them, rounded to one decimal). DeepSpeed returns no such figures, it only prints them."""
    import re

    ops: dict[str, dict[str, float]] = {}
    op, in_table = None, False
    for line in (Path(output_dir) / "launch.log").read_text().splitlines():
        if not line.startswith("[rank 0] "):
            continue
        text = line[len("[rank 0] "):]
        in_table = in_table or text.startswith("Comm. Op")
        m = re.match(r"\s+([\d.]+) ?([KMG]?B)\s+(\d+)\s", text)
        if in_table and re.match(r"[a-z_]+$", text.strip()):
            op = text.strip()
        elif in_table and op and m:
            entry = ops.setdefault(op, {"count": 0, "bytes": 0.0})
            entry["count"] += int(m.group(3))
            entry["bytes"] += float(m.group(1)) * SIZE_UNITS[m.group(2)] * int(m.group(3))
    return ops


def comms_rows(output_dir: str | Path, costs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DeepSpeed's own table of routes 1 and 2 (rank 0) beside the sum of this package's per-save records of them."""
    table = deepspeed_comms_table(output_dir)
    mine = [c for c in costs if c["rank"] == 0 and c["mode"] in WORKING_ROUTES]
    rows = []
    for op, logged in table.items():
        if logged["bytes"] == 0:  # log_summary's own barrier: not part of a save
            continue
        ours = [c["comm_ops"].get(op, {}) for c in mine]
        rows.append({"collective": op, "calls on rank 0, DeepSpeed's table": f"{logged['count']:,}",
                     "calls on rank 0, per-save records": f"{sum(o.get('count', 0) for o in ours):,}",
                     "MiB on rank 0, DeepSpeed's table": f"{logged['bytes'] / 2**20:.2f}",
                     "MiB on rank 0, per-save records": f"{sum(o.get('bytes', 0) for o in ours) / 2**20:.2f}"})
    return rows


def comms_sentence(rows: list[dict[str, Any]], output_dir: str | Path) -> str:
    """Whether DeepSpeed's table and the per-save records agree (calls equal, bytes within DeepSpeed's rounding)."""
    agree = all(r["calls on rank 0, DeepSpeed's table"] == r["calls on rank 0, per-save records"] and abs(
        float(r["MiB on rank 0, DeepSpeed's table"]) - float(r["MiB on rank 0, per-save records"])) <= 0.05 * max(
        float(r["MiB on rank 0, per-save records"]), 0.01) for r in rows)
    return (f"DeepSpeed's own summary (`deepspeed.comm.log_summary()`, printed by rank 0 after routes 1 and 2, in full "
            f"in `{Path(output_dir) / 'launch.log'}`) and the per-save records "
            + ("agree: the same calls, and bytes within DeepSpeed's rounding of each message size to one decimal."
               if agree else "DISAGREE (see the table): read the log.")
            + " Its latency columns are left out: they are running totals since the job began (`timed_op` in "
              "`deepspeed/comm/comm.py`), not the time of these saves.")


def mib_or_dash(n: int | None) -> float | str:
    """Bytes as MiB rounded for a table, or '-' when not measured."""
    return "-" if n is None else round(n / 2**20, 2)


def cost_rows(costs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One display row per (mode, rank): the figures in units people read (s, MiB, KiB)."""
    order = {m: i for i, m in enumerate(Route)}
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


def proof_rows(reference: dict[str, Any], outputs: dict[str, str | Path], dtype: str) -> list[dict[str, Any]]:
    """Each route against the weights it must hold, `reference` being the engine's working weights
    (`reference_state_dict`): routes 1-2 as stored; routes 3-4 hold the fp32 masters, which in a bf16 run are
    compared after rounding to bf16 (DeepSpeed makes the working weights that way after every step)."""
    import torch

    rows = []
    for route, path in outputs.items():
        weights = load_weights(path)
        rounded = dtype == "bf16" and route in MASTER_ROUTES
        result = compare_weights({n: t.to(torch.bfloat16) for n, t in weights.items()} if rounded else weights,
                                 reference)
        stored = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
        rows.append({"route": route,
                     "holds": "fp32 masters" if route in MASTER_ROUTES else f"{dtype} working weights",
                     "dtype in file": ", ".join(stored),
                     "compared with": f"engine's {dtype} weights" + (", masters rounded to bf16" if rounded else ""),
                     "tensors": result["tensors"], "missing": len(result["missing"]),
                     "max abs difference as stored": f"{compare_weights(weights, reference)['max_abs_diff']:.1e}",
                     "equal": "yes" if result["exact"] else "NO"})
    return rows


def proof_sentence(rows: list[dict[str, Any]], dtype: str) -> str:
    """What the proof table says, in one or two sentences."""
    equal = [r["route"] for r in rows if r["equal"] == "yes"]
    differ = [r for r in rows if float(r["max abs difference as stored"]) > 0]
    text = (f"{len(equal)} of {len(rows)} routes hold bit for bit the weights they should "
            f"({', '.join(equal) or 'none'}).")
    if differ:
        text += (" As stored, " + ", ".join(f"{r['route']} differs from the engine's {dtype} weights by up to "
                                           f"{r['max abs difference as stored']}" for r in differ)
                 + ": the fp32 masters carry the bits bf16 rounds away, so an fp32 export is slightly more than the"
                 " model the engine ran.")
    return text


def file_bytes_per_param(outputs: dict[str, str | Path], num_params: int) -> dict[str, float]:
    """Bytes per parameter of each route's weight files on disk (tied weights stored once count once)."""
    sizes = {}
    for route, path in outputs.items():
        files = [Path(path)] if Path(path).is_file() else [p for p in Path(path).iterdir() if p.suffix in
                                                           (".bin", ".safetensors")]
        sizes[route] = sum(f.stat().st_size for f in files) / num_params
    return sizes


def dtype_answer(rows: list[dict[str, Any]], outputs: dict[str, str | Path], num_params: int, dtype: str) -> str:
    """Exercise: what DTYPE changed in the consolidated files and in the proof, from the run's files, against what
    the other dtype gives (4 bytes per working weight in fp32, 2 in bf16; the masters are fp32 in both)."""
    per = file_bytes_per_param(outputs, num_params)
    equal = sum(r["equal"] == "yes" for r in rows)
    as_stored = sum(float(r["max abs difference as stored"]) == 0 for r in rows)
    other = "fp32" if dtype == "bf16" else "bf16"
    article = "an" if other == "fp32" else "a"
    files = (f"route 1's file holds {per['gathered16']:.2f} bytes per parameter and route 2's {per['per_param']:.2f} "
             f"(the working weights; {article} {other} run's would hold {bytes_per_param(other)}), zero_to_fp32's "
             f"{per['offline']:.2f} and the export's {per['hf']:.2f} (the fp32 masters, {FP32_BYTES} in either dtype)")
    proof = (f"{as_stored} of {len(rows)} routes equal the engine's weights as stored, {equal} of {len(rows)} once the "
             "masters are rounded to bf16" if dtype == "bf16" else
             f"{as_stored} of {len(rows)} routes equal the engine's weights as stored: in fp32 the masters are the "
             "working weights")
    then = (" In an fp32 run all four would equal them as stored: the bits bf16 rounds away are what set the "
            "masters apart." if dtype == "bf16" else
            " Set DTYPE = \"bf16\" to see routes 1-2 halve while routes 3-4 stay, and the masters differ from the "
            "working weights as stored.")
    return f"In this {dtype} run {files}. {proof}.{then}"


def world_size_answer(summary: list[dict[str, Any]], world_size: int, num_params: int, param_bytes: int,
                      model: str, dtype: str, threshold: int) -> str:
    """Exercise: what N changed: rank 0's partitioned files against the cost model's for the default N (or N = 3
    when this run is the default), and route 2, which writes and gathers the whole model whatever N."""
    from zckpt_nb.plan.costs import predict

    by, other = {r["route"]: r for r in summary}, 3 if world_size == 2 else 2
    mine = by["partitioned"]["written MiB, rank 0"]
    pred = predict(model, other, dtype, threshold)
    theirs = pred.rank_file_bytes / 2**20
    told = "the default" if other == 2 else "the one to try"
    return (f"With N = {world_size}, rank 0 wrote {mine:.2f} MiB in the partitioned save: its 1/N share of the fp32 "
            f"masters and Adam's moments. For N = {other} ({told}) the cost model predicts {theirs:.2f} MiB per rank: "
            f"this run's share is {mine / theirs:.2f} x that ({other}/{world_size} = {other / world_size:.2f}). "
            f"Route 2 did not shrink: rank 0 wrote {by['per_param']['written MiB, rank 0']:.2f} MiB (the whole model, "
            f"{mib(num_params * param_bytes)} of working weights) and all-gathered "
            f"{by['per_param']['all-gathered / model']:.2f} x the model; for N = {other} the cost model predicts the "
            f"same whole file, {pred.saves['per_param'].written_bytes / 2**20:.2f} MiB on rank 0, whatever N.")


def partitioned_comm_sentence(costs: list[dict[str, Any]], summary: list[dict[str, Any]]) -> str:
    """The principle's "None (each rank saves locally)" against what rank 0's partitioned save really exchanged."""
    r0 = last_per_rank(costs, "partitioned")[0]
    ops, gathered = r0["comm_ops"], {r["route"]: r for r in summary}["partitioned"]["all-gathered / model"]
    count = {op: ops.get(op, {}).get("count", 0) for op in ("barrier", "all_reduce", "all_gather_into_tensor")}
    regather = (f"; and it all-gathered {gathered:.2f} x the model: the {count['all_gather_into_tensor']} tensors "
                "kept whole by `stage3_param_persistence_threshold` (notebook 01), gathered again after the save"
                if count["all_gather_into_tensor"] else "")
    protocol = (f"; this package's save added {r0['protocol_comm_ops']} object collectives of "
                f"{r0['protocol_comm_bytes']:,} B in all (`all_gather_object`: every rank learns whether every "
                "other rank's files were written; notebook 05 teaches this agreement)"
                if r0["protocol_comm_ops"] else "")
    return (f"**Partitioned save, \"None (each rank saves locally)\"**: imprecise. Each rank wrote only its own "
            f"share, and {'no weight moved (all-gathered 0.00 x the model)' if not regather else 'its slices stayed'}, "
            f"but the save is not free of communication: inside DeepSpeed's `save_checkpoint` rank 0 ran "
            f"{counted(count['barrier'], 'barrier')} and "
            f"{counted(count['all_reduce'], 'all-reduce')}, {r0['comm_bytes']:,} B logged "
            "(the all-reduces are `_checkpoint_tag_validation`: every rank must save under the same tag)"
            f"{regather}{protocol}. Every rank waits at these for the slowest, so a partitioned save is a "
            "synchronisation point, and a rank that skips it hangs the others (notebook 05).")


def regathered_clause(costs: list[dict[str, Any]], more: float) -> str:
    """Why route 1 gathered more than route 2, when it did: the gathers it ran beyond route 2's."""
    extra = (gather_count(costs, "gathered16") - gather_count(costs, "per_param"))
    if more < 0.01 or extra <= 0:
        return ""
    return (f" Route 1 ran {counted(extra, 'more all-gather')} than route 2, {more:.2f} x the model: DeepSpeed "
            "gathers module by module, so a weight two modules share (here GPT-2's token embedding, tied to "
            "`lm_head`) is gathered under each, while route 2 walks `named_parameters()`, which lists it once.")


def gather_count(costs: list[dict[str, Any]], mode: str) -> int:
    """How many all-gathers rank 0 ran in a route's save."""
    return last_per_rank(costs, mode)[0]["comm_ops"].get("all_gather_into_tensor", {}).get("count", 0)


def principle_sentences(costs: list[dict[str, Any]], summary: list[dict[str, Any]]) -> list[str]:
    """Where the principle's table is right and where it is imprecise, from this run's records."""
    by = {r["route"]: r for r in summary}
    g16, pp = by["gathered16"], by["per_param"]
    offline = {m: last_per_rank(costs, m)[0] for m in MASTER_ROUTES if m in by}
    return [
        partitioned_comm_sentence(costs, summary),
        f"**Consolidated save, \"Full P on rank 0, all-gather across N ranks\"**: route 2 wrote "
        f"{pp['written MiB, rank 0']} MiB on rank 0 and all-gathered {pp['all-gathered / model']:.2f} x the model"
        + (" (parameters kept whole by `stage3_param_persistence_threshold` need no gather)"
           if pp["all-gathered / model"] < 0.99 else "")
        + f"; route 1 all-gathered {g16['all-gathered / model']:.2f} x the model."
        + regathered_clause(costs, g16["all-gathered / model"] - pp["all-gathered / model"])
        + (f" Route 1 also broadcast {g16['broadcast / model']:.2f} x the model back from rank 0 (DeepSpeed 0.19.8 "
           "broadcasts every gathered tensor), a cost the principle's table does not name."
           if g16["broadcast / model"] > 0 else ""),
        "**Its inference row says \"all-gather\", and its usage section sends inference through DeepSpeed's "
        "conversion tools**: those (the offline conversion, and the export) logged "
        + " and ".join(f"{c['comm_bytes'] or 0:,} B ({m})" for m, c in offline.items())
        + " of collectives and need no process group; they read every rank's shard instead, optimizer state "
          f"included ({mib(max((c.get('bytes_read') or 0 for c in offline.values()), default=0))}).",
    ]


LOGIT_TOLERANCE = {"fp32": 1e-5, "bf16": 2.0**-6}  # bf16: 8 significant bits, relative to the largest logit


def logits_check(model_dir: str | Path, reference: str | Path, dtype: str) -> dict[str, Any]:
    """The export loaded with transformers alone, cast to the run's dtype, against the engine's logits on the
    engine's batch (like with like); tolerance absolute in fp32, relative to the largest logit in bf16."""
    import torch
    from transformers.utils import logging as hf_logging

    from zckpt_nb.convert.export import load_model, logits

    ref = torch.load(reference, map_location="cpu", weights_only=True)
    hf_logging.disable_progress_bar()  # "Loading weights" would stay in the notebook as a frozen, half-drawn bar
    model = load_model(model_dir)
    out = logits(model.to(torch.bfloat16) if dtype == "bf16" else model, ref["input_ids"]).float()
    diff = float((out - ref["logits"]).abs().max())
    tolerance = LOGIT_TOLERANCE[dtype] * (float(ref["logits"].abs().max()) if dtype == "bf16" else 1.0)
    return {"dtype": dtype, "max_abs_diff": diff, "tolerance": tolerance, "within": diff <= tolerance,
            "logits": out, "reference": ref["logits"]}


def logits_agreement(check: dict[str, Any]) -> str:
    """How the reloaded logits compare with the engine's: "equal bit for bit to" or "within X of"."""
    return "equal bit for bit to" if check["max_abs_diff"] == 0 else f"within {check['max_abs_diff']:.1e} of"


def logits_sentence(check: dict[str, Any]) -> str:
    """The logits check in one sentence, with the tolerance the dtype can meet and why."""
    why = ("fp32 on both sides: at most the order of additions differs" if check["dtype"] == "fp32" else
           "bf16 keeps 8 significant bits, so two forward passes that round in different places differ by a few "
           "units of the last bit of the largest logit")
    said = (f"The reloaded model, in {check['dtype']} like the engine, gives logits {logits_agreement(check)} the "
            "engine's on the same batch")
    if check["max_abs_diff"] == 0:
        return said + "."
    return (f"{said}, {'inside' if check['within'] else 'OUTSIDE'} the tolerance of {check['tolerance']:.1e} "
            f"({why}).")


def export_memory_sentence(heap_extra: int | None, rows: list[dict[str, Any]], model_bytes: int,
                           kernel_rss: int | None = None) -> str:
    """The export's heap against its resident memory (the row with the highest peak, as `memory_verdict` gives it),
    and, given `kernel_rss`, why section 5's rise in the kernel differs from this one in a process of its own."""
    export = max((r for r in rows if r["route"] == "export"), key=lambda r: r["(peak - baseline) / model"])
    rss, ratio = export["above baseline MiB"], export["(peak - baseline) / model"]
    heap = (heap_extra or 0) / 2**20
    model = model_bytes / 2**20
    kernel = ("" if kernel_rss is None else
              f" Section 5's +{kernel_rss / 2**20:.2f} MiB differs because it was measured in this notebook's "
              "process, against what that process held when the export began (libraries loaded, memory freed by "
              "earlier work); here the export is a fresh process, measured against a fresh one that only imports what "
              "it imports.")
    return (f"The export's heap rose {heap:.1f} MiB ({heap / model:.2f} x the {model:.2f} MiB model): it builds "
            f"{'no tensor' if heap < 0.25 * model else 'tensors'} in memory. Its resident memory rose {rss} MiB above "
            f"the baseline ({ratio:.2f} x the model): the pages of the rank files it maps count while it "
            "reads them, so "
            + ("what the operating system sees grows with what it reads, not with what it allocates."
               if ratio > 0.25 else "its resident memory stayed small too.")) + kernel
