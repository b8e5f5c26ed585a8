"""A training loop of your own, as a researcher writes it: a tiny Llama (grouped-query attention, an untied head)
trained with DeepSpeed ZeRO-3 alone: `--save deepspeed` (the default) and `--resume deepspeed` use no part of this
package.

    torchrun --nproc_per_node 2 -m zckpt_nb.examples.own_loop OUT [--steps 6] [--dtype bf16] [--save deepspeed]
        [--save_at K] [--resume [zckpt|deepspeed]] [--freeze_embeddings] [--exclude_frozen] [--lora] [--accumulation G]

`--save deepspeed` ends with DeepSpeed's own `engine.save_checkpoint(OUT)` on every rank (the rank-0 guard only around
the folder and `config.json`): a checkpoint without a manifest, which `python -m zckpt_nb adopt OUT` takes in.
`--save_at K` saves after step K and trains on (default: after the last step); `--save none` does not save.
`--resume deepspeed` continues from DeepSpeed's own `engine.load_checkpoint(OUT)` (the tag `latest` names).
`--save zckpt` saves through `zckpt_nb.save` (commit protocol, no tokenizer, no scheduler) and `--resume` (or
`--resume zckpt`) continues from `zckpt_nb.resume`. `--fail_preparing` hands `zckpt_nb.save` a tokenizer whose
`save_pretrained` raises on the folder's writer: every rank must report the same failed save, none may hang. `--lora`
trains peft's LoRA adapters (r=4) on the attention projections, the base weights frozen, and saves the run's
`adapter_config.json` beside the checkpoint, as `LoraConfig.save_pretrained` writes it.
"""

from __future__ import annotations

import argparse
import os

import zckpt_nb
from zckpt_nb.run import lifeline


class BrokenTokenizer:
    """A tokenizer whose save fails (a disk error, a bug in a user's class): only rank 0 ever calls it."""

    def save_pretrained(self, folder: str) -> None:
        raise RuntimeError(f"this tokenizer cannot be saved into {folder}")


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the attention projections


def lora_config() -> object:
    """peft's LoRA on the attention projections, rank 4."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def build(dtype: str, freeze_embeddings: bool = False, lora: bool = False, universal: bool = False,
          accumulation: int = 1) -> tuple[object, object, dict]:
    """The model built partitioned (HfDeepSpeedConfig alive before from_config), wrapped in peft's LoRA with `lora`,
    and its ZeRO-3 engine; `universal` sets DeepSpeed's load_universal (a resume on another world size),
    `accumulation` its gradient_accumulation_steps (each loop step is then one micro-batch)."""
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import HfDeepSpeedConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
                 "bf16": {"enabled": dtype == "bf16"}, "checkpoint": {"load_universal": universal}}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers reads it while building the model)
    model = AutoModelForCausalLM.from_config(config)
    model.get_input_embeddings().requires_grad_(not freeze_embeddings)
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())  # freezes every base weight
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config)
    return engine, config, ds_config


def main() -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="zckpt_nb.examples.own_loop")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--save", default="deepspeed", choices=["deepspeed", "zckpt", "none"])
    parser.add_argument("--save_at", type=int, help="save after this step and train on (default: after the last)")
    parser.add_argument("--resume", nargs="?", const="zckpt", choices=["zckpt", "deepspeed"])
    parser.add_argument("--fail_preparing", action="store_true")
    parser.add_argument("--freeze_embeddings", action="store_true")
    parser.add_argument("--exclude_frozen", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    engine, config, _ = build(args.dtype, args.freeze_embeddings, args.lora, accumulation=args.accumulation)
    rank, start = dist.get_rank(), 0
    if args.resume == "deepspeed":  # DeepSpeed alone: every rank reads its own files of the tag `latest` names
        start = engine.load_checkpoint(args.out, load_module_strict=not args.exclude_frozen)[1]["step"]
    elif args.resume:
        start = zckpt_nb.resume(engine, args.out, strict=not args.exclude_frozen)["step"]
    if args.resume:
        print(f"rank {rank}: resumed at step {start}", flush=True)

    def save(step: int) -> None:
        if args.save == "deepspeed":
            if rank == 0:  # only the folder and the config: the save itself is collective
                os.makedirs(args.out, exist_ok=True)
                config.save_pretrained(args.out)
                if args.lora:
                    engine.module.peft_config["default"].save_pretrained(args.out)  # adapter_config.json
            engine.save_checkpoint(args.out, client_state={"step": step},  # every rank
                                   exclude_frozen_parameters=args.exclude_frozen)
        elif args.save == "zckpt":
            tokenizer = BrokenTokenizer() if args.fail_preparing else None
            outcome = zckpt_nb.save(engine, args.out, step=step, tokenizer=tokenizer, client_state={"step": step})
            said = f"; {outcome.error}" if outcome.error else ""
            print(f"rank {rank}: save {outcome.tag}: committed {outcome.committed}{said}", flush=True)

    for step in range(start, args.steps):
        torch.manual_seed(1000 * step + rank)  # this rank's batch of this step
        ids = torch.randint(0, config.vocab_size, (2, 32))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        print(f"rank {rank}: step {step + 1} loss {loss.item()!r}\n", end="", flush=True)  # repr: exact; one write
        if step + 1 == args.save_at:
            save(step + 1)
    if args.save_at is None:
        save(args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    lifeline.leave(0)  # skip the teardown, where a gloo thread can abort a finished rank (see lifeline)
