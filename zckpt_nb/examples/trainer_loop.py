"""Hugging Face `Trainer` with a DeepSpeed ZeRO-3 config, on CPU ranks: a tiny Qwen2 in bf16, a checkpoint every
`--save_steps`, no part of this package involved.

    torchrun --nproc_per_node 2 -m zckpt_nb.examples.trainer_loop OUT [--steps 4] [--save_steps N] [--gather_16bit]
    torchrun --nproc_per_node 2 -m zckpt_nb.examples.trainer_loop OUT2 --steps 6 --resume OUT/checkpoint-4

What `Trainer` writes under ZeRO-3: `OUT/checkpoint-N/` holding DeepSpeed's `global_stepN/` (every rank's files),
`latest`, `zero_to_fp32.py`, `config.json`, `trainer_state.json`, `training_args.bin` and each rank's RNG state;
`save_model` at the end writes the model's weights only with `stage3_gather_16bit_weights_on_model_save` on
(`--gather_16bit`), and otherwise only its config. The DeepSpeed config sets no `train_batch_size`: on CPU ranks
`Trainer`'s batch check refuses the one it computes ("train_batch_size is not equal to micro_batch_per_gpu *
gradient_acc_step * world_size"), while `"auto"` micro-batch and accumulation values pass. `--resume CKPT` continues
from `Trainer`'s checkpoint folder with `trainer.train(resume_from_checkpoint=CKPT)` (and skips `save_model`).
"""

from __future__ import annotations

import argparse
import os
import sys


class RandomTokens:
    """A dataset of fixed random token sequences (its own labels): enough for a loss to fall."""

    def __init__(self, vocab: int, rows: int = 64, length: int = 32) -> None:
        import torch

        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config, Trainer, TrainingArguments

    parser = argparse.ArgumentParser(prog="zckpt_nb.examples.trainer_loop")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_steps", type=int, default=None)  # a checkpoint every N steps (default: at the end)
    parser.add_argument("--resume", default=None)  # a checkpoint-N folder to continue from
    parser.add_argument("--gather_16bit", action="store_true")
    args = parser.parse_args()
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "bf16": {"enabled": "auto"},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "stage3_gather_16bit_weights_on_model_save": args.gather_16bit}}
    training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=2, max_steps=args.steps,
                                 save_steps=args.save_steps or args.steps, logging_steps=1, learning_rate=3e-3,
                                 bf16=True, deepspeed=ds_config, report_to=[], save_only_model=False, use_cpu=True,
                                 dataloader_num_workers=0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)  # TrainingArguments made ZeRO-3 known to transformers first
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(config.vocab_size))
    trainer.train(resume_from_checkpoint=args.resume)
    if args.resume is None:
        trainer.save_model(f"{args.out}/final")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank
