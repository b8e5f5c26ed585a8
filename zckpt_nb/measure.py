"""Measure one save: wall time, peak memory while it runs, bytes written, bytes moved by collectives.

Nothing here is estimated. Bytes written are read from the files; collective bytes come from DeepSpeed's own comms
logger (the `"comms_logger"` section of the DeepSpeed config): we snapshot its per-operation totals before and after
the save and keep the difference, so each save gets its own figures. DeepSpeed's `deepspeed.comm.log_summary()`
prints the same table, but it is itself collective (barriers); reading the logger's raw data is local to the rank.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

MODES = ("partitioned", "gathered16", "per_param", "offline", "hf")
_device_peak_before_resets = 0  # GPU peak seen before a save reset the counter (for run.json's run-wide peak)


@dataclass
class SaveCost:
    """What one save cost on one rank (one record of run.json's `save_costs`)."""

    mode: str
    rank: int
    seconds: float
    peak_memory_bytes: int  # the process's peak while saving: RSS on CPU, allocated accelerator memory on GPU
    extra_peak_bytes: int  # that peak minus what the process held when the save began
    bytes_written: int  # sizes of the files this rank wrote, read from disk
    comm_bytes: int | None  # DeepSpeed's logged message bytes (None: a process group without the logger)
    comm_ops: dict[str, dict[str, int]] = field(default_factory=dict)  # op -> {'count', 'bytes'}
    memory_kind: str = "rss"  # "rss" (CPU) or "cuda_allocated"
    bytes_read: int = 0  # size of the checkpoint files a route loads (offline conversion, HF export)
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PeakRSS:
    """Track this process's peak resident memory while a block runs, by sampling in a background thread.

    psutil (like /proc) offers a peak counter only for the whole process life, not one that restarts at the
    save, so we sample. Large tensors live for a while after they are allocated, so a 2 ms interval sees them.
    """

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self._proc, self._interval, self._stop = psutil.Process(), interval, threading.Event()
        self.baseline = self.peak = 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


class PeakCuda:
    """Peak allocated GPU memory while a block runs (torch's counter, reset at the start)."""

    def __enter__(self) -> PeakCuda:
        global _device_peak_before_resets
        import torch

        _device_peak_before_resets = max(_device_peak_before_resets, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self.peak = torch.cuda.max_memory_allocated()


def device_peak_bytes() -> int:
    """This process's peak allocated GPU memory over its whole life, including before the saves' resets."""
    import torch

    return max(_device_peak_before_resets, int(torch.cuda.max_memory_allocated()))


def comm_totals() -> dict[str, dict[str, int]] | None:
    """DeepSpeed's comms-logger totals on this rank so far: op -> {'count', 'bytes' (message size x count)}.

    {} when no process group exists (no collective can have run); None when one exists but the logger is off.
    """
    comm = sys.modules.get("deepspeed.comm")
    if comm is None or not comm.is_initialized():
        return {}
    if not comm.comms_logger.enabled:
        return None
    return {op: {"count": sum(v[0] for v in by_size.values()),
                 "bytes": sum(size * v[0] for size, v in by_size.items())}
            for op, by_size in comm.comms_logger.get_raw_data().items()}


def comm_delta(before: dict[str, dict[str, int]] | None,
               after: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]] | None:
    """The operations logged between two `comm_totals` snapshots."""
    if before is None or after is None:
        return None
    delta = {}
    for op, now in after.items():
        was = before.get(op, {"count": 0, "bytes": 0})
        if now["count"] > was["count"]:
            delta[op] = {"count": now["count"] - was["count"], "bytes": now["bytes"] - was["bytes"]}
    return delta


def measure(mode: str, save: Callable[[], Any], *, written: Callable[[], Iterable[Path]], rank: int = 0,
            device: str = "cpu", read: Iterable[Path] = ()) -> SaveCost:
    """Run `save()` and return its SaveCost; `written()` lists the files this rank wrote (called afterwards)."""
    before = comm_totals()
    with (PeakCuda() if device.startswith("cuda") else PeakRSS()) as mem:
        start = time.perf_counter()
        save()
        seconds = time.perf_counter() - start
    ops = comm_delta(before, comm_totals())
    paths = sorted(set(written()))
    return SaveCost(mode=mode, rank=rank, seconds=seconds, peak_memory_bytes=int(mem.peak),
                    extra_peak_bytes=int(mem.peak - mem.baseline), bytes_written=sum(p.stat().st_size for p in paths),
                    comm_bytes=None if ops is None else sum(o["bytes"] for o in ops.values()), comm_ops=ops or {},
                    memory_kind="cuda_allocated" if device.startswith("cuda") else "rss",
                    bytes_read=sum(Path(p).stat().st_size for p in read), files=[str(p) for p in paths])


def measure_partitioned(engine: Any, tokenizer: Any, output_dir: str | Path, state: dict[str, Any], *, step: int,
                        rank: int, device: str) -> SaveCost:
    """The normal partitioned save (`checkpoint.save_partitioned`, every rank), measured like the other routes."""
    from zckpt_nb import checkpoint

    root = Path(output_dir)
    return measure("partitioned", partial(checkpoint.save_partitioned, engine, tokenizer, root, state),
                   written=lambda: [root / f["path"] for f in checkpoint.rank_files(root, f"global_step{step}", rank)],
                   rank=rank, device=device)


def files_under(root: str | Path) -> list[Path]:
    """Every file below `root` (what a route wrote into its own folder)."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def cost_rows(costs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One display row per (mode, rank): the figures in units people read (s, MiB, KiB)."""
    order = {m: i for i, m in enumerate(MODES)}
    rows = []
    for c in sorted(costs, key=lambda c: (order.get(c["mode"], len(order)), c["rank"])):
        comm = c["comm_bytes"]
        rows.append({"mode": c["mode"], "rank": c["rank"], "seconds": round(c["seconds"], 3),
                     "peak memory (MiB)": round(c["peak_memory_bytes"] / 2**20, 1),
                     "extra peak (MiB)": round(c["extra_peak_bytes"] / 2**20, 2),
                     "written (KiB)": round(c["bytes_written"] / 2**10, 1),
                     "read (KiB)": round(c.get("bytes_read", 0) / 2**10, 1),
                     "collective bytes (KiB)": "not logged" if comm is None else round(comm / 2**10, 1),
                     "collective ops": sum(o["count"] for o in c.get("comm_ops", {}).values())})
    return rows
