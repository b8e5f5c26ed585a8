"""Plan a ZeRO-3 checkpoint at any scale before running it: any causal LM config, any N, seconds as well as bytes.

Bytes come from `zckpt_nb.costs` (exact, from the config built on the meta device). Seconds come from three
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

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from zckpt_nb.costs import MODE_KEYS, Prediction, module_numels, module_walk_numels, predict, tensor_numels
from zckpt_nb.launch import UsageError

CONFIG_DIR = Path(__file__).with_name("configs")
MEASURED = Path(__file__).with_name("data") / "measured_cpu_compare.json"
GB = 1e9
GIB = 2**30
PROTOCOL_OBJECT_COLLECTIVES = 3  # per committed save (`commit`): measured as `protocol_comm_ops` in compare.json
# Published totals to check the shipped configs against: parameters and the bf16 weights' bytes (the
# `total_size` of the model's safetensors index on the Hugging Face hub, meta-llama/Meta-Llama-3-8B).
PUBLISHED = {"llama-3-8b": {"parameters": 8_030_261_248, "bf16 bytes": 16_060_522_496}}


def shipped_configs() -> list[str]:
    """Names of the configs shipped in `zckpt_nb/configs/` (usable wherever a config path is)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_file(source: str) -> Path:
    """The config.json `source` names: a file, a folder holding one, or a shipped config's name."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and (CONFIG_DIR / f"{source}.json").is_file():
        path = CONFIG_DIR / f"{source}.json"
    if not path.is_file():
        raise UsageError(f"no config.json at {source}: give a transformers config.json, a folder holding one, "
                         f"or a shipped config ({', '.join(shipped_configs())})")
    return path


@cache
def load_config(source: str) -> Any:
    """The transformers config `source` holds, refused in one line unless it is a causal LM transformers ships."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = config_file(source)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not JSON ({e}): give a transformers config.json") from None
    kind = data.pop("model_type", None) if isinstance(data, dict) else None
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{path} is not the config of a causal LM transformers ships (model_type {kind!r}): give a "
                         "config.json with model_type gpt2, llama, mistral, qwen2, ...")
    return AutoConfig.for_model(kind, **data)


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


def seconds(s: float) -> str:
    """A duration a person reads: 3 significant figures in µs, ms, s or min (never scientific notation)."""
    for unit, scale in (("min", 60), ("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale * (2 if unit == "min" else 1) or unit == "µs":
            return f"{float(f'{s / scale:.3g}'):g} {unit}"
    raise AssertionError("unreachable")


def why(row: dict[str, Any]) -> str:
    """A mode's stall and its largest term."""
    term, s = max(row["terms"].items(), key=lambda kv: kv[1])
    return f"{row['mode']} {seconds(row['stall s'])} (largest term: {term}, {seconds(s)})"


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
            f"A consolidated model is on disk soonest with {whole[0]['mode']} ({seconds(whole[0]['durable s'])}"
            + (", the partitioned save and then the conversion off the training path, which needs "
               f"{offline['rank 0 extra peak B'] / GIB:.3g} GiB of memory in one process)" if whole[0] is offline
               else ")") + ". Only the partitioned save (which the offline route starts from) can resume training: "
            "the 16-bit saves hold no optimizer state.")


def plan_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plan rows as a table a person reads: GiB and seconds, each time term in its own column."""
    return [{"N": r["N"], "mode": r["mode"], "rank 0 writes GiB": round(r["rank 0 writes B"] / GIB, 3),
             "rank 0 extra peak GiB": round(r["rank 0 extra peak B"] / GIB, 3),
             "terms": "; ".join(f"{k} {seconds(v)}" for k, v in r["terms"].items()),
             "stall": seconds(r["stall s"]), "to durable": seconds(r["durable s"]),
             "resumes training": r["resumable"]} for r in rows]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Rows of a table as aligned plain text for a terminal (cells formatted as the notebooks' tables)."""
    from zckpt_nb.plots import cell

    cells = [[cell(v) for v in r.values()] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(list(rows[0]), *cells)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [list(rows[0]), *cells])


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
            f"{total['DeepSpeed B'] / GIB:.3f} GiB ({total['ours B'] / total['DeepSpeed B'] - 1:+.2%}); the terms "
            f"above account for {explained:,} of the {total['difference B']:,} bytes of difference"
            + (f" ({rest:+,} B of rounding left)" if rest else " exactly")
            + f", the largest being '{largest['term']}' ({largest['difference B']:,} B).")


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


