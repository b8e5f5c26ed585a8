"""What changes on a GPU cluster, from the plan: the collective timeout against a gathered save's waits, a parallel
filesystem's aggregate bandwidth, and the pinned host memory a snapshot takes.

Each figure is arithmetic on `zckpt_nb.plan.costs` and `zckpt_nb.plan.planning` (a config, N, bandwidths); the
timeouts are read from torch and DeepSpeed, not typed in.
"""

from __future__ import annotations

import math
from typing import Any

from zckpt_nb.plan.costs import DTYPE_BYTES, module_walk_numels, predict
from zckpt_nb.plan.planning import GB, GIB, Bandwidths, seconds, time_terms

# torch's _DEFAULT_PG_NCCL_TIMEOUT (10 min): a torch built without NCCL (this CPU build) does not compile it in.
NCCL_DOCUMENTED_S = 600.0
MIB = 2**20
# notebook 09's defaults, which its exercises' answers compare against
DEFAULT_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
DEFAULT_WRITE_GBPS, DEFAULT_FS_CAP_GBPS = 2.0, 500.0
# the values its exercises ask the learner to set, which the answers give at the defaults too
EXERCISE_SIZES, EXERCISE_FS_CAP_GBPS, EXERCISE_WRITE_GBPS = (24, 48, 96), 50.0, 0.02


def default_timeouts() -> dict[str, float]:
    """Seconds a collective may wait before the job is killed, by who sets it, unless the job sets its own."""
    import torch.distributed.constants as torch_constants
    from deepspeed import constants as ds_constants

    nccl = torch_constants.default_pg_nccl_timeout
    return {"torch, NCCL": nccl.total_seconds() if nccl else NCCL_DOCUMENTED_S,
            "torch, other backends": torch_constants.default_pg_timeout.total_seconds(),
            "deepspeed.init_distributed": ds_constants.default_pg_timeout.total_seconds()}


def gather_waits(name: str, n: int, bw: Bandwidths, dtype: str = "bf16", threshold: int = 0) -> dict[str, float]:
    """A gathered 16-bit save's waits on rank 0, in s: its collectives in all, the longest single all-gather, and
    rank 0's write of the whole model, which the other ranks spend inside their next collective call."""
    pred = predict(name, n, dtype, threshold)
    terms = time_terms(pred, bw)["gathered16"]
    unit = bw.unit_seconds()
    largest = max(module_walk_numels(name)) * DTYPE_BYTES[dtype]  # DeepSpeed gathers one tensor per call
    return {"collectives s": sum(v for k, v in terms.items() if not k.startswith("rank 0 writes")),
            "longest call s": largest * (n - 1) / n * unit["net"] + (n - 1) * unit["steps"],
            "rank 0 write s": next(v for k, v in terms.items() if k.startswith("rank 0 writes"))}


def timeout_sentence(name: str, n: int, waits: dict[str, float], timeouts: dict[str, float]) -> str:
    """Which of a gathered save's waits reach which default timeout, in plain words."""
    shortest = min(timeouts.values())
    over = [k for k, t in timeouts.items() if waits["rank 0 write s"] > t]
    return (f"{name} at N = {n}: the gathered 16-bit save spends {seconds(waits['collectives s'])} in collectives "
            f"in all, but a timeout counts one call at a time, and its longest all-gather takes "
            f"{seconds(waits['longest call s'])}, {shortest / waits['longest call s']:,.0f} times less than the "
            f"shortest default ({shortest:g} s). The wait that "
            f"counts is rank 0 writing the whole model alone, {seconds(waits['rank 0 write s'])}, which every other "
            "rank spends inside its next collective call: "
            + (f"over the default of {', '.join(f'{k} ({timeouts[k]:g} s)' for k in over)}, so a job on that default "
               "is killed mid-save unless it passes a longer `timeout` to `deepspeed.init_distributed`." if over else
               f"{waits['rank 0 write s'] / shortest:.1%} of the shortest default, so no default timeout fires."))


