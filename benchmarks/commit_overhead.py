"""What the commit protocol costs: fsync, SHA-256 and agreement as a fraction of save time.

For each model preset, two real ZeRO-3 runs on the same ranks, one after the other: `--save_mode plain`
(DeepSpeed's `save_checkpoint` alone, as before the protocol) and `--save_mode commit` (the protocol).
Each saves several times, and each mode runs `--repeats` times, alternating which goes first (the
machine's load drifts); we report the median seconds per save on the slowest rank and the split of
the protocol's time into DeepSpeed's write, fsync, hashing and the rest (preflight, agreement,
manifest, `latest`).

    PYTHONPATH=. python benchmarks/commit_overhead.py --models tiny medium --nproc 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from zckpt_nb.model import param_count
from zckpt_nb.run.launch import launch

STEPS = {"tiny": (12, 4), "small": (12, 4), "medium": (6, 2), "large": (6, 2)}  # (steps, save_every)


def per_save(run: Any) -> list[dict[str, float]]:
    """For every save: the slowest rank's seconds, and that rank's phase timings."""
    saves = []
    for i in range(len(run.ranks[0]["saves"])):
        slowest = max((r["saves"][i] for r in run.ranks), key=lambda s: s["seconds"])
        saves.append({"seconds": slowest["seconds"], **slowest["timings"]})
    return saves


def median(saves: list[dict[str, float]], key: str) -> float:
    return statistics.median(s.get(key, 0.0) for s in saves)


def run_mode(model: str, mode: str, nproc: int, root: Path, timeout: float) -> tuple[list[dict[str, float]], int]:
    """One training run saving in `mode`; returns its per-save figures and the shard bytes of one checkpoint."""
    steps, every = STEPS[model]
    out = root / f"{model}_{mode}"
    run = launch(nproc, steps, out, save_every=every, model=model, timeout=timeout, verbose=False,
                 progress=False, save_mode=mode)
    shard_bytes = sum(f["bytes"] for r in run.ranks for f in r["files"] if "zero_pp_rank" in f["path"])
    shutil.rmtree(out, ignore_errors=True)
    return per_save(run), shard_bytes


def measure(model: str, nproc: int, root: Path, timeout: float, repeats: int) -> dict[str, Any]:
    """Plain and commit runs for one preset, alternating which goes first; the medians and ratios."""
    saves: dict[str, list[dict[str, float]]] = {"plain": [], "commit": []}
    row: dict[str, Any] = {"model": model, "params": param_count(model), "nproc": nproc}
    for i in range(repeats):
        for mode in ("plain", "commit") if i % 2 == 0 else ("commit", "plain"):
            figures, row["bytes"] = run_mode(model, mode, nproc, root, timeout)
            saves[mode] += figures
    row["saves_per_mode"] = len(saves["commit"])
    row["plain_s"], row["commit_s"] = median(saves["plain"], "seconds"), median(saves["commit"], "seconds")
    row.update({k: median(saves["commit"], k) for k in ("write", "fsync", "hash", "protocol")})
    row["ratio"] = row["commit_s"] / row["plain_s"]
    row["overhead_fraction"] = (row["commit_s"] - row["plain_s"]) / row["commit_s"]
    row["fsync_fraction"] = row["fsync"] / row["commit_s"]
    row["hash_fraction"] = row["hash"] / row["commit_s"]
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (what docs/commit_protocol.md records)."""
    head = ("| model | params | ranks | checkpoint bytes | saves per mode | plain save (s) | commit save (s) | "
            "commit/plain | write (s) | fsync (s) | SHA-256 (s) | agreement+manifest+latest (s) | overhead share | "
            "fsync share | hash share |\n|" + "---|" * 15)
    lines = [f"| {r['model']} | {r['params']:,} | {r['nproc']} | {r['bytes']:,} | {r['saves_per_mode']} | "
             f"{r['plain_s']:.3f} | "
             f"{r['commit_s']:.3f} | {r['ratio']:.2f} | {r['write']:.3f} | {r['fsync']:.3f} | {r['hash']:.3f} | "
             f"{r['protocol']:.3f} | {r['overhead_fraction']:.1%} | {r['fsync_fraction']:.1%} | "
             f"{r['hash_fraction']:.1%} |" for r in rows]
    return "\n".join([head, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"], choices=sorted(STEPS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--root", default=None, help="scratch folder for the runs (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating which mode goes first")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zckpt_commit_bench_", dir=args.root) as tmp:
        rows = [measure(m, args.nproc, Path(tmp), args.timeout, args.repeats) for m in args.models]
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