def measured_records(extra_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The records measured on this project's 2-core CPU machine (shipped), plus any `compare.json` in `extra_dir`."""
    from zckpt_nb.compare import load_records

    return json.loads(MEASURED.read_text()) + (load_records(Path(extra_dir)) if extra_dir else [])


def records_sentence(records: list[dict[str, Any]]) -> str:
    """What measured records cover, read from them: per machine, each model's world sizes and the repeats."""
    lines = []
    for machine in dict.fromkeys(r.get("machine", "?") for r in records):
        mine = [r for r in records if r.get("machine", "?") == machine]
        models = dict.fromkeys(r["model"] for r in mine)
        sizes = {m: sorted({r["world_size"] for r in mine if r["model"] == m}) for m in models}
        repeats = sorted({len(r.get("repeat_seconds") or [0]) for r in mine})
        modes = len({r["mode"] for r in mine})
        each = "measured once" if repeats == [1] else f"the median of {' or '.join(map(str, repeats))} repeats"
        lines.append(f"{machine}: " + "; ".join(f"`{m}` at N = {', '.join(map(str, n))}" for m, n in sizes.items())
                     + f"; {modes} save mode{'s' * (modes != 1)}, {len(mine)} records (every rank), each {each}")
    return "Measured saves: " + ". ".join(lines) + "."


ON_ALL_RANKS = ("partitioned", "gathered16", "per_param")  # the saves; offline and hf run in one process


def cpu_share(record: dict[str, Any]) -> float:
    """Ranks per CPU core during a save (at least 1): CPU ranks beyond the machine's cores take turns."""
    cpus = record.get("cpus")
    return max(1.0, record["world_size"] / cpus) if cpus and record["mode"] in ON_ALL_RANKS else 1.0


def features(record: dict[str, Any], pred: Prediction | None = None) -> dict[str, float]:
    """A measured save as the terms its seconds are fitted from: its mode's fixed cost and bytes, what it moves.

    Each mode has its own writer (the committed save's hashed O_DIRECT writes, `torch.save` through the page cache,
    safetensors), so each gets its own fixed cost and its own seconds per byte written and read. The routes that
    read a checkpoint open, check and unpickle 2 files per rank whatever their size: a cost per file. Work done by
    the CPU takes `cpu_share` times as long when ranks share cores; the collectives' bytes and ring steps are waits.
    `pred`: the record's prediction, when the caller has it already.
    """
    pred = pred or predict(record["model"], record["world_size"], record["dtype"], record["persistence_threshold"])
    mode, q, share = record["mode"], quantities(pred, record["mode"]), cpu_share(record)
    mine = {m: share * (m == mode) for m in MODE_KEYS}
    return {**{f"fixed {m}": v for m, v in mine.items()},
            **{f"bytes {m}": v * (q["write"] + q["read"]) for m, v in mine.items()},
            **{f"files {m}": q["files"] * (m == mode) for m in READ_RANK_FILES},
            "net": q["net"], "steps": q["steps"]}


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per unit of each feature, at least 0, that minimise the relative error over `rows`.

    Weighted least squares (numpy); a term that comes out below 0 is dropped and the rest refitted (a cost cannot be
    negative, and numpy has no non-negative solver).
    """
    import numpy as np

    keys = [k for k in rows[0]["features"] if any(r["features"][k] for r in rows)]
    while True:
        x = np.array([[r["features"][k] / r["measured s"] for k in keys] for r in rows])
        theta = np.linalg.lstsq(x, np.ones(len(rows)), rcond=None)[0]
        if (theta >= 0).all():
            return {k: float(theta[keys.index(k)]) if k in keys else 0.0 for k in rows[0]["features"]}
        keys.pop(int(np.argmin(theta)))


def predicted(row: dict[str, Any], constants: dict[str, float]) -> float:
    """A measured save's seconds from fitted constants."""
    return sum(v * constants[k] for k, v in row["features"].items())


def calibration(records: list[dict[str, Any]], bw: Bandwidths) -> list[dict[str, Any]]:
    """Rank 0 of each measured save: its seconds predicted from `bw` alone, and from this machine's constants.

    The constants (`features`: per mode a fixed cost and seconds per byte written and read; seconds per byte
    received and per ring step) are fitted on the machine's *other* saves (leave one out), so no record is predicted
    from a fit that saw it. Records are fitted per machine (their `machine` field); too few: no fitted figure.
    """
    rows = []
    for r in (r for r in records if r["rank"] == 0):
        pred = predict(r["model"], r["world_size"], r["dtype"], r["persistence_threshold"])
        rows.append({"machine": r.get("machine", "?"), "model": r["model"], "mode": r["mode"], "N": r["world_size"],
                     "measured s": r["seconds"], "repeat s": r.get("repeat_seconds", []),
                     "bandwidth-only s": sum(time_terms(pred, bw)[r["mode"]].values()),
                     "bytes exact": r["predicted_bytes"] == r["measured_payload_bytes"], "features": features(r, pred)})
    for i, row in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != i and o["machine"] == row["machine"]]
        row["fitted s"] = predicted(row, fit(others)) if enough([row, *others]) else None
        for key in ("bandwidth-only s", "fitted s"):
            row[key.replace(" s", " error")] = None if row[key] is None else row[key] / row["measured s"] - 1
    return rows


