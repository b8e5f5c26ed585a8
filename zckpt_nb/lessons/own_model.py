"""Notebook 08: a model and a training loop of your own (a raw DeepSpeed loop, Hugging Face `Trainer`), through
adopt, inspect, export, generate and reshard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import MANIFEST, RANK_FILE
from zckpt_nb.run.launch import launch_module

OWN_LOOP, TRAINER_LOOP = "zckpt_nb.examples.own_loop", "zckpt_nb.examples.trainer_loop"
DEFAULT_NPROC, DEFAULT_DROP = 2, (-1, "optim_states")  # notebook 08's defaults, which its answers compare against
EXERCISE_DROP = (0, "model_states")  # notebook 08's exercise 2
EXERCISE_NPROC = 3  # exercise 1's world size, which the answer gives at the default too


def run_example(module: str, out: str | Path, *args: str, nproc: int = 2, timeout: float = 600) -> list[str]:
    """One of `zckpt_nb.examples` on `nproc` CPU ranks under torchrun; the lines its ranks printed."""
    log, _ = launch_module(module, [str(out), *args], nproc=nproc, timeout=timeout, name=module.rsplit(".")[-1],
                           verbose=False, progress=False)
    return log


def rank_lines(log: list[str], word: str) -> list[str]:
    """The lines of `log` the ranks printed that contain `word`, a rank's own "rank N: " after torchrun's "[rank N]"
    dropped so the rank is named once."""
    return [re.sub(r"^(\[rank ?(\d+)\]:?) rank \2: ", r"\1 ", line)
            for line in log if line.startswith("[rank") and word in line]


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


def adopted_rows(manifest: Any) -> list[dict[str, Any]]:
    """What `adopt` read from the files, one row per fact."""
    facts = {**manifest.adopted, **(manifest.identity or {})}
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


def partition_answer(ckpt_dir: str | Path, nproc: int, default: int = DEFAULT_NPROC) -> str:
    """Each rank's partition of a checkpoint as `inspect` measures it, against the config alone's prediction and
    the default world size's."""
    from zckpt_nb.convert.inspect import inspect_checkpoint
    from zckpt_nb.format.sizes import slice_numel
    from zckpt_nb.model import meta_model

    numels = tuple(p.numel() for p in meta_model(str(Path(ckpt_dir) / "config.json")).parameters())
    measured = {r.partition_numel for r in inspect_checkpoint(ckpt_dir).ranks}
    predicted = slice_numel(numels, nproc)
    other = EXERCISE_NPROC if nproc == default else default
    than = ("" if other == nproc else f" (on {other} ranks, {'the exercise' if nproc == default else 'the default'}: "
            f"{slice_numel(numels, other):,} each)")
    return (f"On {nproc} ranks, every tensor padded to a multiple of {nproc} and split, each rank owns "
            f"{predicted:,} of the {sum(numels):,} parameter elements by the config alone{than}; `inspect` measured "
            + (f"{predicted:,} on every rank: equal." if measured == {predicted} else
               f"{', '.join(f'{m:,}' for m in sorted(measured))}: they differ."))


def drop_rank_file(ckpt_dir: str | Path, copy_dir: str | Path, tag: str, rank: int, kind: str) -> Path:
    """A copy of a checkpoint (its manifest left out) without one rank's `kind` file ("model_states" or
    "optim_states"; rank -1: the last); the copy."""
    import shutil

    from zckpt_nb.errors import UsageError

    if kind not in ("model_states", "optim_states"):
        raise UsageError(f"DROP_FILE must be 'model_states' or 'optim_states', not {kind!r}")
    shutil.copytree(ckpt_dir, copy_dir, ignore=shutil.ignore_patterns(MANIFEST))
    files = {int(m.group(1)): p for p in (Path(copy_dir) / tag).glob(f"*{kind}.pt")
             if (m := RANK_FILE.search(p.name))}
    if not files:
        raise UsageError(f"{ckpt_dir}/{tag} holds no {kind} files to drop")
    files[sorted(files)[rank]].unlink()
    return Path(copy_dir)


def refusal(ckpt_dir: str | Path) -> str:
    """What `adopt` says about a checkpoint: its one-line refusal, or that it committed it."""
    from zckpt_nb.convert.adopt import adopt
    from zckpt_nb.errors import CheckpointError

    try:
        adopt(ckpt_dir)
    except CheckpointError as e:
        return f"adopt refused it: {e}"
    return "adopt found it whole and committed it"


def drop_answer(ckpt_dir: str | Path, work: str | Path, tag: str, rank: int, kind: str) -> str:
    """Exercise: what `adopt` names when rank `rank`'s `kind` file is gone, and whether it can still tell the world
    size (it reads it from rank 0's model states), against the default drop's refusal (made here on a copy)."""
    import shutil

    from zckpt_nb.convert.inspect import inspect_checkpoint

    world = inspect_checkpoint(ckpt_dir).world_size

    def said(r: int, k: str, name: str) -> tuple[str, bool]:
        shutil.rmtree(Path(work) / name, ignore_errors=True)  # a copy an earlier call made
        text = refusal(drop_rank_file(ckpt_dir, Path(work) / name, tag, r, k))
        return f"rank {r % world}'s {k.replace('_', ' ')}", "record" in text

    mine, known = said(rank, kind, "answer_drop")
    at_default = (rank % world, kind) == (DEFAULT_DROP[0] % world, DEFAULT_DROP[1])
    other, other_known = said(*(EXERCISE_DROP if at_default else DEFAULT_DROP), "answer_other_drop")
    count = (f"and still tells the world size ({world} ranks), read from rank 0's model states" if known else
             "and cannot tell how many ranks the checkpoint had: it reads the world size from rank 0's model states, "
             "the very file that is gone, so it names only that file")
    label = "the exercise's drop" if at_default else "the default drop"
    return (f"With {mine} gone, adopt refuses and names {mine} as missing, {count}. With {label} ({other}) it "
            f"names that file {'and' if other_known else 'but not'} the world size"
            + ("." if other_known else ": the world size is read from the file that is gone."))


def save_model_fallback() -> str:
    """The lines of transformers' `Trainer.save_model` that run when ZeRO-3 has no 16-bit weights to gather."""
    import inspect
    import textwrap

    from transformers import Trainer

    lines = inspect.getsource(Trainer.save_model).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("except ValueError"))
    end = next(i for i, line in enumerate(lines) if "save_checkpoint(output_dir)" in line)
    return textwrap.dedent("\n".join(lines[start:end + 1]))
