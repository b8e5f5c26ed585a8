"""Notebook 08: a model and a training loop of your own (a raw DeepSpeed loop, Hugging Face `Trainer`), through
adopt, inspect, export, generate and reshard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import MANIFEST, RANK_FILE
from zckpt_nb.run.launch import launch_module

OWN_LOOP, TRAINER_LOOP = "zckpt_nb.examples.own_loop", "zckpt_nb.examples.trainer_loop"


def run_example(module: str, out: str | Path, *args: str, nproc: int = 2, timeout: float = 600) -> list[str]:
    """One of `zckpt_nb.examples` on `nproc` CPU ranks under torchrun; the lines its ranks printed."""
    log, _ = launch_module(module, [str(out), *args], nproc=nproc, timeout=timeout, name=module.rsplit(".")[-1],
                           verbose=False, progress=False)
    return log


def rank_lines(log: list[str], word: str) -> list[str]:
    """The lines of `log` the ranks printed that contain `word`."""
    return [line for line in log if line.startswith("[rank") and word in line]


def folder_rows(folder: str | Path) -> list[dict[str, Any]]:
    """Every file of a checkpoint folder (its tags' files too): path, bytes, and which rank's partition it holds."""
    folder = Path(folder)
    rows = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rank = RANK_FILE.search(path.name)
        what = f"rank {rank.group(1)}'s {rank.group(2)} states" if rank else \
            "the manifest" if path.name == MANIFEST else "-"
        rows.append({"file": path.relative_to(folder).as_posix(), "bytes": path.stat().st_size, "partition": what})
    return rows


def adopted_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """What `adopt` read from the files, one row per fact."""
    facts = {**manifest["adopted"], **manifest.get("identity", {})}
    return [{"fact": k.replace("_", " "), "value": v} for k, v in facts.items()]


def safetensors_in(folder: str | Path) -> dict[str, Any]:
    """Every tensor of the safetensors files in `folder`."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def deepspeed_fp32(ckpt_dir: str | Path, tag: str) -> dict[str, Any]:
    """DeepSpeed's own fp32 reconstruction of checkpoint `tag` (its progress lines kept out of the notebook)."""
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag)


def max_difference(export_dir: str | Path, ckpt_dir: str | Path, tag: str) -> float:
    """The largest absolute difference between the exported weights and DeepSpeed's own fp32 reconstruction."""
    exported = safetensors_in(export_dir)
    reference = deepspeed_fp32(ckpt_dir, tag)
    assert set(exported) == set(reference), "the export and DeepSpeed name different tensors"
    return max(float((exported[k] - reference[k].detach()).abs().max()) for k in reference)


def card_facts(export_dir: str | Path) -> list[dict[str, str]]:
    """The model card's table, as rows."""
    lines = (Path(export_dir) / "README.md").read_text().splitlines()
    rows = [line.strip("|").split(" | ", 1) for line in lines if line.startswith("| ") and "---" not in line]
    return [{"fact": k.strip(), "value": v.strip()} for k, v in rows[1:]]


def trainer_log(ckpt: str | Path) -> list[dict[str, Any]]:
    """The losses `Trainer` logged into its checkpoint's trainer_state.json."""
    state = json.loads((Path(ckpt) / "trainer_state.json").read_text())
    return [{"step": e["step"], "loss": round(e["loss"], 4)} for e in state["log_history"] if "loss" in e]


def loop_losses(log: list[str], rank: int = 0) -> tuple[list[int], list[float]]:
    """The steps and losses one rank of the example loop printed (its own batch's loss)."""
    import re

    found = [re.search(rf"rank {rank}: step (\d+) loss ([\d.]+)", line) for line in log]
    return [int(m.group(1)) for m in found if m], [float(m.group(2)) for m in found if m]


def saved_model(run_dir: str | Path, tag: str) -> dict[str, Any]:
    """What `Trainer.save_model` wrote into `run_dir/final`: its files, and when it wrote weights, their dtype and
    their largest difference from DeepSpeed's fp32 masters of the last checkpoint rounded to that dtype."""
    final, ckpt = Path(run_dir) / "final", next(Path(run_dir).glob("checkpoint-*"))
    found: dict[str, Any] = {"files": sorted(p.name for p in final.iterdir()), "dtype": None, "difference": None}
    weights = safetensors_in(final)
    if weights:
        masters = deepspeed_fp32(ckpt, tag)
        dtype = next(iter(weights.values())).dtype
        found["dtype"] = str(dtype).removeprefix("torch.")
        found["difference"] = max(float((w.float() - masters[k].detach().to(dtype).float()).abs().max())
                                  for k, w in weights.items())
    return found
