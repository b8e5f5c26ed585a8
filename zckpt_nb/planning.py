"""Plan a ZeRO-3 checkpoint at any scale before running it: any causal LM config, any N, seconds as well as bytes.

Bytes come from `zckpt_nb.costs` (exact, from the config built on the meta device). Seconds come from three
bandwidths, in GB/s (1e9 bytes per second):
- write: what one rank writes to durable storage at (every rank writes its own shard at the same time; a shared
  filesystem's aggregate limit is not modelled);
- read: what one process reads shards at (the offline conversion);
- net: one rank's link. A collective's time is the bytes one rank receives over it (ring algorithms): an all-gather
  receives the N - 1 slices it did not send (DeepSpeed logs the slice sent), an all-reduce 2 (N - 1) / N of its
  buffer, a broadcast the whole buffer.
A save's training stall is the time until the ranks can step again; its time to durable, until its own output is
on disk. The saves are synchronous, so these are equal except for the offline route, which runs after the
partitioned save, off the training path.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from zckpt_nb.costs import Prediction, module_numels, predict
from zckpt_nb.launch import UsageError

CONFIG_DIR = Path(__file__).with_name("configs")
MEASURED = Path(__file__).with_name("data") / "measured_cpu_compare.json"
GB = 1e9
GIB = 2**30
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
    """Write (one rank to storage), read (one process from storage) and network (one rank's link), in GB/s."""

    write_gbps: float
    read_gbps: float
    net_gbps: float

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not v > 0}
        if bad:
            raise UsageError(f"bandwidths must be positive GB/s figures (got {bad})")


def wire_bytes(ops: dict[str, int], n: int) -> float:
    """Bytes one rank receives over a mode's collectives (ring algorithms), from the bytes DeepSpeed logs per op."""
    factors = {"all_gather_into_tensor": n - 1, "all_reduce": 2 * (n - 1) / n, "broadcast": 1 if n > 1 else 0}
    return sum(factors[op] * v for op, v in ops.items())


def time_terms(pred: Prediction, bw: Bandwidths) -> dict[str, dict[str, float]]:
    """Per save mode, its seconds term by term on rank 0 (the slowest rank); offline and hf: the conversion alone."""
    n, write, read, net = pred.world_size, bw.write_gbps * GB, bw.read_gbps * GB, bw.net_gbps * GB
    def convert(part: dict[str, Any]) -> dict[str, float]:
        return {"read every shard": part["read_bytes"] / read, "write the fp32 model": part["written_bytes"] / write}

    return {
        "partitioned": {"write the rank's shard": pred.partitioned["per_rank_bytes"][0] / write,
                        "collectives": wire_bytes(pred.partitioned["ops"], n) / net},
        "gathered16": {"all-gather and broadcast": wire_bytes(pred.gathered["ops"], n) / net,
                       "rank 0 writes the 16-bit model": pred.gathered["written_bytes"] / write},
        "per_param": {"all-gather": wire_bytes(pred.per_param["ops"], n) / net,
                      "rank 0 writes the model": pred.per_param["written_bytes"] / write},
        "offline": convert(pred.offline),
        "hf": convert(pred.hf),
    }


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
    return (f"At N = {rows[0]['N']} with write {bw.write_gbps:g} GB/s, read {bw.read_gbps:g} GB/s and network "
            f"{bw.net_gbps:g} GB/s, {saves[0]['mode']} stalls training least: " + "; ".join(map(why, saves)) + ". "
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


def calibration(records: list[dict[str, Any]], bw: Bandwidths) -> list[dict[str, Any]]:
    """Rank 0 of each measured (mode, N): predicted seconds, bandwidths only and with a fitted fixed overhead.

    The overhead of a mode is fitted from that mode's records at the *other* world sizes (the median of measured
    minus predicted), so no record is predicted with a constant fitted on itself.
    """
    rows = []
    for r in (r for r in records if r["rank"] == 0):
        pred = predict(r["model"], r["world_size"], r["dtype"], r["persistence_threshold"])
        rows.append({"model": r["model"], "mode": r["mode"], "N": r["world_size"], "measured s": r["seconds"],
                     "bandwidth-only s": sum(time_terms(pred, bw)[r["mode"]].values()),
                     "bytes exact": r["predicted_bytes"] == r["measured_payload_bytes"]})
    for row in rows:
        others = [o["measured s"] - o["bandwidth-only s"] for o in rows
                  if o["mode"] == row["mode"] and o["N"] != row["N"]]
        row["fitted overhead s"] = statistics.median(others) if others else None
        row["with overhead s"] = None if not others else row["bandwidth-only s"] + row["fitted overhead s"]
        for key in ("bandwidth-only s", "with overhead s"):
            row[f"{key.split(' s')[0]} error"] = None if row[key] is None else row[key] / row["measured s"] - 1
    return rows


def calibration_sentence(rows: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many predicted times lie within `tolerance` of the measured ones, both ways, and the bytes verdict."""
    def within(key: str) -> str:
        rated = [r for r in rows if r[key] is not None]
        near = sum(abs(r[key]) <= tolerance for r in rated)
        worst = max(rated, key=lambda r: abs(r[key]), default=None)
        return (f"{near} of {len(rated)} within {tolerance:.0%}" + (f" (worst: {worst['mode']} at N = {worst['N']}, "
                f"{worst[key]:+.0%})" if worst else ""))

    exact = sum(r["bytes exact"] for r in rows)
    return (f"Against {len(rows)} measured saves (rank 0): bandwidths alone put {within('bandwidth-only error')}; "
            f"with a fixed overhead per mode fitted on the other world sizes, {within('with overhead error')}. "
            f"Bytes written: {exact} of {len(rows)} equal the prediction exactly.")
