"""Plan a ZeRO-3 checkpoint at any scale before running it: any causal LM config, any N, seconds as well as bytes.

Bytes come from `zckpt_nb.plan.costs` (exact, from the config built on the meta device). Seconds come from three
bandwidths, in GB/s (1e9 bytes per second):
- write: what one rank writes to durable storage at (every rank writes its own shard at the same time; a shared
  filesystem's aggregate limit is not modelled);
- read: what one process reads shards at (the offline conversion);
- net: one rank's link. A collective's time is the bytes one rank receives over it (ring algorithms): an all-gather
  receives the N - 1 slices it did not send (DeepSpeed logs the slice sent), an all-reduce 2 (N - 1) / N of its
  buffer, a broadcast the whole buffer.
And one latency, in µs: a ring step of one collective call (each call takes N - 1 steps whatever its size). DeepSpeed
gathers tensor by tensor, so a gathered save at thousands of ranks can be bound by it rather than by bytes. It is
0 (not modelled) unless given; `calibration` fits it, with the rest, on the saves measured here.
A save's training stall is the time until the ranks can step again; its time to durable, until its own output is
on disk. The saves are synchronous, so these are equal except for the offline route, which runs after the
partitioned save, off the training path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError
from zckpt_nb.plan.costs import MODE_KEYS, Prediction, module_numels, module_walk_numels, predict, tensor_numels

GB = 1e9


GIB = 2**30


PROTOCOL_OBJECT_COLLECTIVES = 3  # per committed save (`commit`): measured as `protocol_comm_ops` in compare.json


# Published totals to check the shipped configs against: parameters and the bf16 weights' bytes (the
# `total_size` of the model's safetensors index on the Hugging Face hub, meta-llama/Meta-Llama-3-8B).
PUBLISHED = {"llama-3-8b": {"parameters": 8_030_261_248, "bf16 bytes": 16_060_522_496}}


@dataclass(frozen=True)
class Bandwidths:
    """Write (one rank to storage), read (one process from storage) and network (one rank's link) in GB/s; the
    latency of one ring step of a collective call in µs, and the cost of opening one rank file in ms (0: not
    modelled)."""

    write_gbps: float
    read_gbps: float
    net_gbps: float
    step_latency_us: float = 0.0
    file_ms: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not (v >= 0 if k in ("step_latency_us", "file_ms") else v > 0)}
        if bad:
            raise UsageError("bandwidths must be positive GB/s figures, the step latency and the cost per file at "
                             f"least 0 (got {bad})")

    def unit_seconds(self) -> dict[str, float]:
        """Seconds per unit of what a save moves: per byte written, read and received, per ring step, per file."""
        return {"write": 1 / (self.write_gbps * GB), "read": 1 / (self.read_gbps * GB),
                "net": 1 / (self.net_gbps * GB), "steps": self.step_latency_us * 1e-6, "files": self.file_ms * 1e-3}


READ_RANK_FILES = ("offline", "hf")  # the routes that open every rank's two files (model states, optimizer states)


def wire_bytes(ops: dict[str, int], n: int) -> float:
    """Bytes one rank receives over a mode's collectives (ring algorithms), from the bytes DeepSpeed logs per op."""
    factors = {"all_gather_into_tensor": n - 1, "all_reduce": 2 * (n - 1) / n, "broadcast": 1 if n > 1 else 0}
    return sum(factors[op] * v for op, v in ops.items())


def collective_calls(pred: Prediction, mode: str) -> int:
    """Collective calls rank 0 makes in a save: DeepSpeed gathers (and broadcasts) one tensor per call."""
    t = pred.persistence_threshold
    walk, numels = module_walk_numels(pred.model), tensor_numels(pred.model)
    # DeepSpeed's tag check (2 all-reduces), 2 barriers and the regather; then the commit protocol's object
    # collectives, each a size and a payload
    return {"partitioned": 4 + pred.persistent_tensors + 2 * PROTOCOL_OBJECT_COLLECTIVES,
            "gathered16": sum(k > t for k in walk) + len(walk),  # per walked tensor: an all-gather, a broadcast
            "per_param": sum(k > t for k in numels), "offline": 0, "hf": 0}[mode]


def quantities(pred: Prediction, mode: str) -> dict[str, float]:
    """What rank 0 moves in a save mode: bytes written, read and received, the ring steps of its collectives and the
    rank files it opens."""
    part = getattr(pred, MODE_KEYS[mode])
    write = pred.partitioned["per_rank_bytes"][0] if mode == "partitioned" else part["written_bytes"]
    return {"write": write, "read": part.get("read_bytes", 0), "net": wire_bytes(part["ops"], pred.world_size),
            "steps": collective_calls(pred, mode) * (pred.world_size - 1),
            "files": 2 * pred.world_size * (mode in READ_RANK_FILES)}


TERMS = {"partitioned": {"write": "write the rank's shard", "net": "collectives"},
         "gathered16": {"net": "all-gather and broadcast", "write": "rank 0 writes the 16-bit model"},
         "per_param": {"net": "all-gather", "write": "rank 0 writes the model"},
         "offline": {"read": "read every shard", "write": "write the fp32 model"},
         "hf": {"read": "read every shard", "write": "write the fp32 model"}}


def time_terms(pred: Prediction, bw: Bandwidths) -> dict[str, dict[str, float]]:
    """Per save mode, its seconds term by term on rank 0 (the slowest rank); offline and hf: the conversion alone."""
    unit = bw.unit_seconds()
    out = {}
    for mode, labels in TERMS.items():
        q = quantities(pred, mode)
        out[mode] = {label: q[k] * unit[k] for k, label in labels.items()}
        for k, label in (("steps", "collective latency ({:,} ring steps)"), ("files", "open {:,} rank files")):
            if q[k] and unit[k]:
                out[mode][label.format(q[k])] = q[k] * unit[k]
    return out


def plan(name: str, n: int, bw: Bandwidths, dtype: str = "bf16", persistence_threshold: int = 0,
         gather_16bit: bool = True) -> list[dict[str, Any]]:
    """One row per save mode: bytes per rank, rank 0's extra peak, seconds term by term, stall and time to durable."""
    pred = predict(name, n, dtype, persistence_threshold)
    terms = time_terms(pred, bw)
    save = sum(terms["partitioned"].values())
    rows = []
    for mode in ("partitioned", "gathered16", "per_param", "offline"):
        if mode == "gathered16" and not gather_16bit:
            continue  # save_16bit_model writes nothing with stage3_gather_16bit_weights_on_model_save off
        part = getattr(pred, {"gathered16": "gathered"}.get(mode, mode))
        own = sum(terms[mode].values())
        rows.append({"mode": mode, "N": n, "terms": terms[mode],
                     "rank 0 writes B": pred.partitioned["per_rank_bytes"][0] if mode == "partitioned"
                     else part["written_bytes"],
                     "rank 0 extra peak B": part["rank0_extra_peak_bytes"],
                     "stall s": save if mode == "offline" else own,
                     "durable s": save + own if mode == "offline" else own,
                     "resumable": mode in ("partitioned", "offline")})
    return rows


UNITS = (("min", 60), ("s", 1), ("ms", 1e-3), ("µs", 1e-6))


def seconds(s: float, unit: str | None = None) -> str:
    """A duration a person reads: 3 significant figures in µs, ms, s or min (never scientific notation); `unit`
    holds every duration of a table to one unit ('under 0.001 ms' below what it shows)."""
    if unit:
        v = s / dict(UNITS)[unit]
        return f"{float(f'{v:.3g}'):,g} {unit}" if v >= 1e-3 else f"under 0.001 {unit}"
    if s < 1e-6:
        return "under 1 µs"
    for name, scale in UNITS:
        if s >= scale * (2 if name == "min" else 1) or name == "µs":
            return f"{float(f'{s / scale:.3g}'):g} {name}"
    raise AssertionError("unreachable")


def in_seconds(s: float) -> str:
    """A duration in seconds to 3 decimals, for a column headed (s) and for the terms beside it: 0.753, 9.310,
    1,230.000; '< 0.001' below a millisecond, so one quantity reads in one unit and one precision."""
    return f"{s:,.3f}" if s >= 5e-4 else "< 0.001"


def why(row: dict[str, Any]) -> str:
    """A mode's stall and its largest term, in seconds."""
    term, s = max(row["terms"].items(), key=lambda kv: kv[1])
    return f"{row['mode']} {in_seconds(row['stall s'])} s (largest term: {term}, {in_seconds(s)} s)"


def verdict(rows: list[dict[str, Any]], bw: Bandwidths) -> str:
    """Which save stalls training least and which gives a consolidated model soonest, and why, from `rows`."""
    saves = sorted((r for r in rows if r["mode"] != "offline"), key=lambda r: r["stall s"])
    whole = sorted((r for r in rows if r["mode"] != "partitioned"), key=lambda r: r["durable s"])
    offline = next(r for r in rows if r["mode"] == "offline")
    latency = (f"{bw.step_latency_us:g} µs per ring step of a collective call" if bw.step_latency_us
               else "collective latency not modelled")
    files = f"{bw.file_ms:g} ms per rank file opened" if bw.file_ms else "the cost per file opened not modelled"
    return (f"At N = {rows[0]['N']} with write {bw.write_gbps:g} GB/s, read {bw.read_gbps:g} GB/s, network "
            f"{bw.net_gbps:g} GB/s, {latency} and {files}, {saves[0]['mode']} stalls training least: "
            + "; ".join(map(why, saves)) + ". "
            f"A consolidated model is on disk soonest with {whole[0]['mode']} ({in_seconds(whole[0]['durable s'])} s"
            + (", the partitioned save and then the conversion off the training path, which needs "
               f"{offline['rank 0 extra peak B'] / GIB:.3g} GiB of memory in one process)" if whole[0] is offline
               else ")") + ". Only the partitioned save (which the offline route starts from) can resume training: "
            "the 16-bit saves hold no optimizer state.")


def plan_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plan rows as a table a person reads: one unit per column (GiB to 3 decimals), every duration in seconds to 3
    decimals, the terms as the stall and durable columns."""
    return [{"N": r["N"], "mode": r["mode"], "rank 0 writes GiB": f"{r['rank 0 writes B'] / GIB:.3f}",
             "rank 0 extra peak GiB": f"{r['rank 0 extra peak B'] / GIB:.3f}",
             "terms (s)": "; ".join(f"{k} {in_seconds(v)}" for k, v in r["terms"].items()),
             "stall (s)": in_seconds(r["stall s"]), "to durable (s)": in_seconds(r["durable s"]),
             "resumes training": r["resumable"]} for r in rows]


def trend(points: list[tuple[int, float]]) -> str:
    """'rise', 'fall' or 'stay level' (within 10%) from the smallest N's value to the largest N's."""
    first, last = min(points)[1], max(points)[1]
    return "rise" if last > 1.1 * first else "fall" if last < first / 1.1 else "stay level"


def sweep_sentence(rows: list[dict[str, Any]], measured: list[dict[str, Any]]) -> str:
    """How the stalls measured on rank 0 (figure's right panel) move with N against the plan's lines of their model
    and mode over the same N, and how far above or below those lines they sit, in plain words."""
    said, ratios = [], []
    planned = {(p["model"], p["mode"], p["N"]): p["stall s"] for p in rows}
    for model in dict.fromkeys(p["model"] for p in rows):
        for mode in ("partitioned", "gathered16"):
            hits = [r for r in measured if r["rank"] == 0 and (model, mode, r["world_size"]) == (
                r["model"], r["mode"], r["world_size"]) and (model, mode, r["world_size"]) in planned]
            ns = sorted({r["world_size"] for r in hits})
            if len(ns) < 2:
                continue
            ratios += [r["seconds"] / planned[model, mode, r["world_size"]] for r in hits]
            seen = trend([(r["world_size"], r["seconds"]) for r in hits])
            line = trend([(n, planned[model, mode, n]) for n in ns])
            said.append(f"{model} {mode}'s measured stalls {seen} from N = {ns[0]} to {ns[-1]} where the plan's line "
                        + ("does too" if seen == line else "stays level" if line == "stay level" else line + "s"))
    if not said:
        return "Too few measured saves at two or more world sizes to compare with the plan's lines."
    place = ("above" if min(ratios) > 1 else "below" if max(ratios) < 1 else "on both sides of")
    return ("In the right panel, " + "; ".join(said) + f". The measured markers sit {place} the planned lines, at "
            f"{min(ratios):.1f}x to {max(ratios):.1f}x the planned seconds: the plan's bandwidths alone leave out "
            "fixed costs (Python's work per tensor, collective latency, opening files) and the ranks sharing the "
            "machine's cores, which section 4 fits.")


def sweep(names: list[str], sizes: list[int], bw: Bandwidths, dtype: str = "bf16",
          persistence_threshold: int = 0) -> list[dict[str, Any]]:
    """Plan rows of every model at every world size, each tagged with its model."""
    return [{"model": name, **row} for name in names for n in sizes
            for row in plan(name, n, bw, dtype, persistence_threshold)]


def largest_layer_numel(name: str) -> int:
    """DeepSpeed's 'largest layer': the most parameter elements one module owns itself (`model_to_params`)."""
    return max(sum(g) for g in module_numels(name))


def deepspeed_memory_check(name: str, gpus_per_node: int, nodes: int = 1,
                           persistence_threshold: int = 0) -> list[dict[str, Any]]:
    """DeepSpeed's per-GPU model-states estimate (no offload) against our held bytes (bf16), term by term."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    n = gpus_per_node * nodes
    pred = predict(name, n, "bf16", persistence_threshold)
    p, layer = pred.num_params, largest_layer_numel(name)
    _, ds_total, _ = estimate_zero3_model_states_mem_needs(p, layer, gpus_per_node, nodes, cpu_offload=False,
                                                           cpu_offload_params=False)
    rows = [("16 B per parameter over N ranks (bf16 param 2, bf16 grad 2, fp32 master 4, Adam 8)", 16 * p / n,
             16 * p / n),
            ("2 more bytes per parameter over N ranks (DeepSpeed's 18 B per parameter)", 2 * p / n, 0),
            ("largest layer gathered, 4 B per parameter (DeepSpeed's largest_layer_memory)", 4 * layer, 0),
            ("padding of every tensor to a multiple of N, 16 B per element", 0, 16 * pred.padding_numel / n),
            ("persistent tensors kept whole, 2 B per element", 0, 2 * pred.persistent_numel)]
    table = [{"term": t, "DeepSpeed B": round(d), "ours B": round(o), "difference B": round(o - d)} for t, d, o in rows]
    ours = pred.param_bytes + pred.grad_bytes + pred.master_bytes + pred.optimizer_bytes
    table.append({"term": "total per rank (DeepSpeed: estimate_zero3_model_states_mem_needs; ours: held bytes)",
                  "DeepSpeed B": ds_total, "ours B": ours, "difference B": ours - ds_total})
    return table


def deepspeed_sentence(table: list[dict[str, Any]]) -> str:
    """How far our held bytes lie from DeepSpeed's estimate, and whether the terms account for all of it."""
    total, terms = table[-1], table[:-1]
    explained = sum(t["difference B"] for t in terms)
    largest = max(terms, key=lambda t: abs(t["difference B"]))
    rest = total["difference B"] - explained
    return (f"Our per-rank held bytes are {total['ours B'] / GIB:.3f} GiB against DeepSpeed's "
            f"{total['DeepSpeed B'] / GIB:.3f} GiB ({total['ours B'] / total['DeepSpeed B'] - 1:+.2%}). The terms "
            "above explain the whole difference"
            + (f" but {rest:+,} B of rounding" if rest else "")
            + f"; the largest is '{largest['term']}' ({largest['difference B'] / GIB:+.3f} GiB). Plan a GPU's "
            "memory with DeepSpeed's figure: it counts the working memory of gathering a layer, which ours (the "
            "bytes each rank holds between steps, what a checkpoint saves) leaves out.")


def published_check(name: str) -> dict[str, Any]:
    """A shipped config's parameters and consolidated bf16 bytes against the published figures."""
    pred, known = predict(name, 1, "bf16"), PUBLISHED[name]
    return {"config": name, "parameters, ours": pred.num_params, "parameters, published": known["parameters"],
            "bf16 bytes, ours": pred.gathered["written_bytes"], "bf16 bytes, published": known["bf16 bytes"],
            "equal": (pred.num_params, pred.gathered["written_bytes"]) == (known["parameters"], known["bf16 bytes"])}


def probe_disk(directory: str | Path, nbytes: int = 2**26) -> Bandwidths:
    """This machine's write and read GB/s: `torch.save` of one buffer then fsync, and `torch.load` of it back.

    The read follows the write, so it comes from the page cache, as the measured offline conversions did. The
    network figure is not probed (that needs two ranks): it is set to the write figure, and the `collectives`
    term of the plan shows how little it weighs at these sizes.
    """
    import os
    import time

    import torch

    path = Path(directory) / "zckpt_probe.pt"
    buffer = torch.ones(nbytes // 4)
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(buffer, f)
        f.flush()
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    start = time.perf_counter()
    torch.load(path, weights_only=True)
    read = time.perf_counter() - start
    path.unlink()
    return Bandwidths(nbytes / written / GB, nbytes / read / GB, nbytes / written / GB)
