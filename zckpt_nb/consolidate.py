"""Four routes from a partitioned ZeRO-3 model to one full model, and the checks that they agree.

1. In-training 16-bit gather: `engine.save_16bit_model` with `stage3_gather_16bit_weights_on_model_save`.
   Every rank calls it; DeepSpeed gathers one module at a time onto every rank (`GatheredParameters` with
   `modifier_rank=0`, which broadcasts each module back from rank 0 on exit) and rank 0 keeps a CPU copy of the
   whole model until it writes it.
2. Per-parameter gather (DeepSpeed-Chat's `save_zero_three_model`): every rank walks `named_parameters()` inside
   `deepspeed.zero.GatheredParameters([p])`; rank 0 copies each tensor to CPU. The accelerator never holds more
   than one full parameter; rank 0's CPU still ends up holding all of P.
3. Offline conversion: DeepSpeed's `zero_to_fp32` functions read every rank's shard files in one process, with no
   process group and no GPU.
4. Hugging Face export: see `zckpt_nb.export`.

Routes 1 and 2 are collective (every rank must call them). Routes 3 and 4 run after training, anywhere.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb import measure

WEIGHTS = "pytorch_model.bin"  # the file name routes 1-3 write, as DeepSpeed and transformers name it
REFERENCE = "reference"  # folder of the independent reference the tests and notebooks compare against


def save_gathered16(engine: Any, out_dir: str | Path) -> Path:
    """Route 1: DeepSpeed's consolidated save, called on every rank; rank 0 writes `out_dir/pytorch_model.bin`.

    With `stage3_gather_16bit_weights_on_model_save` off, DeepSpeed returns False, writes nothing and says so only
    at INFO level (hidden by default); we print what it returned, so the silent no-op shows.
    """
    if not engine.save_16bit_model(str(out_dir), WEIGHTS):
        print(f"rank {engine.global_rank}: save_16bit_model returned False and wrote nothing "
              f"(stage3_gather_16bit_weights_on_model_save is "
              f"{engine.zero_gather_16bit_weights_on_model_save()})", flush=True)
    return Path(out_dir) / WEIGHTS


def gather_per_param(module: Any) -> dict[str, Any] | None:
    """Route 2's gather: one parameter at a time on every rank; rank 0 keeps a CPU copy (None on other ranks)."""
    import deepspeed
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    state: dict[str, Any] = {}
    for name, param in module.named_parameters():  # tied weights appear once, under their first name
        with deepspeed.zero.GatheredParameters([param]):
            if rank0:  # copy=True: on CPU ranks .cpu() returns DeepSpeed's own gathered buffer; keep a copy
                state[name] = param.data.detach().to("cpu", copy=True)
    return state if rank0 else None


def save_per_param(engine: Any, out_dir: str | Path) -> Path:
    """Route 2: gather parameter by parameter on every rank; rank 0 writes `out_dir/pytorch_model.bin`."""
    import torch

    state = gather_per_param(engine.module)
    path = Path(out_dir) / WEIGHTS
    if state is not None:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(state, path)
    return path


def convert_offline(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> Path:
    """Route 3: DeepSpeed's `zero_to_fp32` in this process (no ranks, no GPU); writes `out_dir/pytorch_model.bin`.

    DeepSpeed's converter memory-maps every rank's shards and materialises one output shard (5 GB by default) at a
    time (its lazy mode), so a model larger than that never sits in memory whole.
    """
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(out_dir), tag=tag)
    return Path(out_dir)


def shard_files(ckpt_dir: str | Path, tag: str | None = None) -> list[Path]:
    """Every rank's model and optimizer files of checkpoint `tag` (what routes 3 and 4 read)."""
    from zckpt_nb.verify import latest_name

    tag = tag or latest_name(ckpt_dir)
    return sorted((Path(ckpt_dir) / str(tag)).glob("zero_pp_rank_*_states.pt"))


def ready_to_time() -> None:
    """Before timing a one-process route, so it pays for its own work only: import DeepSpeed's converter and
    transformers' GPT-2 up front, and flush earlier writes (`measure.flush_writes`)."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import transformers

    transformers.GPT2LMHeadModel  # noqa: B018  (transformers imports its models lazily, on first access)
    measure.flush_writes()


def measure_offline(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> measure.SaveCost:
    """Run route 3 and measure it: one process, so rank 0 and no collective bytes (`ready_to_time` first)."""
    ready_to_time()
    return measure.measure("offline", lambda: convert_offline(ckpt_dir, out_dir, tag),
                           written=lambda: measure.files_under(out_dir), read=shard_files(ckpt_dir, tag))


def run_routes(engine: Any, output_dir: str | Path, *, gathered16: bool, per_param: bool, rank: int,
               device: str) -> list[dict[str, Any]]:
    """Routes 1 and 2 on every rank, each into its own folder of `output_dir`; this rank's cost records.

    With the comms logger on, rank 0 also prints DeepSpeed's own `log_summary` table for these routes alone
    (a cross-check of the per-save figures; it is collective, so every rank calls it).
    """
    import deepspeed.comm as ds_comm
    import torch.distributed

    routes = [("gathered16", save_gathered16)] * gathered16 + [("per_param", save_per_param)] * per_param
    summarise = bool(routes) and ds_comm.comms_logger.enabled
    if summarise:
        ds_comm.reset_log()  # the summary below then covers the consolidated saves only
    costs = []
    for mode, save in routes:
        folder = Path(output_dir) / mode
        measure.flush_writes()
        torch.distributed.barrier()  # every rank's flush is done before any clock starts (not in the comms log)
        cost = measure.measure(mode, partial(save, engine, folder), rank=rank, device=device,
                               written=lambda folder=folder: measure.files_under(folder) if rank == 0 else [])
        costs.append(cost.to_dict())
    if summarise:
        ds_comm.log_summary()
    return costs


def save_reference(engine: Any, input_ids: Any, output_dir: str | Path, rank: int) -> Path:
    """Write what the proofs compare against: each rank's own partitions, and the engine's logits on `input_ids`.

    The partitions are the raw `ds_tensor` slices each rank holds, copied with no collective and no DeepSpeed
    consolidation code; `reference_state_dict` joins them with plain torch. So the reference is independent of
    all four routes. The logits come from the engine's own forward pass (eval mode: no dropout), on every rank.
    In bf16 runs the slices are the bf16 weights the engine computes with (fp32 master weights live in the
    optimizer), so there the routes that read fp32 master weights match up to that cast.
    """
    import torch

    ref = Path(output_dir) / REFERENCE
    ref.mkdir(parents=True, exist_ok=True)
    parts = {name: {"shard": p.ds_tensor.detach().float().cpu().clone(), "shape": tuple(p.ds_shape)}
             for name, p in engine.module.named_parameters()}
    torch.save(parts, ref / f"partitions_rank{rank}.pt")
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.float().cpu()
    if rank == 0:
        torch.save({"input_ids": input_ids.cpu(), "logits": logits}, ref / "logits.pt")
    return ref


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


def compare(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
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
    for mode in measure.MODES:
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


FP32_BYTES = 4


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
