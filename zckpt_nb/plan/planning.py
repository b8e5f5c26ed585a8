"""Plan a ZeRO-3 checkpoint at any scale before running it: any causal LM config, any N, seconds as well as bytes.

Bytes come from `zckpt_nb.plan.costs`; seconds from bandwidths in GB/s (1e9 bytes per second) and an optional
latency per ring step, as docs/planning.md ("Seconds: a bandwidth model") says term by term.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zckpt_nb.errors import UsageError
from zckpt_nb.plan.costs import Prediction, module_walk_numels, predict, tensor_numels

GB = 1e9
PROTOCOL_OBJECT_COLLECTIVES = 3  # per committed save (`commit`): a size and a payload each, as the ranks agree
READ_RANK_FILES = ("offline", "hf")  # the routes that open every rank's two files (model states, optimizer states)


@dataclass(frozen=True)
class Bandwidths:
    """Write, read and network GB/s; a collective ring step's latency in µs; a rank file's open in ms."""

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


def collective_calls(pred: Prediction, route: str) -> int:
    """Collective calls rank 0 makes in a save: DeepSpeed gathers (and broadcasts) one tensor per call."""
    t = pred.persistence_threshold
    walk, numels = module_walk_numels(pred.model), tensor_numels(pred.model)
    # DeepSpeed's tag check (2 all-reduces), 2 barriers and the regather; then the commit protocol's object
    # collectives, each a size and a payload
    return {"partitioned": 4 + pred.persistent_tensors + 2 * PROTOCOL_OBJECT_COLLECTIVES,
            "gathered16": sum(k > t for k in walk) + len(walk),  # per walked tensor: an all-gather, a broadcast
            "per_param": sum(k > t for k in numels), "offline": 0, "hf": 0}[route]


def work(pred: Prediction, route: str) -> dict[str, float]:
    """What rank 0 does in a save route, by kind: bytes written, read and received, ring steps, rank files opened."""
    cost, n = pred.saves[route], pred.world_size
    # received over the collectives (ring algorithms), from the bytes DeepSpeed logs per op
    wire = {"all_gather_into_tensor": n - 1, "all_reduce": 2 * (n - 1) / n, "broadcast": 1 if n > 1 else 0}
    return {"write": cost.written_bytes, "read": cost.read_bytes,
            "net": sum(wire[op] * v for op, v in cost.ops.items()), "steps": collective_calls(pred, route) * (n - 1),
            "files": 2 * n * (route in READ_RANK_FILES)}


def time_terms(pred: Prediction, bw: Bandwidths) -> dict[str, dict[str, float]]:
    """Per route, rank 0's seconds by kind of work (terms of 0 s left out)."""
    # seconds per unit of each kind: a byte written, read, received; a ring step; a rank file opened
    unit = {"write": 1 / (bw.write_gbps * GB), "read": 1 / (bw.read_gbps * GB), "net": 1 / (bw.net_gbps * GB),
            "steps": bw.step_latency_us * 1e-6, "files": bw.file_ms * 1e-3}
    return {route: {k: v * unit[k] for k, v in work(pred, route).items() if v * unit[k]} for route in pred.saves}


@dataclass(frozen=True)
class PlannedSave:
    """One save route planned on N ranks: bytes, seconds by kind, stall and time to durable."""

    route: str
    world_size: int
    written_bytes: int
    extra_peak_bytes: int
    seconds: dict[str, float]  # by kind of work: write, read, net, steps, files
    stall_s: float
    durable_s: float
    resumable: bool  # holds the optimizer state: training can resume from it (offline's fp32 file does not)


def capped(bw: Bandwidths, writers: int, fs_cap_gbps: float | None) -> Bandwidths:
    """`bw` with each writer's rate cut to its share of a shared filesystem's aggregate cap, when `writers` write at
    once (None: no cap)."""
    if fs_cap_gbps is None:
        return bw
    if fs_cap_gbps <= 0:
        raise UsageError(f"the filesystem's cap must be a positive GB/s figure (got {fs_cap_gbps})")
    return replace(bw, write_gbps=min(bw.write_gbps, fs_cap_gbps / writers))


def plan(name: str, n: int, bw: Bandwidths, dtype: str = "bf16", persistence_threshold: int = 0,
         gather_16bit: bool = True, fs_cap_gbps: float | None = None) -> list[PlannedSave]:
    """Each save route on `n` ranks; the offline route runs after the partitioned save, off the training path.

    `fs_cap_gbps`, a shared filesystem's aggregate write bandwidth: the partitioned save's n ranks write at once and
    share it (each at most fs_cap_gbps / n); the routes where one process writes get at most all of it."""
    pred = predict(name, n, dtype, persistence_threshold)
    terms = time_terms(pred, capped(bw, 1, fs_cap_gbps))
    terms["partitioned"] = time_terms(pred, capped(bw, n, fs_cap_gbps))["partitioned"]
    save = sum(terms["partitioned"].values())
    rows = []
    for route in ("partitioned", "gathered16", "per_param", "offline"):
        if route == "gathered16" and not gather_16bit:
            continue  # save_16bit_model writes nothing with stage3_gather_16bit_weights_on_model_save off
        own = sum(terms[route].values())
        rows.append(PlannedSave(route, n, pred.saves[route].written_bytes, pred.saves[route].extra_peak_bytes(0),
                                terms[route], save if route == "offline" else own,
                                save + own if route == "offline" else own, route == "partitioned"))
    return rows
