"""What hashing a checkpoint's files on all cores saves: `verify.check_hashes` with one thread, then one per core.

It writes `--files` files of `--mib` MiB of random bytes (a stand-in for the rank files of a checkpoint; their
SHA-256 taken while writing), then hashes them `--repeats` times each way and prints the best seconds of each and
their ratio. The files were just written, so both ways read them from the page cache: this measures hashing, not the
disk. On a shared machine the ratio depends on the cores free at the time.

    PYTHONPATH=. python benchmarks/verify_parallel.py --files 8 --mib 32 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from zckpt_nb.convert.verify import check_hashes


def write_files(folder: Path, count: int, mib: int) -> list[tuple[Path, str]]:
    """`count` files of random bytes in `folder`, with their SHA-256."""
    files = []
    for i in range(count):
        data = os.urandom(mib * 2**20)
        path = folder / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt"
        path.write_bytes(data)
        files.append((path, hashlib.sha256(data).hexdigest()))
    return files


def best_seconds(files: list[tuple[Path, str]], workers: int | None, repeats: int) -> float:
    """The fastest of `repeats` full checks of `files` with `workers` threads (None: one per core)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        check_hashes(files, workers)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32, help="size of each file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp), args.files, args.mib)
        serial = best_seconds(files, 1, args.repeats)
        parallel = best_seconds(files, None, args.repeats)
    print(f"{args.files} files x {args.mib} MiB, {os.cpu_count()} CPUs: serial {serial:.3f} s, parallel "
          f"{parallel:.3f} s, serial/parallel {serial / parallel:.2f}x")


if __name__ == "__main__":
    main()
