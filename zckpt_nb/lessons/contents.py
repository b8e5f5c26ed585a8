"""Notebook 03: what a ZeRO-3 checkpoint holds (bf16, frozen parameters, fine-tuning loads), read from the files and
from what `zckpt_nb.examples.checkpoint_contents` loaded back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import shard_paths, tensor_bytes
from zckpt_nb.convert.safeload import load
from zckpt_nb.format.layout import latest_name
from zckpt_nb.lessons.own_model import run_example
from zckpt_nb.model import meta_model
from zckpt_nb.plan.costs import predict

CONTENTS = "zckpt_nb.examples.checkpoint_contents"
FOLDERS = ("fp32", "bf16", "frozen", "frozen_excluded")
KINDS = ("fp32 weights (MiB)", "Adam moments (MiB)", "frozen weights (MiB)", "the rest (MiB)")


def run_contents(out: str | Path, *, nproc: int, model: str, steps: int, freeze: str, timeout: float) -> dict:
    """Run the example on `nproc` ranks into `out`; what each load brought back (its `loads.json`)."""
    run_example(CONTENTS, out, "--model", model, "--steps", str(steps), "--freeze", freeze, nproc=nproc,
                timeout=timeout)
    return json.loads((Path(out) / "loads.json").read_text())


def holdings(folder: str | Path) -> dict[str, int]:
    """Bytes of the newest checkpoint in `folder`, every rank's files summed, by what they hold."""
    tag_dir = Path(folder) / latest_name(folder)
    found = dict.fromkeys(KINDS, 0)
    for paths in shard_paths(tag_dir).values():
        optim = load(paths["optim"])["optimizer_state_dict"]
        frozen = load(paths["model"]).get("frozen_param_fragments") or {}
        found[KINDS[0]] += tensor_bytes(optim["fp32_flat_groups"])
        found[KINDS[1]] += tensor_bytes(optim["optimizer_state_dict"]["state"])
        found[KINDS[2]] += tensor_bytes(frozen)
        found[KINDS[3]] += sum(p.stat().st_size for p in paths.values())
    found[KINDS[3]] -= found[KINDS[0]] + found[KINDS[1]] + found[KINDS[2]]
    return found


def holdings_rows(root: str | Path) -> list[dict[str, Any]]:
    """One row per checkpoint of the run: its optimizer file's name, then MiB by what the files hold."""
    rows = []
    for name in FOLDERS:
        found = holdings(Path(root) / name)
        optim = next(p.name for p in (Path(root) / name / latest_name(Path(root) / name)).iterdir()
                     if "optim_states" in p.name and "rank_0_" in p.name)
        rows.append({"checkpoint": name, "rank 0's optimizer file": optim,
                     **{k: round(v / 2**20, 3) for k, v in found.items()},
                     "total (MiB)": round(sum(found.values()) / 2**20, 3)})
    return rows


