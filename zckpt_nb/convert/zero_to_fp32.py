"""DeepSpeed's `zero_to_fp32`: the offline route to one fp32 model, run as its users run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zckpt_nb.convert.safeload import check_files, check_script
from zckpt_nb.convert.verify import newest_committed


def convert_offline(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> Path:
    """Route 3: DeepSpeed's `zero_to_fp32` in this process; writes `out_dir/pytorch_model.bin`."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(out_dir), tag=tag)
    return Path(out_dir)


def run_zero_to_fp32(ckpt_dir: str | Path, out_dir: str | Path, timeout: float = 600) -> Path:
    """Run `ckpt_dir`'s own `zero_to_fp32.py` (checked) on its newest committed tag, as a user would."""
    tag = newest_committed(ckpt_dir, "converting")
    check_files(ckpt_dir, tag)
    script = check_script(ckpt_dir)
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    done = subprocess.run([sys.executable, str(script), str(ckpt_dir), str(out_dir), "--tag", tag], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"zero_to_fp32.py failed on {ckpt_dir}: {done.stderr.strip().splitlines()[-1]}")
    return Path(out_dir)
