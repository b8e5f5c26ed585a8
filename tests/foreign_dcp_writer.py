"""DCP checkpoints of a tiny Llama written with plain PyTorch under FSDP2, as a researcher's loop writes them: no
part of zckpt_nb here. `torchrun --nproc_per_node 2 tests/foreign_dcp_writer.py OUT` (gloo, CPU) writes

- OUT/nested/global_step3: {"model", "optim"} as get_state_dict gives them;
- OUT/flat/ckpt: {"model", "optimizer"} with flatten_optimizer_state_dict=True (no step in the name);
- OUT/titan/step-3: torchtitan's layout (the model's keys at top level, a flattened "optimizer", "lr_scheduler",
  "dataloader", "train_state" with a tensor step and a BytesIO that must never be unpickled);
- OUT/titan_final/step-3: torchtitan's model-only last save (the model's keys alone);
- OUT/config/config.json and OUT/reference.pt (rank 0: the full weights and optimizer state, by parameter FQN).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

STEPS = 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, LlamaConfig]:
    """The tiny Llama sharded with fully_shard (each decoder layer, then the root), AdamW and a warmup schedule."""
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 10))
    return model, optim, scheduler, config


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
          vocab: int) -> None:
    """STEPS AdamW steps on this rank's random batches."""
    for step in range(STEPS):
        torch.manual_seed(1000 * step + dist.get_rank())
        ids = torch.randint(0, vocab, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        scheduler.step()
        optim.zero_grad(set_to_none=True)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    model, optim, scheduler, config = build()
    train(model, optim, scheduler, config.vocab_size)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "nested" / f"global_step{STEPS}")
    msd, flat = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optimizer": flat}, checkpoint_id=out / "flat" / "ckpt")
    losses = io.BytesIO()
    torch.save([1.0, 2.0], losses)
    titan = {**msd, "optimizer": flat, "lr_scheduler": scheduler.state_dict(),
             "dataloader": {f"dp_rank_{dist.get_rank()}": b"sampler position"},
             "train_state": {"step": torch.tensor(STEPS, dtype=torch.int32), "ntokens_seen": torch.tensor(96),
                             "global_avg_losses": losses}}
    dcp.save(titan, checkpoint_id=out / "titan" / f"step-{STEPS}")
    dcp.save(dict(msd), checkpoint_id=out / "titan_final" / f"step-{STEPS}")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=full)
    if dist.get_rank() == 0:
        config.save_pretrained(out / "config")
        torch.save({"model": msd, "optim": osd, "lr": optim.param_groups[0]["lr"]}, out / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter's teardown: there a gloo thread can, rarely, abort a finished rank (SIGABRT)
