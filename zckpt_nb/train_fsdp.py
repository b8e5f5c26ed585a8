"""The FSDP2 worker: the ZeRO-3 worker's optimisation (`train.py`) under PyTorch FSDP2, saving with DCP.

The same model, data order, AdamW, clipping and LR schedule (DeepSpeed's `WarmupDecayLR` driving `torch.optim.AdamW`),
so a checkpoint converted with `to-dcp` continues the same run. It resumes the newest DCP checkpoint in `--output_dir`
on any world size and saves one every `--save_every` steps (`dcp.save` of `get_state_dict`, the scheduler and train
state, committed by rank 0). `launch(..., worker="zckpt_nb.train_fsdp")`, with the ZeRO-3 worker's options; bf16
computes as FSDP2's `MixedPrecisionPolicy` does, over fp32 masters. CPU ranks (gloo).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt_nb import data
from zckpt_nb.convert.dcp import read_dcp
from zckpt_nb.convert.dcp_layout import TRAIN_STATE
from zckpt_nb.convert.verify import read_kind, verify_folder
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import DCP_KIND, committed_tags, tag_for, tag_step
from zckpt_nb.format.manifest import Manifest, commit, entries_under
from zckpt_nb.format.records import RankRecord, RunRecord, Schedule
from zckpt_nb.format.units import counted
from zckpt_nb.model import accumulation_steps, ds_config, get_preset, gpt2_config
from zckpt_nb.run import lifeline
from zckpt_nb.run.options import TrainOptions
from zckpt_nb.train import History, quiet_libraries, seed_everything, sum_over_ranks


@dataclass
class FsdpWorker:
    """The sharded model, its optimizer and scheduler, and where this run stands."""

    opts: TrainOptions
    rank: int
    world: int
    model: Any
    optimizer: Any
    scheduler: Any
    tokens: Any
    horizon: int
    dtype: str = "fp32"
    start: int = 0
    history: History = field(default_factory=History)


def build(opts: TrainOptions, rank: int, world: int, horizon: int) -> FsdpWorker:
    """The model sharded with fully_shard, AdamW and WarmupDecayLR as ds_config says."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    seed_everything(opts.seed)
    model = AutoModelForCausalLM.from_config(gpt2_config(opts.model))
    dtype = "bf16" if opts.dtype == "bf16" else "fp32"  # `auto` is fp32, as on the ZeRO-3 worker's CPU ranks
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16"
              else MixedPrecisionPolicy())
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    config = ds_config(opts.model, steps=horizon)
    hyper = {k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"}
    optimizer = torch.optim.AdamW(model.parameters(), **{**hyper, "betas": tuple(hyper["betas"])})
    scheduler = WarmupDecayLR(optimizer, **config["scheduler"]["params"])
    tokenizer = data.load_or_train_tokenizer("", get_preset(opts.model).vocab_size)  # deterministic: the same ids
    return FsdpWorker(opts, rank, world, model, optimizer, scheduler, data.encode_corpus(tokenizer), horizon, dtype)


def state_of(worker: FsdpWorker) -> dict[str, Any]:
    """The DCP state: model and optimizer as get_state_dict gives them, the scheduler and the train state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(worker.model, worker.optimizer)
    opts = worker.opts
    return {"model": model, "optimizer": optim, "lr_scheduler": worker.scheduler.state_dict(),
            "train_state": {"step": worker.start, "seed": opts.seed, "global_batch": opts.global_batch,
                            "world_size": worker.world, "steps": worker.horizon}}


def resume(worker: FsdpWorker, folder: Path) -> None:
    """Load a DCP checkpoint into the sharded model, AdamW and the scheduler (any world size)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = read_dcp(folder, state_of(worker), no_dist=False)  # verified, and no code run from its bytes
    set_state_dict(worker.model, worker.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    worker.scheduler.load_state_dict(state["lr_scheduler"])
    worker.start = state["train_state"]["step"]


def save(worker: FsdpWorker, step: int) -> None:
    """dcp.save into output_dir/global_stepN (every rank), then rank 0 commits it: manifest after DCP's .metadata."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    worker.start = step
    folder = Path(worker.opts.output_dir) / tag_for(step)
    dcp.save(state_of(worker), storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    if worker.rank == 0:  # DCP fsynced every file (sync_files)
        commit(folder, Manifest(folder.name, step, entries_under(folder), kind=DCP_KIND, source_world_size=worker.world,
                                identity={"model": worker.opts.model}), synced=True)
    dist.barrier()


def train_step(worker: FsdpWorker, batch: Any) -> float:
    """One optimizer step on this rank's share, weighted as the ZeRO-3 worker weights it; the mean loss."""
    import torch

    opts, preset = worker.opts, get_preset(worker.opts.model)
    share = data.rank_share(opts.global_batch, worker.world, worker.rank)
    gas, total = accumulation_steps(opts.global_batch, worker.world, preset.micro_batch), 0.0
    for part in data.micro_steps(share, gas):
        x = batch[list(part) or [0]]
        loss = worker.model(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
        # FSDP2 averages over ranks but, unlike DeepSpeed, does not divide by the accumulation steps
        (loss * (len(part) * worker.world / len(batch))).backward()
        total += loss.item() * len(part)
    torch.nn.utils.clip_grad_norm_(worker.model.parameters(), 1.0)
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)
    return sum_over_ranks(total, "cpu") / len(batch)


def loop(worker: FsdpWorker) -> None:
    """Train from the resumed step to --steps, saving every --save_every steps (and at the end if asked)."""
    opts, preset = worker.opts, get_preset(worker.opts.model)
    for step in range(worker.start, opts.steps):
        batch = data.global_batch_for_step(worker.tokens, step=step, seed=opts.seed, global_batch=opts.global_batch,
                                           seq_len=preset.seq_len)
        worker.history.steps.append(step)
        worker.history.lrs.append(worker.optimizer.param_groups[0]["lr"])
        worker.history.losses.append(train_step(worker, batch))
        if worker.rank == 0:
            print(f"step {step + 1}/{opts.steps} loss {worker.history.losses[-1]:.4f}", flush=True)
        done = step + 1
        if (opts.save_every and done % opts.save_every == 0) or (opts.save_checkpoint and done == opts.steps):
            save(worker, done)


def run_record(worker: FsdpWorker, resumed: int | None, seconds: float) -> RunRecord:
    """run.json: the ZeRO-3 worker's record, with what this worker knows."""
    opts, history = worker.opts, worker.history
    return RunRecord(world_size=worker.world, backend="gloo", device="cpu", model=opts.model,
                     num_params=sum(p.numel() for p in worker.model.parameters()),
                     vocab_size=get_preset(opts.model).vocab_size, steps=history.steps, losses=history.losses,
                     ranks=[RankRecord(rank) for rank in range(worker.world)], worker="fsdp2", lrs=history.lrs,
                     dtype=worker.dtype, seed=opts.seed, global_batch=opts.global_batch, resumed_from_step=resumed,
                     schedule=Schedule(worker.horizon), wall_seconds=seconds)


def train(opts: TrainOptions) -> None:
    """Join the process group, build, resume if asked, train with DCP saves, write run.json on rank 0."""
    import torch.distributed as dist

    quiet_libraries()
    start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder, saved = None, None
    if opts.resume:  # the newest committed DCP checkpoint (a to-dcp folder or this worker's save), verified first
        tags = [t for t in committed_tags(opts.output_dir) if read_kind(Path(opts.output_dir) / t) == DCP_KIND]
        if not tags:
            raise CheckpointError(f"no committed DCP checkpoint in {opts.output_dir}; convert one with "
                                  "python -m zckpt_nb to-dcp CKPT_DIR OUTPUT_DIR/global_stepN")
        folder = Path(opts.output_dir) / max(tags, key=tag_step)
        verify_folder(folder, DCP_KIND)  # every file's size and SHA-256, nothing unlisted; then its train state
        saved = read_dcp(folder, {"train_state": dict.fromkeys(TRAIN_STATE, 0)})["train_state"]
    # the checkpoint's batch and LR horizon, as the ZeRO-3 worker keeps them
    batch = (saved["global_batch"] if saved else opts.global_batch) or get_preset(opts.model).global_batch
    opts = TrainOptions.build(**{**opts.to_dict(), "global_batch": batch})
    worker = build(opts, rank, world, saved["steps"] if saved else opts.steps)
    if folder:
        resume(worker, folder)
        if rank == 0:
            print(f"resumed from {folder.name}: {worker.start} steps done, on {counted(world, 'rank')} "
                  f"(FSDP2, {worker.dtype})", flush=True)
    resumed = worker.start if folder else None
    loop(worker)
    if rank == 0:
        run_record(worker, resumed, time.perf_counter() - start).write(opts.output_dir)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Run the FSDP2 worker; a checkpoint that cannot be used ends it with one line, exit 1."""
    try:
        train(TrainOptions.parse(argv))
        lifeline.leave(0)  # as train.py: skip the teardown, where a gloo thread can abort a finished job
    except CheckpointError as e:
        print(f"zckpt_nb.train_fsdp: error: {e}", file=sys.stderr, flush=True)
        lifeline.leave(1)  # as above: no teardown after the line


if __name__ == "__main__":
    main()
