"""What changing the world size costs: converting a checkpoint to DeepSpeed's universal format, and the first resume.

For each preset: a short real ZeRO-3 run on `--nproc` ranks saves one committed checkpoint; `reshard.convert`
turns it into a universal copy (DeepSpeed's `ds_to_universal` in a child process, measured there: seconds and
peak RSS) and commits it (SHA-256 of every file, manifest, rename). Printed side by side in the same run: the
source's bytes and the save's own seconds (the slowest rank, from run.json), the copy's bytes, the conversion's
seconds and peak RSS, and the ratios conversion/save and copy/source. With `--resume_on M`, the checkpoint is
also resumed on M ranks (one step), and the resume's wall time is reported.

    PYTHONPATH=. python benchmarks/reshard_cost.py --models tiny small medium --nproc 2 --resume_on 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from zckpt_nb.convert.reshard import convert
from zckpt_nb.model import param_count
from zckpt_nb.run.launch import launch

STEPS = {"tiny": 4, "small": 4, "medium": 2, "large": 2}


def measure(model: str, nproc: int, resume_on: int | None, root: Path, timeout: float) -> dict[str, Any]:
    """One save, its conversion and (optionally) a resume on `resume_on` ranks; the figures and ratios."""
    steps = STEPS[model]
    run = launch(nproc, steps, root / model, save_checkpoint=True, model=model, timeout=timeout, verbose=False,
                 progress=False)
    save_seconds = max(r["save_seconds"] for r in run.ranks)
    manifest = convert(root / model, f"global_step{steps}", timeout=timeout)
    cost = manifest.conversion
    row = {"model": model, "params": param_count(model), "nproc": nproc, "source_bytes": cost["source_bytes"],
           "universal_bytes": cost["bytes"], "save_s": round(save_seconds, 3), "convert_s": round(cost["seconds"], 3),
           "convert_peak_rss_mib": round(cost["peak_rss_bytes"] / 2**20),
           "convert_over_save": round(cost["seconds"] / save_seconds, 2),
           "universal_over_source": round(cost["bytes"] / cost["source_bytes"], 3)}
    if resume_on:
        resumed = launch(resume_on, steps + 1, root / model, resume=True, model=model, timeout=timeout,
                         verbose=False, progress=False)
        row |= {"resume_on": resume_on, "resume_wall_s": round(resumed.launch_seconds, 1),
                "resume_reused_copy": resumed.resharded["reused"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--resume_on", type=int, default=None, help="also resume on this many ranks")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zckpt_reshard_") as tmp:
        rows = [measure(m, args.nproc, args.resume_on, Path(tmp), args.timeout) for m in args.models]
    for row in rows:
        print("  ".join(f"{k}: {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k}: {v}"
                        for k, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
