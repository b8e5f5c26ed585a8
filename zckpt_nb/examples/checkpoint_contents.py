"""What a ZeRO-3 checkpoint holds, one job on every rank with DeepSpeed's own calls (notebook 03).

    torchrun --nproc_per_node 2 -m zckpt_nb.examples.checkpoint_contents OUT [--model tiny] [--steps 2] \
        [--freeze all_but_last_block]

Writes OUT/fp32 and OUT/bf16 (the same steps in each dtype), OUT/frozen and OUT/frozen_excluded (part of the model
frozen, saved without and with `exclude_frozen_parameters=True`), then builds fresh engines from another seed and
loads: the excluded checkpoint, and OUT/fp32 for fine-tuning (`load_optimizer_states=False`, `load_module_only=True`).
Rank 0 writes what each load brought back to OUT/loads.json.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from zckpt_nb.run import lifeline

FREEZE = {"all_but_last_block": lambda name, layers: not name.startswith(f"transformer.h.{layers - 1}."),
          "embeddings": lambda name, layers: name.startswith(("transformer.wte", "transformer.wpe")),
          "nothing": lambda name, layers: False}


def build(model: str, steps: int, dtype: str = "fp32", freeze: str = "nothing", seed: int = 0) -> tuple[Any, Any]:
    """A ZeRO-3 engine of preset `model` (HfDeepSpeedConfig alive before from_config), `freeze`'s weights frozen."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from zckpt_nb.model import build_model, ds_config, get_preset

    world = dist.get_world_size()
    config = ds_config(model, steps=steps, world_size=world, global_batch=get_preset(model).micro_batch * world,
                       bf16=dtype == "bf16")
    torch.manual_seed(seed)  # the weights' init: another seed stands for "a model built elsewhere"
    module, keep = build_model(model, config)
    for name, p in module.named_parameters():
        p.requires_grad_(not FREEZE[freeze](name, module.config.n_layer))
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=config)
    engine.keep = keep  # transformers reads the HfDeepSpeedConfig for as long as the model lives
    return engine, module


def train(engine: Any, steps: int, start: int = 0) -> None:
    """`steps - start` optimizer steps on this rank's random token windows (a function of the step and rank)."""
    import torch
    import torch.distributed as dist

    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        ids = torch.randint(0, engine.module.config.vocab_size, (engine.train_micro_batch_size_per_gpu(), 32),
                            generator=g).to(engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def weights(module: Any) -> dict[str, Any]:
    """Every parameter gathered whole (a collective: every rank calls it), as fp32 copies."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def compare(before: dict[str, Any], module: Any, frozen: str) -> dict[str, float]:
    """Largest difference of the frozen and of the trainable weights against `before` (the saved ones)."""
    after = weights(module)
    layers = module.config.n_layer
    diff = {True: 0.0, False: 0.0}
    for name, t in after.items():
        is_frozen = FREEZE[frozen](name, layers)
        diff[is_frozen] = max(diff[is_frozen], (t - before[name]).abs().max().item())
    return {"frozen_max_diff": diff[True], "trainable_max_diff": diff[False]}


def optimizer_facts(engine: Any) -> dict[str, Any]:
    """Step counter, learning rate and this rank's Adam moments (0 when the optimizer never stepped)."""
    state = [s for s in engine.optimizer.optimizer.state.values() if "exp_avg" in s]
    return {"global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "adam_step": int(state[0]["step"]) if state else 0,
            "exp_avg_abs_sum": sum(s["exp_avg"].abs().sum().item() for s in state)}


def strict_load_error(engine: Any, folder: str) -> str | None:
    """Load `folder` as DeepSpeed does by default (`load_module_strict=True`): None, or the error's first line."""
    try:
        engine.load_checkpoint(folder)
    except RuntimeError as e:  # the same on every rank: each reads its own files before any collective
        first, keys = (line.strip() for line in str(e).strip().splitlines()[:2])
        if len(keys) > 90:
            whole = keys[:90].rfind('", ')  # cut after the last whole missing key
            keys = keys[:whole + 1] + ", ..." if whole > 0 else keys[:90] + "..."
        return f"{first} {keys}"
    return None


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="zckpt_nb.examples.checkpoint_contents")
    parser.add_argument("out")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--freeze", default="all_but_last_block", choices=list(FREEZE))
    args = parser.parse_args()
    deepspeed.init_distributed()  # the accelerator's backend: gloo on CPU ranks, nccl on GPUs
    out, steps, loads = args.out, args.steps, {}
    if dist.get_rank() == 0:  # only the folders: every save below is collective
        os.makedirs(out, exist_ok=True)
    for dtype in ("fp32", "bf16"):
        engine, module = build(args.model, steps, dtype)
        train(engine, steps)
        engine.save_checkpoint(f"{out}/{dtype}", client_state={"step": steps})
        if dtype == "fp32":
            saved, loads["saved"] = weights(module), optimizer_facts(engine)
    engine, module = build(args.model, steps, freeze=args.freeze)
    train(engine, steps)
    frozen_saved = weights(module)
    loads["counts"] = {"frozen": sum(p.ds_numel for p in module.parameters() if not p.requires_grad),
                       "trainable": sum(p.ds_numel for p in module.parameters() if p.requires_grad)}
    engine.save_checkpoint(f"{out}/frozen")
    engine.save_checkpoint(f"{out}/frozen_excluded", exclude_frozen_parameters=True)
    for name in ("frozen", "frozen_excluded"):  # a model built from another seed: what do the files bring back?
        engine, module = build(args.model, steps, freeze=args.freeze, seed=1)
        loads[name] = {"strict_load_error": strict_load_error(engine, f"{out}/{name}")}
        engine.load_checkpoint(f"{out}/{name}", load_module_strict=False)
        loads[name] |= compare(frozen_saved, module, args.freeze) | optimizer_facts(engine)
    fine_tune = {"load_optimizer_states=False": {"load_optimizer_states": False, "load_lr_scheduler_states": False},
                 "load_module_only=True": {"load_module_only": True}, "full resume": {}}
    for name, kwargs in fine_tune.items():
        engine, module = build(args.model, steps, seed=1)
        engine.load_checkpoint(f"{out}/fp32", **kwargs)
        loads[name] = compare(saved, module, "nothing") | optimizer_facts(engine)
    if dist.get_rank() == 0:
        with open(f"{out}/loads.json", "w") as f:
            json.dump(loads, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    lifeline.leave(0)  # skip the teardown, where a gloo thread can abort a finished rank (see lifeline)