def filesystem_seconds(total_bytes: float, nodes: int, node_gbps: float, cap_gbps: float) -> dict[str, float]:
    """A partitioned save of `total_bytes` written by every node at once: the aggregate bandwidth it gets (each
    node's bandwidth times the nodes, up to the filesystem's shared cap, in GB/s) and its seconds with and without
    the cap."""
    aggregate = min(node_gbps * nodes, cap_gbps)
    return {"nodes": nodes, "uncapped GB/s": node_gbps * nodes, "aggregate GB/s": aggregate,
            "uncapped s": total_bytes / (node_gbps * nodes * GB), "capped s": total_bytes / (aggregate * GB)}


def filesystem_rows(name: str, node_counts: list[int], gpus_per_node: int, node_gbps: float, cap_gbps: float,
                    dtype: str = "bf16", threshold: int = 0) -> list[dict[str, Any]]:
    """Per node count, a partitioned save's aggregate bandwidth and seconds with and without a shared cap."""
    rows = []
    for nodes in node_counts:
        pred = predict(name, nodes * gpus_per_node, dtype, threshold)
        found = filesystem_seconds(pred.partitioned["total_bytes"], nodes, node_gbps, cap_gbps)
        rows.append({"nodes": nodes, "N": pred.world_size, "save GiB": pred.partitioned["total_bytes"] / GIB,
                     **{k: v for k, v in found.items() if k != "nodes"}})
    return rows