def same_size(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two checkpoints' totals are within 1% of each other."""
    return abs(a["total (MiB)"] - b["total (MiB)"]) <= 0.01 * b["total (MiB)"]


def size_words(a: float, b: float) -> str:
    """How checkpoint size `a` compares with `b` (MiB to 0.001): the same size, within a given share of it, or a
    ratio."""
    if a == b:
        return "the same size, to 0.001 MiB, as"
    if abs(a - b) <= 0.01 * b:
        return f"within {max(abs(a - b) / b, 0.0001):.2%} of"
    return f"{a / b:.2f} times the size of"


def bf16_sentence(rows: list[dict[str, Any]], num_params: int, root: str | Path | None = None) -> str:
    """The bf16 checkpoint against the fp32 one: sizes and bytes per parameter of weights and moments (exact from the
    files under `root` when given, else from the rows' MiB, which are rounded to 0.001)."""
    fp32, bf16 = rows[0], rows[1]
    per = ({name: (f[KINDS[0]] + f[KINDS[1]]) / num_params for name, f in
            ((name, holdings(Path(root) / name)) for name in ("fp32", "bf16"))} if root else
           {r["checkpoint"]: (r[KINDS[0]] + r[KINDS[1]]) * 2**20 / num_params for r in (fp32, bf16)})
    same = size_words(bf16["total (MiB)"], fp32["total (MiB)"])
    return (f"The bf16 checkpoint ({bf16['total (MiB)']:.3f} MiB) is {same} the fp32 one ({fp32['total (MiB)']:.3f} "
            f"MiB): both "
            f"hold fp32 tensors only, {per['bf16']:.4f} bytes per parameter in the bf16 run and {per['fp32']:.4f} in "
            f"the fp32 run: the fp32 master "
            f"weights and Adam's two fp32 moments. The bf16 working copy the forward pass used is not saved at all "
            f"(`load_checkpoint` rebuilds it from the masters); DeepSpeed only renames the optimizer files "
            f"`bf16_zero_pp_rank_*`.")


def frozen_sentence(rows: list[dict[str, Any]], counts: dict[str, int]) -> str:
    """What `exclude_frozen_parameters=True` left out, from the files."""
    full, excluded = rows[2], rows[3]
    share = counts["frozen"] / (counts["frozen"] + counts["trainable"])
    return (f"With {counts['frozen']:,} of {counts['frozen'] + counts['trainable']:,} parameters frozen ({share:.0%}), "
            f"a plain `save_checkpoint` wrote {full['total (MiB)']:.3f} MiB, {full[KINDS[2]]:.3f} MiB of it the frozen "
            "weights "
            f"(each rank's slice, in its model-states file, with no Adam moments since they never train); "
            f"`exclude_frozen_parameters=True` wrote {excluded['total (MiB)']:.3f} MiB "
            f"({excluded['total (MiB)'] / full['total (MiB)']:.0%} of it), the frozen weights left out.")


WARM_START = "load_optimizer_states=False"  # the job's name for the load that also sets load_lr_scheduler_states=False
LOADS = ("frozen", "frozen_excluded", "full resume", WARM_START, "load_module_only=True")
PARTS = ("trainable weights", "frozen weights", "Adam's state", "LR schedule")


def load_label(name: str, sep: str = ", ") -> str:
    """A load's row label: the warm start names both switches it turns off (the LR's colour comes from the second)."""
    return sep.join((WARM_START, "load_lr_scheduler_states=False")) if name == WARM_START else name


def restored(loads: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """Per load, whether each part of the training state came back as saved (None: the model froze nothing)."""
    saved = loads["saved"]
    return {load_label(name, ",\n"): dict(zip(PARTS, (loads[name]["trainable_max_diff"] == 0,
                                   loads[name]["frozen_max_diff"] == 0 if name.startswith("frozen") else None,
                                   loads[name]["adam_step"] == saved["adam_step"], loads[name]["lr"] == saved["lr"])))
            for name in LOADS}


def optimizer_rows(loads: dict[str, Any]) -> list[dict[str, Any]]:
    """What each load set the optimizer and the scheduler to, against the run that saved; the frozen loads come from
    their own run, whose moments cover its trainable weights only, so their sums compare with each other alone."""
    own = " (its own run: moments of the trainable weights only)"
    return [{"load": "(the run that saved, fp32)" if name == "saved" else load_label(name) + own * name.startswith(
                 "frozen"),
             "engine.global_steps": loads[name]["global_steps"], "LR": f"{loads[name]['lr']:.4f}",
             "Adam's step": loads[name]["adam_step"], "sum of abs(exp_avg)": f"{loads[name]['exp_avg_abs_sum']:.3f}"}
            for name in ("saved", *LOADS)]


def back(diff: float) -> str:
    """A weight difference after a load, in words."""
    return "came back exactly" if diff == 0 else f"did not come back (largest difference {diff:.3f})"


def excluded_sentence(loads: dict[str, Any]) -> str:
    """How the checkpoint saved without its frozen weights loads, strictly and not."""
    error = loads["frozen_excluded"]["strict_load_error"]
    strict = f"fails on every rank: `{error}`" if error else "works"
    return (f"Loading the excluded checkpoint as DeepSpeed does by default (`load_module_strict=True`) {strict}. "
            f"With `load_module_strict=False` the trainable weights "
            f"{back(loads['frozen_excluded']['trainable_max_diff'])} and the frozen ones "
            f"{back(loads['frozen_excluded']['frozen_max_diff'])}"
            + (": they are whatever the model was built with, so they must come from elsewhere (the base model the "
               "fine-tuning started from)" if loads["frozen_excluded"]["frozen_max_diff"] else "")
            + ". The default save's "
            f"frozen weights {back(loads['frozen']['frozen_max_diff'])}.")


def fine_tune_sentence(loads: dict[str, Any]) -> str:
    """What the two fine-tuning loads restore, against a full resume."""
    no_opt, module_only, full = (loads[k] for k in (WARM_START, "load_module_only=True",
                                                    "full resume"))
    return (f"A full resume restores the weights, Adam's step ({full['adam_step']}) and moments and the LR "
            f"({full['lr']:.4f}). With `load_optimizer_states=False, load_lr_scheduler_states=False` the weights "
            f"{back(no_opt['trainable_max_diff'])}, while Adam starts fresh (step {no_opt['adam_step']}, moments "
            f"{no_opt['exp_avg_abs_sum']:.3f}) and so does the LR schedule (LR {no_opt['lr']:.4f}); "
            f"`engine.global_steps` still says {no_opt['global_steps']}. With `load_module_only=True` the weights "
            f"{back(module_only['trainable_max_diff'])}"
            + (": under ZeRO-3 the module file holds no weights, only placeholders, so this warm start silently "
               "keeps the new model's own init." if module_only["trainable_max_diff"] else "."))


def frozen_numel(model: str, rule: Callable[[str, int], bool]) -> int:
    """Parameters of preset `model` that `rule(name, n_layer)` freezes, counted on the meta device."""
    module = meta_model(model)
    return sum(p.numel() for name, p in module.named_parameters() if rule(name, module.config.n_layer))


def freeze_answer(rows: list[dict[str, Any]], loads: dict[str, Any], freeze: str,
                  rules: dict[str, Callable[[str, int], bool]], model: str, default: str = "all_but_last_block") -> str:
    """Exercise 1: what this run's `freeze` froze and what excluding it saved, against the default's frozen share
    (counted from the config) and the bytes its frozen weights take (4 per parameter, fp32)."""
    full, excluded = rows[2], rows[3]
    p = loads["counts"]["frozen"] + loads["counts"]["trainable"]
    strict = "failed" if loads["frozen_excluded"]["strict_load_error"] else "worked"
    text = (f"`FREEZE = \"{freeze}\"` froze {loads['counts']['frozen']:,} of {p:,} parameters "
            f"({loads['counts']['frozen'] / p:.0%}): `exclude_frozen_parameters=True` wrote "
            f"{excluded['total (MiB)']:.3f} MiB, {excluded['total (MiB)'] / full['total (MiB)']:.0%} of the "
            f"{full['total (MiB)']:.3f} MiB the save with them wrote, and the strict load of it {strict}.")
    if freeze == default:
        other = frozen_numel(model, rules["embeddings"])
        fails = ("and its strict load would fail as this one did: the frozen weights' keys are not in its files"
                 if strict == "failed" else "and its strict load would work as this one did")
        # a frozen weight loses its master copy and both moments (12 B) and keeps 4 B in the model states
        with_them = rows[0]["total (MiB)"] - 8 * other / 2**20
        return (f"{text} That is the default `FREEZE`. With `FREEZE = \"embeddings\"` {other:,} parameters "
                f"({other / p:.0%}) would be frozen, {4 * other / 2**20:.3f} MiB of fp32 weights that "
                "`exclude_frozen_parameters=True` leaves out of every save: of the about "
                f"{with_them:.3f} MiB a save with them would write, about {1 - 4 * other / 2**20 / with_them:.0%} "
                f"would be left, {fails}. Set it and run again to measure it.")
    other = frozen_numel(model, rules[default])
    return (f"{text} The default `FREEZE = \"{default}\"` freezes {other:,} ({other / p:.0%}): its frozen weights "
            f"take about {4 * other / 2**20:.3f} MiB of every save (4 bytes each), against "
            f"{full[KINDS[2]]:.3f} MiB here: excluding them drops "
            + ("as much as" if loads["counts"]["frozen"] == other else
               "less than" if loads["counts"]["frozen"] < other else "more than") + " it does by default.")


def nproc_answer(root: str | Path, num_params: int, nproc: int, model: str, default: int = 2) -> str:
    """Exercise 2: the bf16 and fp32 checkpoints of the run in `root` at this N, bytes per parameter and padding,
    against the default N (the cost model's padding, exact to the element in notebook 01)."""
    found = {name: holdings(Path(root) / name) for name in ("fp32", "bf16")}
    total = {name: sum(f.values()) for name, f in found.items()}
    per = {name: (f[KINDS[0]] + f[KINDS[1]]) / num_params for name, f in found.items()}
    here, base = predict(model, nproc), predict(model, default)
    gap = total["bf16"] - total["fp32"]
    mib = {name: f"{t / 2**20:.3f}" for name, t in total.items()}
    same = ("exactly the size of" if not gap else f"{abs(gap):,} bytes {'larger' if gap > 0 else 'smaller'} than"
            if abs(gap) <= 0.01 * total["fp32"] else size_words(total["bf16"], total["fp32"]))
    to_mib = ", the same size to 0.001 MiB" if gap and mib["bf16"] == mib["fp32"] else ""
    held = (f"Both hold {per['fp32']:.4f} bytes of weights and moments per parameter"
            if f"{per['bf16']:.4f}" == f"{per['fp32']:.4f}" else
            f"The bf16 one holds {per['bf16']:.4f} bytes of weights and moments per parameter, the fp32 one "
            f"{per['fp32']:.4f}")
    expected = (f"with no padding at N = {nproc} (the cost model's count), that is 12 bytes per parameter, a master "
                "weight and two moments of 4 bytes each" if not here.padding_numel else
                f"12 bytes for each of the P parameters and each of the {here.padding_numel:,} padding elements "
                f"(the cost model's at N = {nproc}) give {12 * (num_params + here.padding_numel) / num_params:.4f}")
    text = (f"At N = {nproc} the bf16 checkpoint ({mib['bf16']} MiB) is {same} the fp32 one ({mib['fp32']} MiB)"
            f"{to_mib}. {held}: {expected}.")
    if nproc == default:
        three = predict(model, 3).padding_numel
        return (f"{text} That is the default `NPROC`. At N = 3 the cost model gives {three:,} padding elements, so "
                f"{12 * (num_params + three) / num_params:.4f} bytes per parameter in either dtype: set `NPROC = 3` "
                "and run again to measure it.")
    dtype = "changed nothing" if f"{per['bf16']:.4f}" == f"{per['fp32']:.4f}" else "changed them too"
    return (f"{text} At the default N = {default} the cost model gives {base.padding_numel:,} padding elements, so "
            f"{12 * (num_params + base.padding_numel) / num_params:.4f} bytes per parameter: N changed the bytes per "
            f"parameter through its padding alone, and the training dtype {dtype}."
            if here.padding_numel != base.padding_numel else
            f"{text} At the default N = {default} the padding is the same, so are the bytes per parameter.")


def summary_lines(rows: list[dict[str, Any]], loads: dict[str, Any]) -> list[str]:
    """The lesson in three short lines, each pointing back to the section that measured it."""
    fp32, bf16 = rows[:2]
    strict = "fails" if loads["frozen_excluded"]["strict_load_error"] else "works"
    module_only = loads["load_module_only=True"]["trainable_max_diff"] == 0
    warm = loads[WARM_START]["trainable_max_diff"] == 0
    return [
        ("A bf16 checkpoint is the optimizer's fp32 state under another file name, about as large as the fp32 one"
         if same_size(bf16, fp32) else "The bf16 checkpoint's size differs from the fp32 one's") + " (section 1).",
        "Frozen weights go into every save unless `exclude_frozen_parameters=True` leaves them out, and a strict load "
        f"of what it wrote {strict} (section 2).",
        "To warm-start, `load_optimizer_states=False, load_lr_scheduler_states=False` "
        + ("restored the weights exactly" if warm else "did not restore the weights")
        + "; `load_module_only=True` " + ("did too" if module_only else "did not, under ZeRO-3") + " (section 3).",
    ]
