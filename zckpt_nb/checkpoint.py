"""Partitioned ZeRO-3 checkpoints, saved and resumed the right way.

The seed's snippet guards the whole save with `if dist.get_rank() == 0:`. Under ZeRO-3 that hangs:
`engine.save_checkpoint` is collective (every rank writes its own shard and joins barriers), so
rank 0 waits forever for ranks that never arrive. The guard belongs around what only one process
should do: creating the directory and writing the tokenizer.
"""

from __future__ import annotations

import os
import random
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.verify import SHARED_FILES  # written once, beside the tags; the manifest lists them

CLIENT_KEY = "zckpt"  # our entry inside DeepSpeed's client_state


def rng_state() -> dict[str, Any]:
    """Every random state this rank's next step depends on (dropout draws from torch's)."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def client_state(step: int, seed: int, global_batch: int, world_size: int, horizon: int) -> dict[str, Any]:
    """What exact resumption needs beyond DeepSpeed's own state: data position, batch, LR horizon and RNG states.

    Under ZeRO-3 every rank writes its own `zero_pp_rank_{r}_..._model_states.pt` holding this dict,
    so each rank gets back its own RNG state on load (on the same world size; a universal load hands every rank
    rank 0's, which is why training draws nothing from these generators: see `data` and `model.gpt2_config`).
    """
    return {CLIENT_KEY: {"step": step, "seed": seed, "global_batch": global_batch, "world_size": world_size,
                         "steps": horizon, "rng": rng_state()}}  # steps: the LR schedule's horizon (schedule.py)


def write_shared(engine: Any, tokenizer: Any, folder: str) -> None:
    """What rank 0 writes beside the checkpoints: the tokenizer, and config.json (what `export` rebuilds from)."""
    tokenizer.save_pretrained(folder)
    engine.module.config.save_pretrained(folder)


def folder_preparation(engine: Any, tokenizer: Any, output_dir: str | Path, tag: str) -> Any:
    """What the one process per folder does before a save (the directory, the tokenizer); None on the others."""
    from zckpt_nb import commit, nodes

    if not nodes.writes_folder(bool(engine.use_node_local_storage())):
        return None
    return partial(commit.prepare_folder, output_dir, tag, partial(write_shared, engine, tokenizer), SHARED_FILES)


def save_partitioned(engine: Any, tokenizer: Any, output_dir: str | Path, state: dict[str, Any], *,
                     keep_last: int = 0, identity: dict[str, Any] | None = None) -> Any:
    """Save a partitioned checkpoint from *every* rank through the commit protocol; returns its `SaveOutcome`.

    `.seconds` is this rank's time spent saving; `.committed` is False (on every rank) when any rank
    failed, with `.error` saying which rank, what and where. See `zckpt_nb.commit`. With `keep_last`, a
    committed save is followed by rotation (`zckpt_nb.rotation`), whose failure only sets `.rotation_error`.
    """
    from zckpt_nb import commit, rotation

    step, node_local = state[CLIENT_KEY]["step"], bool(engine.use_node_local_storage())
    tag = f"global_step{step}"
    # every rank saves its shard, and the checkpoint counts once every rank's shard is on disk
    outcome = commit.save(engine, output_dir, tag, state, step=step, identity=identity or {},
                          prepare=folder_preparation(engine, tokenizer, output_dir, tag))
    if outcome.committed and keep_last:  # the same on every rank, so every rank joins rotation's gather
        rotation.after_commit(output_dir, keep_last, outcome, node_local)
    return outcome


def resume(engine: Any, output_dir: str | Path, tag: str | None = None, restore_rng: bool = True) -> dict[str, Any]:
    """Load model, optimizer, scheduler and our client state from `tag` (default `latest`); restore this rank's RNG.

    `restore_rng=False` for a universal load: every rank then reads rank 0's client state, not its own.

    DeepSpeed's reads go through `safeload.weights_only`: a file holding anything but tensors and the types
    DeepSpeed writes is refused before it can run code, even when its manifest was forged to match it.
    """
    from zckpt_nb import safeload

    with safeload.weights_only(engine):
        path, state = engine.load_checkpoint(str(output_dir), tag=tag)
    if path is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {output_dir} (no 'latest' file)")
    ours = state[CLIENT_KEY]
    if restore_rng:
        set_rng_state(ours["rng"])
    return ours


def rank_files(output_dir: str | Path, tag: str, rank: int) -> list[dict[str, Any]]:
    """The files rank `rank` wrote for checkpoint `tag`, with their sizes in bytes, read from disk."""
    root = Path(output_dir)
    paths = sorted((root / tag).glob(f"*zero_pp_rank_{rank}_*"))
    if rank == 0:
        shared = ("latest", "zero_to_fp32.py", "zero_to_torch.py", *SHARED_FILES)
        paths += [root / name for name in shared if (root / name).is_file()]
    return [{"path": str(p.relative_to(root)), "bytes": p.stat().st_size} for p in paths]


def copy_checkpoint(src: str | Path, dst: str | Path, tag: str) -> Path:
    """Copy checkpoint `tag` (and the tokenizer beside it) into a fresh `dst` whose `latest` names it."""
    import shutil

    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src / tag, dst / tag)
    for name in (*SHARED_FILES, "zero_to_fp32.py"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    (dst / "latest").write_text(tag)
    return dst


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
    from zckpt_nb.safeload import check_files, check_script
    from zckpt_nb.verify import newest_committed

    tag = newest_committed(ckpt_dir, "converting")
    check_files(ckpt_dir, tag)
    check_script(ckpt_dir)
    done = zero_to_fp32_script(ckpt_dir, out_dir, "--tag", tag, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"zero_to_fp32.py failed on {ckpt_dir}: {done.stderr.strip().splitlines()[-1]}")
    return Path(out_dir)
