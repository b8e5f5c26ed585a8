"""Is a save slower than in another version of the package? The same training job in two source trees, interleaved.

Each repeat launches the job once with this tree's `zckpt_nb` and once with `--other`'s (its folder goes first on
PYTHONPATH, for the ranks too), alternating which goes first; per save mode it prints the median over saves of the
slowest rank's save call and, for async, its stall, for both trees, with the ratio this/other and the spread.

    git worktree add --detach /tmp/zckpt_old 34c5c42
    PYTHONPATH=. python benchmarks/save_speed_vs.py --other /tmp/zckpt_old --model small --modes commit async
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_job(tree: Path, out: Path, args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    """One training job saving in `mode` with the package of `tree`; each save's slowest-rank seconds and stall."""
    code = (f"from zckpt_nb.run.launch import launch; launch({args.nproc}, {args.steps}, {str(out)!r}, "
            f"save_every={args.save_every}, model={args.model!r}, save_mode={mode!r}, verbose=False, progress=False)")
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tree, timeout=3600)
    ranks = json.loads((out / "run.json").read_text())["ranks"]
    saves = list(zip(*(rank["saves"] for rank in ranks)))
    return {"seconds": [max(s["seconds"] for s in per_rank) for per_rank in saves],
            "stall": [max(s["stall_seconds"] for s in per_rank) for per_rank in saves]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="the other source tree (a git worktree)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["commit"])
    args = parser.parse_args()
    trees = {"this": HERE, "other": args.other.resolve()}
    for mode in args.modes:
        found: dict[str, dict[str, list[float]]] = {name: {"seconds": [], "stall": []} for name in trees}
        for i in range(args.repeats):
            for name in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                with tempfile.TemporaryDirectory(prefix="zckpt_vs_") as tmp:
                    for key, values in run_job(trees[name], Path(tmp) / "run", args, mode).items():
                        found[name][key] += values
        for key in ("seconds", "stall") if mode == "async" else ("seconds",):
            this, other = (statistics.median(found[name][key]) for name in trees)
            spread = {name: (min(found[name][key]), max(found[name][key])) for name in trees}
            print(f"{mode} {key}: this {this:.3f} s, other {other:.3f} s, ratio {this / other:.2f} "
                  f"(medians of {len(found['this'][key])} saves; ranges this {spread['this'][0]:.3f}-"
                  f"{spread['this'][1]:.3f}, other {spread['other'][0]:.3f}-{spread['other'][1]:.3f})")


if __name__ == "__main__":
    main()
