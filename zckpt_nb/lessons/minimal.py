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
from zckpt_nb.lessons.claims import RESUME_TOLERANCE
from zckpt_nb.lessons.own_model import rank_lines as said  # noqa: F401  (notebook 02 calls minimal.said)
from zckpt_nb.run.launch import launch_module
from zckpt_nb.run.logs import failure_report

SCRIPT_RUNNER = "zckpt_nb.run.script"  # runs a file as __main__ on every rank (torchrun's -m takes modules only)
_LOSS = re.compile(r"^\[rank 0\] step (\d+) loss (\S+)(?: lr (\S+))?$")
# Keys DeepSpeed itself writes into every rank's model-states file; anything else is the caller's client_state.
DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                  "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                  "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                  "ds_config", "ds_version"}


def run_script(script: str | Path, *args: str, nproc: int, timeout: float, log_path: str | Path) -> list[str]:
    """Run the file `script` on `nproc` ranks under torchrun (own session, killed past `timeout`); its lines.

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


def step_lrs(log: list[str]) -> dict[int, float]:
    """The learning rate rank 0 printed at each step (`step K loss X lr Y`), by step."""
    return {int(m.group(1)): float(m.group(3)) for m in map(_LOSS.match, log) if m and m.group(3)}


def resume_verdict(full: dict[int, float], resumed: dict[int, float], dtype: str) -> str:
    """The resumed losses against the uninterrupted ones, in words: exact, or within the dtype's stated tolerance."""
    shared = sorted(set(full) & set(resumed))
    diff = max(abs(full[s] - resumed[s]) for s in shared)
    if diff == 0:
        return "exactly the same losses, bit for bit"
    tolerance = RESUME_TOLERANCE[dtype]
    inside = "within" if diff <= tolerance else "outside"
    return (f"losses that differ by at most {diff:.2e} (not an exact resume), {inside} the {tolerance:g} this package "
            f"allows a {dtype} resume")


def resume_sentence(full: dict[int, float], resumed: dict[int, float], dtype: str = "fp32") -> str:
    """How the resumed run's losses compare with the uninterrupted run's on the steps both trained."""
    shared = sorted(set(full) & set(resumed))
    if not shared:
        return "The resumed run trained no step the uninterrupted run trained: nothing to compare."
    return (f"Resumed at step {shared[0] - 1}, the run trained steps {shared[0]} to {shared[-1]} again and printed "
            f"{resume_verdict(full, resumed, dtype)}, against the uninterrupted run.")


def resume_answer(full_log: list[str], resumed_log: list[str], ckpt_dir: str | Path, tag: str, dtype: str,
                  default_step: int = 10) -> str:
    """Exercise 2: where the resume step fell in the LR warm-up, the scheduler position the checkpoint held, and
    whether the resumed run's learning rates and losses were the uninterrupted run's."""
    full, resumed = step_losses(full_log), step_losses(resumed_log)
    lrs, again = step_lrs(full_log), step_lrs(resumed_log)
    state = load(rank_file(ckpt_dir, tag, "model"))
    warm = state["ds_config"]["scheduler"]["params"]["warmup_num_steps"]
    step = min(resumed) - 1
    where = f"inside the LR warm-up (its first {warm} steps)" if step < warm else f"after the {warm}-step warm-up"
    same_lr = all(lrs[k] == again[k] for k in again)
    text = (f"This run resumed at step {step}, {where}. The checkpoint's `lr_scheduler` entry (last_batch_iteration "
            f"{state['lr_scheduler']['last_batch_iteration']}) put the schedule back there: the resumed run's first "
            f"step used LR {again[step + 1]:.3g}"
            + (" (the warm-up's `warmup_min_lr`)" if again[step + 1] == state["ds_config"]["scheduler"]["params"].get(
                "warmup_min_lr") else "") + ", "
            + ("and every step's LR was the uninterrupted run's" if same_lr else
               "but not every step's LR was the uninterrupted run's")
            + ("; so were its losses (section 5 compares them)." if all(full.get(k) == v for k, v in resumed.items())
               else f"; its losses were not all the uninterrupted run's (section 5 holds a {dtype} resume to its "
               "tolerance)."))
    if step == default_step or default_step + 1 not in lrs:
        return text + (" That is the default `RESUME_STEP`: set it to 1 and run again to resume inside the warm-up."
                       if step == default_step else "")
    inside = "after" if default_step >= warm else "inside"
    return (f"{text} The default `RESUME_STEP = {default_step}` resumes {inside} the warm-up, where the uninterrupted "
            f"run's LR was {lrs[default_step + 1]:.3g}.")


