"""DeepSpeed's `zero_to_fp32.py` beside a checkpoint: the offline route to one fp32 model, run as its users run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from zckpt_nb.convert.safeload import check_files
from zckpt_nb.convert.verify import newest_committed
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.manifest import sha256_file


def run_zero_to_fp32(ckpt_dir: str | Path, out_dir: str | Path, timeout: float = 600) -> Path:
    """Run `ckpt_dir`'s own `zero_to_fp32.py` (checked) on its newest committed tag, as a user would."""
    import deepspeed.utils.zero_to_fp32 as own

    tag = newest_committed(ckpt_dir, "converting")
    check_files(ckpt_dir, tag)
    script = Path(ckpt_dir) / "zero_to_fp32.py"  # run only if it is DeepSpeed's installed copy
    if not script.is_file() or sha256_file(script) != sha256_file(own.__file__):
        raise CheckpointError(f"{script} is missing or differs from DeepSpeed's own {own.__file__}; refusing to run "
                              "it: copy DeepSpeed's file over it")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    done = subprocess.run([sys.executable, str(script), str(ckpt_dir), str(out_dir), "--tag", tag], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"zero_to_fp32.py failed on {ckpt_dir}: {done.stderr.strip().splitlines()[-1]}")
    return Path(out_dir)