def enough(rows: list[dict[str, Any]]) -> bool:
    """Whether there are more saves than constants to fit (leaving one out)."""
    return len(rows) > len(rows[0]["features"]) + 1


def rate(seconds_per_byte: float) -> str:
    """A fitted seconds-per-byte constant as GB/s."""
    return f"{1 / seconds_per_byte / GB:.3g} GB/s" if seconds_per_byte else "not fitted (0)"


def machine_constants(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per machine with enough saves, the constants fitted on all of them, as a person reads them."""
    out = []
    for machine in dict.fromkeys(r["machine"] for r in rows):
        mine = [r for r in rows if r["machine"] == machine]
        if not enough(mine):
            continue
        c = fit(mine)
        named = [*((f"{m}: fixed seconds per save", seconds(c[f"fixed {m}"])) for m in MODE_KEYS),
                 *((f"{m}: bytes written and read", rate(c[f"bytes {m}"])) for m in MODE_KEYS),
                 *((f"{m}: per rank file read", seconds(c[f"files {m}"])) for m in READ_RANK_FILES),
                 ("network: bytes received", rate(c["net"])), ("latency of one ring step", seconds(c["steps"]))]
        out += [{"machine": machine, "constant": k, "value": v} for k, v in named]
    return out


def calibration_sentence(rows: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many predicted times lie within `tolerance` of the measured ones, both ways, and the bytes verdict."""
    def within(key: str) -> str:
        rated = [r for r in rows if r[key] is not None]
        near = sum(abs(r[key]) <= tolerance for r in rated)
        worst = max(rated, key=lambda r: abs(r[key]), default=None)
        return (f"{near} of {len(rated)} within {tolerance:.0%}" + (f" (worst: {worst['model']} {worst['mode']} at "
                f"N = {worst['N']}, {worst[key]:+.0%})" if worst else ""))

    exact = sum(r["bytes exact"] for r in rows)
    repeats = [x / r["measured s"] - 1 for r in rows for x in r["repeat s"]]
    floor = (f" The measurements' own spread: {sum(abs(e) <= tolerance for e in repeats)} of {len(repeats)} single "
             f"repeats lie within {tolerance:.0%} of their median." if repeats else "")
    unfitted = sum(r["fitted error"] is None for r in rows)
    few = f" ({unfitted} saves of a machine with too few of them to fit have no fitted figure)" if unfitted else ""
    return (f"Against {len(rows)} measured saves (rank 0): bandwidths alone put {within('bandwidth-only error')}; "
            f"with this machine's constants fitted on its other saves, {within('fitted error')}{few}.{floor} "
            f"Bytes written: {exact} of {len(rows)} equal the prediction exactly.")
