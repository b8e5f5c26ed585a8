"""Do this machine's timings repeat? Two checks before holding a calibration to 25% on every save.

    .venv/bin/python benchmarks/timing_stability.py --model medium --nproc 1 2 --repeats 3

1. **Freed memory returned to the host.** Write a 512 MiB file (through the page cache, as `torch.save` does),
   flush and delete it, wait, and write it again. On a VM whose balloon reports free pages (virtio-balloon's
   VIRTIO_BALLOON_F_REPORTING, feature bit 5, printed when the device is there), the host takes back guest memory that
   has stayed free for a few seconds, and the next write into each of those pages waits for the host to give it back.
   So a save's time depends on how long ago the memory it writes into was freed: on the machine's history, not on the
   save. Nothing inside the VM switches that off.
2. **The calibration's records, measured again.** Re-run some of the saves in `--records` (default: the shipped
   ones) with `compare`, as `benchmarks/calibration_records.py` measured them, and print each rank-0 save's median
   now against its recorded median: how far the same save moves on this machine between two sessions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from calibration import MEASURED
from measured_routes import compare  # benchmarks/measured_routes.py

from zckpt_nb.format.records import Route
from zckpt_nb.measure.meters import flush_writes

BALLOON_DEVICE_ID = "0x0005"  # virtio device id of the memory balloon
REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING


def free_page_reporting() -> bool | None:
    """Whether a virtio balloon with free page reporting is present (None: no balloon device found)."""
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        if (dev / "device").read_text().strip() == BALLOON_DEVICE_ID:
            return (dev / "features").read_text()[REPORTING_BIT] == "1"
    return None


def write_seconds(path: Path, data: bytes) -> float:
    """Seconds to write `data` to `path` through the page cache; then flushed and deleted, freeing those pages."""
    start = time.perf_counter()
    path.write_bytes(data)
    seconds = time.perf_counter() - start
    flush_writes()
    path.unlink()
    return seconds


def rewrite_after(wait: float, folder: Path, mib: int = 512, rounds: int = 3) -> float:
    """Median seconds to write `mib` MiB again `wait` seconds after writing and deleting the same amount."""
    folder.mkdir(parents=True, exist_ok=True)
    data, times = bytes(mib << 20), []
    for _ in range(rounds):
        write_seconds(folder / "probe.bin", data)
        time.sleep(wait)
        times.append(write_seconds(folder / "probe.bin", data))
    return statistics.median(times)


def remeasure(model: str, sizes: list[int], repeats: int, out_dir: Path) -> dict[tuple, list[float]]:
    """Rank 0's seconds per (mode, N) over `repeats` fresh `compare` runs of every mode."""
    seconds: dict[tuple, list[float]] = {}
    for _ in range(repeats):
        for r in compare(sizes, model, list(Route), out_dir, reuse=False, progress=False, verbose=False):
            if r.rank == 0:
                seconds.setdefault((r.route, r.world_size), []).append(r.seconds)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default=str(MEASURED), help="records to compare with (calibration_records.py's)")
    parser.add_argument("--model", default="medium")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output_dir", default="build/bench/stability")
    args = parser.parse_args()

    records = [r for r in json.loads(Path(args.records).read_text()) if r["rank"] == 0]
    recorded = {(r["mode"], r["world_size"]): r["repeat_seconds"] for r in records if r["model"] == args.model}
    missing = sorted(set(args.nproc) - {n for _, n in recorded})
    if missing:
        held = sorted({(r["model"], r["world_size"]) for r in records})
        parser.error(f"{args.records} has no {args.model} saves at N = {missing}; pass a model and N it holds: "
                     + ", ".join(f"{m} N={n}" for m, n in held))
    print(f"virtio balloon free page reporting: {free_page_reporting()}")
    hot, cold = rewrite_after(0, Path(args.output_dir)), rewrite_after(5, Path(args.output_dir))
    print(f"write 512 MiB again at once: {hot:.3f} s; 5 s after deleting it: {cold:.3f} s ({cold / hot:.1f}x)")

    now = remeasure(args.model, args.nproc, args.repeats, Path(args.output_dir))
    ratios = []
    for (mode, n), xs in sorted(now.items()):
        then = recorded[(mode, n)]
        ratios.append(statistics.median(xs) / statistics.median(then))
        print(f"{args.model} {mode:<12}N={n}  recorded median {statistics.median(then):.3f} s "
              f"(repeats {min(then):.3f}-{max(then):.3f})  now {', '.join(f'{x:.3f}' for x in xs)} s  "
              f"now/recorded {ratios[-1]:.2f}")
    print(f"{sum(abs(r - 1) <= 0.25 for r in ratios)} of {len(ratios)} saves' medians now within 25% of the "
          f"recorded ones (now/recorded {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
