"""Measure one save: wall time, peak memory by kind while it runs, bytes written, bytes moved by collectives.

Nothing is estimated: bytes written are read from the files; collective bytes are the difference of DeepSpeed's
comms-logger totals before and after the save (its raw data, local to the rank; `deepspeed.comm.log_summary()` prints
the same table but is itself collective).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import sizes_of
from zckpt_nb.format.records import SaveCost

PEAKS_BEFORE_RESETS = {"host": 0, "cuda": 0}  # the run-wide peaks seen before a save reset the counters
OBJECT_COLLECTIVES = {"ops": 0, "bytes": 0}  # this process's torch object collectives (the commit protocol's)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


@cache
def libc() -> Any:
    """This process's C library (`madvise`; glibc's `mallopt`, and `mallinfo2` from 2.33), loaded once."""
    lib = ctypes.CDLL(None)
    if hasattr(lib, "mallinfo2"):
        lib.mallinfo2.restype = _MallInfo2
    return lib


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not freed, over all arenas (glibc `mallinfo2`); None off glibc."""
    if not hasattr(libc(), "mallinfo2"):
        return None
    info = libc().mallinfo2()
    return int(info.uordblks + info.hblkhd)  # small chunks in use + large chunks malloc mmap()ed


def rss_high_water() -> int | None:
    """The kernel's peak RSS of this process since start or the last `reset_rss_high_water` (VmHWM); None off Linux."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)


def reset_rss_high_water() -> bool:
    """Restart VmHWM at the current RSS (Linux); False where refused, the earlier peak kept."""
    PEAKS_BEFORE_RESETS["host"] = max(PEAKS_BEFORE_RESETS["host"], rss_high_water() or 0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def host_peak_bytes() -> int:
    """This process's peak RSS over its whole life, including before the saves' resets of VmHWM."""
    import resource

    return max(PEAKS_BEFORE_RESETS["host"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB


class HostMemory:
    """Peak RSS and peak live heap bytes of this process while a block runs."""

    def __init__(self) -> None:
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()  # the figures: set on entering the block

    def _sample(self) -> None:
        heap = heap_in_use()
        if heap is not None:
            self.peak_heap = max(self.peak_heap or 0, heap)
        if not self._kernel_peak:
            self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)

    def _run(self) -> None:  # the heap has no high-water mark: sample every ms first, then each tenth of the time
        start = time.perf_counter()
        while not self._stop.wait(min(0.05, max(0.001, (time.perf_counter() - start) / 10))):
            self._sample()

    def __enter__(self) -> HostMemory:
        self._kernel_peak = reset_rss_high_water()
        self.baseline_rss = self.peak_rss = self._proc.memory_info().rss
        self.baseline_heap = self.peak_heap = heap_in_use()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._kernel_peak:
            self.peak_rss = max(self.peak_rss, rss_high_water() or 0)


def pinned_host_bytes() -> int:
    """Pinned host memory torch's caching host allocator holds now, cached blocks included."""
    import torch

    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def comm_counts() -> dict[str, dict[int, int]] | None:
    """DeepSpeed's comms-logger record so far: op -> {size: count}; {} without a group, None if off."""
    comm = sys.modules.get("deepspeed.comm")
    if comm is None or not comm.is_initialized():
        return {}
    if not comm.comms_logger.enabled:
        return None
    # the logger keeps {op: {message size: [count, latencies, algbw, busbw]}}
    return {op: {size: v[0] for size, v in by_size.items()} for op, by_size in comm.comms_logger.get_raw_data().items()}


def comm_delta(before: dict[str, dict[int, int]] | None,
               after: dict[str, dict[int, int]] | None) -> dict[str, dict[str, int]] | None:
    """The operations logged between two `comm_counts` snapshots: op -> {'count', 'bytes', 'max_bytes'}."""
    if before is None or after is None:
        return None
    delta = {}
    for op, sizes in after.items():
        grown = {size: n - before.get(op, {}).get(size, 0) for size, n in sizes.items()}
        grown = {size: n for size, n in grown.items() if n > 0}
        if grown:
            delta[op] = {"count": sum(grown.values()), "bytes": sum(size * n for size, n in grown.items()),
                         "max_bytes": max(grown)}
    return delta


def flush_writes() -> None:
    """Write every dirty page back now (`os.sync`), so the route timed next pays only for its own files."""
    os.sync()


def measure(mode: str, save: Callable[[], Any], *, written: Callable[[], Iterable[Path]], rank: int = 0,
            device: str = "cpu", read: Iterable[Path] = ()) -> SaveCost:
    """Run `save()` and return its SaveCost; `written()` lists the files this rank wrote (called afterwards)."""
    on_gpu = device.startswith("cuda")
    before, objects = comm_counts(), dict(OBJECT_COLLECTIVES)
    if on_gpu:  # peak allocated GPU memory while it runs: torch's counter, reset at the start
        import torch

        PEAKS_BEFORE_RESETS["cuda"] = max(PEAKS_BEFORE_RESETS["cuda"], torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        cuda_baseline = torch.cuda.memory_allocated()
    with HostMemory() as host:
        start = time.perf_counter()
        save()
        seconds = time.perf_counter() - start
    cuda_peak = torch.cuda.max_memory_allocated() if on_gpu else 0
    ops = comm_delta(before, comm_counts())
    sizes = sizes_of(sorted(set(written())))  # a failed save's files may be removed meanwhile
    return SaveCost(mode=mode, rank=rank, seconds=seconds, peak_memory_bytes=int(host.peak_rss),
                    extra_peak_bytes=int(host.peak_rss - host.baseline_rss),
                    bytes_written=sum(sizes.values()),
                    comm_bytes=None if ops is None else sum(o["bytes"] for o in ops.values()), comm_ops=ops or {},
                    heap_extra_peak_bytes=None if host.baseline_heap is None else host.peak_heap - host.baseline_heap,
                    cuda_peak_bytes=int(cuda_peak) if on_gpu else None,
                    cuda_extra_peak_bytes=int(cuda_peak - cuda_baseline) if on_gpu else None,
                    pinned_host_bytes=pinned_host_bytes() if on_gpu else None,
                    bytes_read=sum(Path(p).stat().st_size for p in read), files=[str(p) for p in sizes],
                    protocol_comm_ops=OBJECT_COLLECTIVES["ops"] - objects["ops"],
                    protocol_comm_bytes=OBJECT_COLLECTIVES["bytes"] - objects["bytes"])


def files_under(root: str | Path) -> list[Path]:
    """Every file below `root` (what a route wrote into its own folder)."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def peak_memory(device: str) -> dict[str, int | None]:
    """This rank's run-wide peaks by kind: host RSS, and CUDA allocated and pinned host bytes on a GPU."""
    if not device.startswith("cuda"):
        return {"peak_memory_bytes": host_peak_bytes(), "cuda_peak_bytes": None, "pinned_host_bytes": None}
    import torch

    return {"peak_memory_bytes": host_peak_bytes(), "pinned_host_bytes": pinned_host_bytes(),
            "cuda_peak_bytes": max(PEAKS_BEFORE_RESETS["cuda"], int(torch.cuda.max_memory_allocated()))}

