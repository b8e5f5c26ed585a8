"""DeepSpeed's `zero_to_fp32`: the offline route to one fp32 model, run as its users run it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zckpt_nb.convert.safeload import check_files, check_script
from zckpt_nb.convert.verify import newest_committed
from zckpt_nb.format.layout import latest_name
from zckpt_nb.measure import meters
from zckpt_nb.measure.meters import ready_to_time


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
    tag = tag or latest_name(ckpt_dir)
    # bf16 runs name their optimizer files bf16_zero_pp_rank_*
    return sorted((Path(ckpt_dir) / str(tag)).glob("*zero_pp_rank_*_states.pt"))


def measure_offline(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> meters.SaveCost:
    """Run route 3 and measure it: one process, so rank 0 and no collective bytes (`ready_to_time` first)."""
    ready_to_time()
    return meters.measure("offline", lambda: convert_offline(ckpt_dir, out_dir, tag),
                           written=lambda: meters.files_under(out_dir), read=shard_files(ckpt_dir, tag))


def zero_to_fp32_script(ckpt_dir: str | Path, out_dir: str | Path, *args: str, timeout: float = 600) -> Any:
    """Run the `zero_to_fp32.py` DeepSpeed copied into `ckpt_dir` in a new process; its CompletedProcess."""
    import subprocess
    import sys

    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    cmd = [sys.executable, str(Path(ckpt_dir) / "zero_to_fp32.py"), str(ckpt_dir), str(out_dir), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def run_zero_to_fp32(ckpt_dir: str | Path, out_dir: str | Path, timeout: float = 600) -> Path:
    """Run the `zero_to_fp32.py` DeepSpeed copied into `ckpt_dir`, as a user would; returns `out_dir`.

    Only the newest committed checkpoint is converted, after every file was checked against its manifest and
    unpickled weights-only (the script itself loads with weights_only=False), and the script is DeepSpeed's own.
    """
    tag = newest_committed(ckpt_dir, "converting")
    check_files(ckpt_dir, tag)
    check_script(ckpt_dir)
    done = zero_to_fp32_script(ckpt_dir, out_dir, "--tag", tag, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"zero_to_fp32.py failed on {ckpt_dir}: {done.stderr.strip().splitlines()[-1]}")
    return Path(out_dir)