def filesystem_sentence(rows: list[dict[str, Any]], cap_gbps: float) -> str:
    """From which node count the shared cap, not the nodes, sets a partitioned save's time."""
    capped = [r for r in rows if r["uncapped GB/s"] > cap_gbps]
    if not capped:
        return (f"Up to {rows[-1]['nodes']} nodes the nodes together write below the filesystem's {cap_gbps:g} GB/s, "
                "so the save's time falls as nodes are added.")
    first = capped[0]
    return (f"From {first['nodes']} nodes on, the nodes could write {first['uncapped GB/s']:g} GB/s but the "
            f"filesystem takes {cap_gbps:g} GB/s: the save takes {first['capped s']:.3g} s instead of "
            f"{first['uncapped s']:.3g} s, and adding nodes no longer shortens it (a save writes nearly the same "
            "bytes at every N).")


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator reserves for a pinned buffer of `nbytes`: the next power of two
    (`c10::llvm::PowerOf2Ceil` in CachingHostAllocator, so freed blocks are reused)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def pinned_rows(name: str, sizes: list[int], dtype: str = "bf16", threshold: int = 0) -> list[dict[str, Any]]:
    """Per N, a rank's snapshot in pinned host memory: its shard (the fp32 master slice and both Adam moments, one
    buffer each, as the snapshot copies one storage per buffer) and what the allocator reserves for it."""
    rows = []
    for n in sizes:
        pred = predict(name, n, dtype, threshold)
        buffers = [pred.master_bytes, pred.optimizer_bytes // 2, pred.optimizer_bytes // 2]
        reserved = sum(pinned_bytes(b) for b in buffers)
        rows.append({"N": n, "shard MiB": sum(buffers) / MIB, "pinned MiB": reserved / MIB,
                     "rounding": reserved / sum(buffers) - 1})
    return rows


def pinned_sentence(rows: list[dict[str, Any]], gpus_per_node: int) -> str:
    """How much the power-of-two rounding adds to a snapshot's pinned memory, per rank and per node."""
    worst = max(rows, key=lambda r: r["rounding"])
    best = min(rows, key=lambda r: r["rounding"])
    low, high = f"{best['rounding']:.0%}", f"{worst['rounding']:.0%}"
    spread = (f"{high} more at every N shown" if low == high
              else f"from {low} more (N = {best['N']}) to {high} more (N = {worst['N']})")
    return (f"Pinned for a snapshot, each of a rank's three fp32 tensors (weights and two moments) is rounded up to a "
            f"power of two: {spread}. At N = {worst['N']}, "
            f"{worst['shard MiB']:,.0f} MiB of shard reserve {worst['pinned MiB']:,.0f} MiB, and a node of "
            f"{gpus_per_node} ranks pins {worst['pinned MiB'] * gpus_per_node / 1024:,.1f} GiB of host memory the "
            "operating system cannot page out.")


def pinned_table(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """`pinned_rows` as a person reads them: MiB without decimals, the rounding in %."""
    return [{"N": f"{r['N']:,}", "shard MiB": f"{r['shard MiB']:,.0f}", "pinned MiB": f"{r['pinned MiB']:,.0f}",
             "rounding adds": f"{r['rounding']:.0%}"} for r in rows]


def filesystem_table(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """`filesystem_rows` as a person reads them: GiB, GB/s and s to 3 significant figures."""
    return [{"nodes": f"{r['nodes']:,}", "N": f"{r['N']:,}", "save GiB": f"{r['save GiB']:,.1f}",
             "nodes write GB/s": f"{r['uncapped GB/s']:,.0f}", "filesystem takes GB/s": f"{r['aggregate GB/s']:,.0f}",
             "uncapped s": sig3(r["uncapped s"]), "capped s": sig3(r["capped s"])} for r in rows]


def sig3(x: float) -> str:
    """A positive number to 3 significant figures with its trailing zeros, never in scientific notation: 1.20, 0.602."""
    return f"{x:,.{max(0, 2 - math.floor(math.log10(x)))}f}" if x > 0 else "0"


def slowest_write_within(name: str, n: int, timeout_s: float, dtype: str = "bf16") -> float:
    """The write bandwidth in GB/s below which rank 0's write of a gathered 16-bit save outlasts `timeout_s`."""
    return predict(name, n, dtype).gathered["written_bytes"] / timeout_s / GB


def timeout_answer(name: str, n: int, write_gbps: float, timeouts: dict[str, float], dtype: str = "bf16",
                   exercise_gbps: float = EXERCISE_WRITE_GBPS) -> str:
    """Whether a gathered save at `write_gbps` trips the shortest default timeout, and the bandwidth where it would;
    the same for the exercise's bandwidth (for the default when the run uses the exercise's)."""
    key = min(timeouts, key=lambda k: timeouts[k])
    floor = slowest_write_within(name, n, timeouts[key], dtype)
    written = predict(name, n, dtype).gathered["written_bytes"]
    other = DEFAULT_WRITE_GBPS if write_gbps == exercise_gbps else exercise_gbps
    label = "the default" if other == DEFAULT_WRITE_GBPS else "the exercise's"

    def takes(gbps: float) -> str:
        return f"{written / (gbps * GB):,.3g} s"

    return (f"Rank 0 writes {written / GIB:.1f} GiB of {name} alone, so any write bandwidth below {floor:.3g} GB/s "
            f"outlasts the {key} default of {timeouts[key]:g} s. At {label} {other:g} GB/s the write would take "
            f"{takes(other)}, " + ("over it" if other < floor else "within it") + f". At WRITE_GBPS = {write_gbps:g} "
            f"it takes {takes(write_gbps)}, so the gathered save " + ("trips it." if write_gbps < floor
                                                                        else "stays within it."))


def bandwidth_note(rows: list[dict[str, Any]], plan_rows: list[dict[str, Any]], write_gbps: float,
                   node_gbps: float, gpus_per_node: int) -> str:
    """Why the filesystem table's partitioned save at section 3's N takes another time than section 3 gave it:
    there each rank writes at `write_gbps` on its own, here a node's ranks share `node_gbps`."""
    part = next(r for r in plan_rows if r["mode"] == "partitioned")
    row = next((r for r in rows if r["N"] == part["N"]), None)
    if row is None:
        return ""
    per_rank = node_gbps / gpus_per_node
    return (f"At N = {part['N']} this table's save takes {row['capped s']:.3g} s where section 3 gave the same save "
            f"{part['stall s']:.3g} s: section 3 lets every rank write at WRITE_GBPS = {write_gbps:g} GB/s on its "
            f"own, while here a node's {gpus_per_node} ranks share NODE_WRITE_GBPS = {node_gbps:g} GB/s, "
            f"{per_rank:.3g} GB/s each (and section 3 adds the collectives' small term).")


def cap_answer(rows: list[dict[str, Any]], cap_gbps: float, default_rows: list[dict[str, Any]],
               default_cap: float = DEFAULT_FS_CAP_GBPS, exercise_rows: list[dict[str, Any]] | None = None,
               exercise_cap: float = EXERCISE_FS_CAP_GBPS) -> str:
    """Exercise: from which node count the cap sets the partitioned save's time, against the default cap's; at the
    default cap, what the exercise's cap gives (`exercise_rows`: `filesystem_rows` at `exercise_cap`)."""
    def knee(found: list[dict[str, Any]], cap: float) -> str:
        capped = [r for r in found if r["uncapped GB/s"] > cap]
        if not capped:
            return f"never, up to {found[-1]['nodes']} nodes"
        return f"from {capped[0]['nodes']} nodes (N = {capped[0]['N']:,}) on, at {capped[0]['capped s']:.3g} s a save"
    if cap_gbps == default_cap:
        then = (f"with the exercise's FS_CAP_GBPS = {exercise_cap:g} it would set the time "
                f"{knee(exercise_rows, exercise_cap)}"
                if exercise_rows else f"set FS_CAP_GBPS = {exercise_cap:g} to see the cap bite earlier")
        return (f"At the default cap of {default_cap:g} GB/s the filesystem sets the time {knee(rows, cap_gbps)}; "
                f"{then}.")
    return (f"With FS_CAP_GBPS = {cap_gbps:g} the filesystem, not the nodes, sets the partitioned save's time "
            f"{knee(rows, cap_gbps)}; at the default {default_cap:g} GB/s it did so {knee(default_rows, default_cap)}. "
            f"A cap {default_cap / cap_gbps:.3g}x lower makes the capped save {default_cap / cap_gbps:.3g}x longer.")


def pinned_answer(rows: list[dict[str, Any]], default_rows: list[dict[str, Any]],
                  exercise_rows: list[dict[str, Any]] | None = None) -> str:
    """Exercise: how much the power-of-two rounding adds at these world sizes, against the default sizes'; at the
    default sizes, what the exercise's sizes give (`exercise_rows`: `pinned_rows` at `EXERCISE_SIZES`)."""
    def spread(found: list[dict[str, Any]]) -> str:
        low, high = min(r["rounding"] for r in found), max(r["rounding"] for r in found)
        return f"{high:.0%}" if f"{low:.0%}" == f"{high:.0%}" else f"{low:.0%} to {high:.0%}"
    def named(found: list[dict[str, Any]]) -> str:
        return (", ".join(str(r["N"]) for r in found) if len(found) <= 4 else
                f"{found[0]['N']} to {found[-1]['N']} ({len(found)} sizes)")

    def at(found: list[dict[str, Any]]) -> str:
        worst = max(found, key=lambda r: r["rounding"])
        return (f"at N = {named(found)}, the rounding adds {spread(found)} (at most at N = {worst['N']}: "
                f"{worst['shard MiB']:,.0f} MiB of shard reserve {worst['pinned MiB']:,.0f} MiB)")
    said = at(rows)
    said = said[0].upper() + said[1:]
    if [r["N"] for r in rows] == [r["N"] for r in default_rows]:
        return said + ("; these are the default sizes. With the exercise's SIZES = "
                       f"{list(EXERCISE_SIZES)}, {at(exercise_rows)}." if exercise_rows else
                       f"; these are the default sizes: set SIZES = {list(EXERCISE_SIZES)} to compare.")
    return (said + f", against {spread(default_rows)} at the default sizes "
            f"N = {named(default_rows)}. Halving N doubles every buffer, so at powers of two "
            "each buffer sits at the same place between two powers of two and the rounding is one figure; other N "
            "land elsewhere.")
