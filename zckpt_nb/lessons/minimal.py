"""Notebook 02: a minimal ZeRO-3 worker the learner reads and edits, run on N ranks, and what its run says.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import CheckpointInfo
from zckpt_nb.convert.safeload import load
from zckpt_nb.errors import LaunchError
from zckpt_nb.format.layout import RANK_FILE
from zckpt_nb.lessons.own_model import rank_lines as said  # noqa: F401  (notebook 02 calls minimal.said)
from zckpt_nb.run.launch import launch_module
from zckpt_nb.run.logs import failure_report

SCRIPT_RUNNER = "zckpt_nb.run.script"  # runs a file as __main__ on every rank (torchrun's -m takes modules only)
_LOSS = re.compile(r"^\[rank 0\] step (\d+) loss (\S+)$")
# Keys DeepSpeed itself writes into every rank's model-states file; anything else is the caller's client_state.
DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                  "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                  "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                  "ds_config", "ds_version"}


def run_script(script: str | Path, *args: str, nproc: int, timeout: float, log_path: str | Path) -> list[str]:
    """Run the file `script` on `nproc` CPU ranks under torchrun (own session, killed past `timeout`); its lines.

    The whole output goes to `log_path` (a file named `launch.log`); a failed job raises a LaunchError of a few
    lines: what failed, each rank's last error line, where the full log is.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        log, _ = launch_module(SCRIPT_RUNNER, [str(script), *args], nproc=nproc, timeout=timeout,
                               name=Path(script).name, log_path=log_path, verbose=False, progress=False)
    except LaunchError as e:
        raise LaunchError(failure_report(e, log_path.parent)) from None
    return log


def step_losses(log: list[str]) -> dict[int, float]:
    """The loss rank 0 printed at each step (`step K loss X`), by step."""
    return {int(m.group(1)): float(m.group(2)) for m in map(_LOSS.match, log) if m}


def resume_sentence(full: dict[int, float], resumed: dict[int, float]) -> str:
    """How the resumed run's losses compare with the uninterrupted run's on the steps both trained."""
    shared = sorted(set(full) & set(resumed))
    if not shared:
        return "The resumed run trained no step the uninterrupted run trained: nothing to compare."
    diff = max(abs(full[s] - resumed[s]) for s in shared)
    verdict = "exactly the same losses, bit for bit" if diff == 0 else \
        f"losses that differ by at most {diff:.2e} (not an exact resume)"
    return (f"Resumed at step {shared[0] - 1}, the run trained steps {shared[0]} to {shared[-1]} again and printed "
            f"{verdict}, against the uninterrupted run.")


def shard_sentence(info: CheckpointInfo, dtype: str) -> str:
    """What each rank wrote for one tag, from the files: bytes per rank and the tensor elements behind them."""
    sizes = ", ".join(f"rank {s.rank} {s.bytes / 2**20:.2f} MiB" for s in info.ranks)
    first = info.ranks[0]
    per_param, share = first.payload_bytes / first.partition_numel, first.partition_numel / info.num_params
    return (f"With N = {info.world_size}, each rank wrote its own shard of {info.tag}: {sizes}. Rank 0 holds "
            f"{first.partition_numel:,} of the P = {info.num_params:,} parameters ({share:.1%}, "
            f"padding included) and its files hold {per_param:.1f} bytes of tensor data per parameter it holds "
            f"({'an' if dtype == 'fp32' else 'a'} {dtype} run: fp32 weights and Adam's two fp32 moments, 4 + 4 + 4).")


def shard_answer(info: CheckpointInfo) -> str:
    """Each rank's shard predicted from P/N (12 bytes a parameter: fp32 weights, two Adam moments) against the files."""
    predicted = info.num_params / info.world_size * 12
    measured = [s.payload_bytes for s in info.ranks]
    held = ", ".join(f"{b / 2**20:.3f}" for b in measured)
    on_disk = ", ".join(f"{s.bytes / 2**20:.3f}" for s in info.ranks)
    why = ("" if all(f"{b / 2**20:.3f}" == f"{predicted / 2**20:.3f}" for b in measured)
           else "; padding to a multiple of N is the difference" if info.num_params % info.world_size
           else "; the difference is other tensors the files hold")
    return (f"P/N = {info.num_params:,}/{info.world_size} = {info.num_params / info.world_size:,.0f} parameters per "
            f"rank, times 12 bytes, predicts {predicted / 2**20:.3f} MiB of tensors per rank; the files hold "
            f"{held} MiB (rank 0 first{why}) and measure {on_disk} MiB on disk (pickle framing and the model-states "
            f"file on top).")


def client_keys(ckpt_dir: str | Path, tag: str) -> list[str]:
    """The keys of rank 0's model-states file that DeepSpeed did not write itself: the caller's client_state."""
    path = next(p for p in (Path(ckpt_dir) / tag).iterdir() if RANK_FILE.search(p.name) and
                RANK_FILE.search(p.name).group(1) == "0" and "model" in p.name)
    state = load(path)
    return [f"{k} ({', '.join(state[k])})" if isinstance(state[k], dict) else k
            for k in sorted(set(state) - DEEPSPEED_KEYS)]


def tag_files(ckpt_dir: str | Path, tag: str) -> list[str]:
    """The file names of one tag folder, sorted."""
    return sorted(p.name for p in (Path(ckpt_dir) / tag).iterdir())


def package_rows(minimal: tuple[Path, str], package: tuple[Path, str]) -> list[dict[str, Any]]:
    """The minimal worker's checkpoint against the package worker's: files and client_state keys of one tag each."""
    rows = []
    for name, (folder, tag) in {"minimal worker": minimal, "zckpt_nb worker": package}.items():
        files = tag_files(folder, tag)
        rows.append({"worker": name, "files in the tag folder": len(files),
                     "other files": ", ".join(f for f in files if not RANK_FILE.search(f)) or "-",
                     "client_state keys": ", ".join(client_keys(folder, tag))})
    return rows