def shard_sentence(info: CheckpointInfo, dtype: str) -> str:
    """What each rank wrote for one tag, from the files: bytes per rank and the tensor elements behind them."""
    sizes = ", ".join(f"rank {s.rank} {s.bytes / 2**20:.2f} MiB" for s in info.ranks)
    first = info.ranks[0]
    per_param, share = first.payload_bytes / first.partition_numel, first.partition_numel / info.num_params
    return (f"With N = {info.world_size}, each rank wrote its own shard of {info.tag}: {sizes}. Rank 0 holds "
            f"{first.partition_numel:,} of the P = {info.num_params:,} parameters ({share:.1%}, "
            f"padding included) and its files hold {per_param:.1f} bytes of tensor data per parameter it holds "
            f"({'an' if dtype == 'fp32' else 'a'} {dtype} run: fp32 weights and Adam's two fp32 moments, 4 + 4 + 4).")


def _per_rank_mib(values: list[int]) -> str:
    """The ranks' byte counts in MiB: one figure when all round the same, else the smallest to the largest."""
    low, high = f"{min(values) / 2**20:.3f}", f"{max(values) / 2**20:.3f}"
    return f"{low} MiB" if low == high else f"{low} to {high} MiB"


def shard_answer(info: CheckpointInfo, default_nproc: int = 2) -> str:
    """Exercise 1: each rank's shard at this N, predicted from P/N x 12 bytes and read from the files, against the
    default N's (`default_nproc`) prediction."""
    def mib(n: int) -> float:
        return info.num_params / n * 12 / 2**20

    held, files = (_per_rank_mib([getattr(s, key) for s in info.ranks]) for key in ("payload_bytes", "bytes"))
    n = info.world_size
    why = ("" if all(f"{s.payload_bytes / 2**20:.3f}" == f"{mib(n):.3f}" for s in info.ranks)
           else " (padding to a multiple of N is the difference)" if info.num_params % n
           else " (other tensors in the files are the difference)")
    text = (f"At N = {n}, P/N = {info.num_params:,}/{n} = {info.num_params / n:,.0f} parameters per rank, times "
            f"12 bytes (fp32 weights and Adam's two moments), predicts {mib(n):.3f} MiB of tensors per rank; the "
            f"files hold {held} of tensor data ({files} with headers){why}.")
    if n == default_nproc:
        return (f"{text} That is the default `NPROC`. At N = 3 the same rule gives {mib(3):.3f} MiB per rank, "
                f"{default_nproc}/3 of this: set `NPROC = 3` and run again to measure it.")
    return (f"{text} At the default N = {default_nproc} the same rule gives {mib(default_nproc):.3f} MiB: "
            f"{n} ranks each hold {default_nproc}/{n} = {default_nproc / n:.2f} of that.")


def start_sentence(losses: dict[int, float], ref: float) -> str:
    """The first loss against ln(vocab), what an untrained model should give, and the last."""
    first, last = losses[min(losses)], losses[max(losses)]
    near = abs(first - ref) <= 0.05 * ref
    return (f"The minimal worker's first loss was {first:.3f} against ln(vocab) = {ref:.3f}: "
            + ("the model built with `HfDeepSpeedConfig` alive started where an untrained model should" if near else
               "not where an untrained model starts (was the model built without `HfDeepSpeedConfig` alive?)")
            + f"; after step {max(losses)} it was {last:.3f}.")


def rank_file(ckpt_dir: str | Path, tag: str, kind: str, rank: int = 0) -> Path:
    """One rank's `kind` ("model" or "optim") states file in a tag folder."""
    return next(p for p in (Path(ckpt_dir) / tag).iterdir() if RANK_FILE.search(p.name) and
                RANK_FILE.search(p.name).group(1) == str(rank) and kind in p.name)


def client_keys(ckpt_dir: str | Path, tag: str) -> list[str]:
    """The keys of rank 0's model-states file that DeepSpeed did not write itself: the caller's client_state."""
    state = load(rank_file(ckpt_dir, tag, "model"))
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
        rows.append({"worker": name, f"files in {tag}/ (every rank's)": len(files),
                     "of them, not a rank's shard file": ", ".join(f for f in files if not RANK_FILE.search(f)) or "-",
                     "client_state keys": ", ".join(client_keys(folder, tag))})
    return rows


def rank_bytes_sentence(ranks: list[dict[str, Any]]) -> str:
    """Why rank 0 wrote more than the other ranks: the run's own files beside its shard, read from `run.json`."""
    run_files = [f for f in ranks[0]["files"] if not RANK_FILE.search(f["path"])]
    if not run_files:
        return "Every rank wrote only its own shard files."
    extra = sum(f["bytes"] for f in run_files)
    return (f"Rank 0's bytes written include {extra / 2**20:.3f} MiB beside its shard, the files of the whole run: "
            f"{', '.join(f['path'] for f in run_files)}; every other rank wrote only its shard files.")
