"""The training worker: one process per rank, started by `zckpt_nb.launch` through torchrun.

Read it top to bottom: arguments, distributed set-up, tokenizer and data, the ZeRO-3 engine,
an optional resume, the training loop with periodic partitioned saves, then `run.json`.
Run by hand with: torchrun --nproc_per_node 2 -m zckpt_nb.train --steps 50 --output_dir out
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import warnings
from contextlib import suppress
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb import (
    async_save,
    checkpoint,
    commit,
    consolidate,
    engines,
    lifeline,
    measure,
    nodes,
    patterns,
    reshard,
    rotation,
    schedule,
    verify,
)
from zckpt_nb.model import (
    PRESETS,
    build_model,
    build_model_bare,
    count_params,
    ds_config,
    get_preset,
    gpt2_config,
    held_elements,
    param_count,
    state_dict_placeholders,
)


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags the worker understands; the `train` CLI adds launcher flags on top of these."""
    parser.add_argument("--steps", type=int, default=150, help="train until this step count")
    parser.add_argument("--output_dir", required=True, help="where checkpoints and run.json go")
    parser.add_argument("--save_checkpoint", action="store_true", help="save a partitioned checkpoint at the end")
    parser.add_argument("--save_every", type=int, default=0, help="also save every K steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint 'latest' names")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new_schedule", action="store_true",
                        help="with --resume and another --steps: decay the LR over the new --steps (default: keep the "
                             "checkpoint's schedule, whose LR is 0 past its horizon); either way one line says so")
    parser.add_argument("--reshard", default="auto", choices=["auto", "never"],
                        help="auto: a checkpoint of another world size is converted (zckpt_nb.reshard) and loaded "
                             "universally; never: hand it to DeepSpeed's own loader as it is (notebook 07's trap)")
    parser.add_argument("--global_batch", type=int, default=0,
                        help="sequences per optimizer step, shared by all ranks (0: the preset's); a resume keeps "
                             "the checkpoint's, on any number of ranks")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="auto: bf16 on GPUs, fp32 on CPU ranks")
    parser.add_argument("--keep_last", type=int, default=0,
                        help="after each committed save keep only the newest K checkpoints (0: keep all)")
    parser.add_argument("--on_save_error", default="continue", choices=["continue", "abort"],
                        help="a failed save: record it in run.json and train on, or stop every rank (exit 1)")
    parser.add_argument("--collective_timeout", type=float, default=None,
                        help="seconds a collective may wait for the other ranks "
                             "(default: $ZCKPT_COLLECTIVE_TIMEOUT, else 600)")
    parser.add_argument("--save_mode", default="commit",
                        choices=["commit", "async", "plain", "rank0_only", *engines.WRITERS],
                        help="commit: the commit protocol; async: snapshot, then write and commit in the "
                             "background (zckpt_nb.async_save); plain: DeepSpeed's save alone (benchmark baseline); "
                             "rank0_only: the seed's hanging snippet (notebook 06); ds_python, ds_decoupled, ds_fast: "
                             "DeepSpeed's own checkpoint engines, no manifest or commit (zckpt_nb.engines)")
    parser.add_argument("--save_16bit", action="store_true",
                        help="after training, save DIR/gathered16/ with engine.save_16bit_model (route 1)")
    parser.add_argument("--save_gathered", action="store_true",
                        help="after training, save DIR/per_param/ gathering one parameter at a time (route 2)")
    parser.add_argument("--persistence_threshold", type=int, default=0,
                        help="DeepSpeed's stage3_param_persistence_threshold: tensors of at most this many elements "
                             "stay whole on every rank (0: every tensor is partitioned; DeepSpeed's default is 1e5)")
    parser.add_argument("--gather_16bit", default="auto", choices=["auto", "on", "off"],
                        help="stage3_gather_16bit_weights_on_model_save (auto: on with --save_16bit); with off, "
                             "save_16bit_model saves nothing")
    parser.add_argument("--init", default="hf", choices=["hf", "bare_zero_init"],
                        help="hf: HfDeepSpeedConfig before from_config (correct); bare_zero_init: the trap that "
                             "leaves weights uninitialised (notebook 02)")
    parser.add_argument("--node_local_storage", action="store_true",
                        help="each node keeps its part of every checkpoint in its own --output_dir (DeepSpeed's "
                             "checkpoint.use_node_local_storage); without it every node must see one shared folder")
    parser.add_argument("--save_reference", action="store_true",
                        help="after training, write each rank's raw partitions and the engine's logits on a "
                             "fixed batch to DIR/reference/ (what the equality checks compare against)")
    return parser


def collective_timeout(flag: float | None) -> float:
    """Seconds a collective may wait: --collective_timeout, else $ZCKPT_COLLECTIVE_TIMEOUT, else 600."""
    return flag if flag is not None else float(os.environ.get("ZCKPT_COLLECTIVE_TIMEOUT", 600))


def setup_distributed(timeout_s: float) -> tuple[str, str]:
    """Join the process group: NCCL with one GPU per rank, else gloo on CPU ranks. Returns (backend, device)."""
    import deepspeed
    import torch

    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        skip_shm_op()
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    return backend, (f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu")


def skip_shm_op() -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, so no rank JIT-builds or loads it.

    The op serves only `inference_all_reduce`, which training never calls. Loading it takes torch's extension
    file lock (~/.cache/torch_extensions/.../lock) on every start; a rank killed while holding it (a timeout, an
    interrupted kernel, a kill -9 test) leaves the lock behind and every later job on the machine waits forever.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every rank builds the same initial model."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_bytes(device: str) -> int:
    """This rank's peak memory: allocated GPU memory on GPUs, the process's max RSS on CPU."""
    if device.startswith("cuda"):
        return measure.device_peak_bytes()
    return measure.host_peak_bytes()


def sum_over_ranks(value: float, device: str) -> float:
    """`value` summed over ranks, identical on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def train_step(engine: Any, batch: Any, share: range, world: int, device: str) -> float:
    """One optimizer step on this rank's `share` of the global `batch`; returns the global batch's mean loss.

    DeepSpeed divides each micro-step's loss by the accumulation steps and averages gradients over the ranks; the
    weight below turns that into the mean over the global batch however it is split, so the optimisation does not
    depend on the world size. A rank with no sample in a micro-step runs one with weight 0: it still has to join
    ZeRO-3's gathers and reductions.
    """
    import torch

    from zckpt_nb import data

    gas, total = engine.gradient_accumulation_steps(), 0.0
    for part in data.micro_steps(share, gas):
        x = batch[list(part) or [0]].to(device)
        loss = engine(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
        engine.backward(loss * (len(part) * world * gas / len(batch)))
        engine.step()
        total += loss.item() * len(part)
    return sum_over_ranks(total, device) / len(batch)


def gather_rank_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Collect one small dict from every rank onto every rank (for run.json)."""
    import torch.distributed as dist

    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def save(args: argparse.Namespace, engine: Any, tokenizer: Any, step: int, identity: dict[str, Any],
         saver: async_save.AsyncSaver | None) -> Any:
    """One save in the pattern --save_mode names; returns its `commit.SaveOutcome` (in flight for async)."""
    state = checkpoint.client_state(step, args.seed, args.global_batch, engine.dp_world_size, args.horizon)
    tag = f"global_step{step}"
    if saver:
        return saver.save(tag, state, step, checkpoint.folder_preparation(engine, tokenizer, args.output_dir, tag))
    if args.save_mode == "plain" or args.save_mode in engines.WRITERS:
        return patterns.save_plain(engine, args.output_dir, tag, state)
    if args.save_mode == "rank0_only":
        return patterns.save_rank0_only(engine, tokenizer, args.output_dir, tag, state,
                                        collective_timeout(args.collective_timeout))
    return checkpoint.save_partitioned(engine, tokenizer, args.output_dir, state, keep_last=args.keep_last,
                                       identity=identity)


def report_failed_save(outcome: Any, args: argparse.Namespace) -> None:
    """Every rank prints the same single line: what failed where, what is kept, what happens next."""
    kept = verify.latest_name(args.output_dir) or "none yet"
    then = "training continues (--on_save_error continue)" if args.on_save_error == "continue" else \
        "stopping every rank (--on_save_error abort)"
    print(f"save {outcome.tag} failed: {outcome.error}; the previous checkpoint ({kept}) and 'latest' are "
          f"untouched; {then}", flush=True)
    if args.on_save_error == "abort":
        sys.exit(1)


class SaveLog:
    """This rank's saves for run.json: each record, with how long it stopped training and how long until durable.

    `stall_seconds` runs from the save call to the start of the next step (or the end of the loop); a save by
    DeepSpeed's decoupled engine also stops a later step for `commit_wait_seconds` (from `commit_wait_at`);
    `durable_seconds` from the save call to the moment every rank knows the commit is on disk (None when the mode
    never makes it durable, or the save failed). `started_at`, `step_starts` and `loop_seconds` (its end) are seconds
    since the training loop began on this rank (the timeline of notebook 08).
    """

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank
        self.saves: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.rotation_errors: list[str] = []
        self.save_seconds = 0.0
        self.started: dict[str, float] = {}  # tag -> when its save was called
        self.costs: dict[str, dict[str, Any]] = {}  # tag -> the save call's SaveCost, as a dict
        self.loop_start = time.perf_counter()
        self.step_starts: list[float] = []
        self.loop_seconds = 0.0  # when the loop ended, on the same clock
        self._stalled: tuple[dict[str, Any], float] | None = None  # the last save's record, until the next step

    def stall_ends(self, step_starts: bool = True) -> None:
        """The next step starts (`step_starts`), or training ends: the last save's stall is over."""
        now = time.perf_counter() - self.loop_start
        if step_starts:
            self.step_starts.append(now)
        else:
            self.loop_seconds = now
        if self._stalled:
            record, start = self._stalled
            record["stall_seconds"] = time.perf_counter() - start
            self._stalled = None

    def add_waits(self, waits: list[tuple[float, float]]) -> None:
        """A later step (or the run's end) waited for the last save: DeepSpeed's decoupled writer finishing it."""
        for start, seconds in waits if self.saves else []:
            self.saves[-1].update(commit_wait_at=start - self.loop_start, commit_wait_seconds=seconds)

    def add(self, outcome: Any, start: float, durable: bool, cost: dict[str, Any]) -> None:
        """A save called at `start` returned; `durable`: once committed it is on disk (not DeepSpeed's plain save).

        An asynchronous save returns neither committed nor failed: `settle` follows when it is, and then completes
        its `cost` (this rank's SaveCost of the call) with the files the background write put on disk.
        """
        record = outcome.record() | {"stall_seconds": None, "durable_seconds": None,
                                     "started_at": start - self.loop_start}
        self.saves.append(record)
        self.save_seconds += outcome.seconds
        self.started[outcome.tag] = start
        self.costs[outcome.tag] = cost
        self._stalled = (record, start)
        if outcome.committed or outcome.error:  # not in flight, nor skipped (the seed's rank-0 guard)
            self.settle(outcome, durable)

    def settle(self, outcome: Any | None, durable: bool = True) -> None:
        """A save's final outcome (None: nothing settled), on every rank: report a failure, or when it was durable."""
        if outcome is None:
            return
        record = next(r for r in reversed(self.saves) if r["tag"] == outcome.tag)
        record.update(committed=outcome.committed, error=outcome.error, timings=record["timings"] | outcome.timings,
                      deleted=outcome.deleted, rotation_error=outcome.rotation_error)
        if not outcome.committed:
            self.failed.append({"tag": outcome.tag, "step": outcome.step, "error": outcome.error})
            report_failed_save(outcome, self.args)
            return
        if "snapshot_bytes" in record:  # asynchronous: the files were written after the call was measured
            files = checkpoint.rank_files(self.args.output_dir, outcome.tag, self.rank)
            root = Path(self.args.output_dir)
            self.costs[outcome.tag].update(files=[str(root / f["path"]) for f in files],
                                           bytes_written=sum(f["bytes"] for f in files))
        if durable:  # an asynchronous save was durable when its background thread committed it
            record["durable_seconds"] = (getattr(outcome, "durable_at", None) or time.perf_counter()) \
                - self.started[outcome.tag]
        if self.rank == 0:
            print(f"saved checkpoint {outcome.tag} in {outcome.seconds:.2f} s", flush=True)
        if outcome.rotation_error:
            self.rotation_errors.append(rotation.report(outcome))


class RunIncomplete(RuntimeError):
    """The run trained to the end but did not write what it was asked to: no save committed, or no run.json."""


def ending_problem(saves: list[dict[str, Any]], failed: list[dict[str, Any]], run_json_error: str | None) -> str | None:
    """One line when every save failed (a full or read-only disk to the end) or run.json could not be written."""
    problems = []
    tried = [s for s in saves if not s["skipped"]]
    if tried and len(failed) == len(tried):
        problems.append(f"all {len(tried)} saves failed, so this run committed no checkpoint (the last: "
                        f"{failed[-1]['error']}); free space or choose another --output_dir")
    if run_json_error:
        problems.append(f"run.json was not written ({run_json_error})")
    return "; ".join(problems) or None


def main(argv: list[str] | None = None) -> None:
    """Run the worker; a checkpoint that cannot be used or a lost collective ends it with one line, exit 1."""
    lifeline.arm()  # no rank outlives torchrun or the launching process, however they were killed
    try:
        train(argv)
        # Everything is written and the process group is destroyed. Skip interpreter finalization: once in a
        # few dozen CPU runs a C++ thread left by the gloo/shm backends is still joinable when static destructors
        # run, and std::terminate turns a finished job into SIGABRT ("terminate called without an active
        # exception"), which torchrun reports as a failed job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except (verify.CheckpointError, commit.CollectiveTimeout, RunIncomplete, nodes.LayoutError) as e:
        print(f"zckpt_nb.train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as e:  # a collective outside a save timed out: say so in one line, not a traceback
        if not commit.is_timeout(e):
            raise
        print(f"zckpt_nb.train: error: rank {os.environ.get('RANK', '?')}: a collective timed out or lost a rank "
              f"while training ({str(e).strip().splitlines()[0][:160]}); is some rank stuck or saving alone?",
              file=sys.stderr, flush=True)
        sys.exit(1)


def train(argv: list[str] | None = None) -> None:
    args = add_train_args(argparse.ArgumentParser(prog="zckpt_nb.train")).parse_args(argv)
    import deepspeed
    import torch.distributed as dist
    import transformers

    from zckpt_nb import data

    # Keep the streamed log readable: library deprecation chatter is not what the notebooks teach.
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    wall_start = time.perf_counter()
    backend, device = setup_distributed(collective_timeout(args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes.check_layout(args.output_dir, args.node_local_storage)  # before anything is built or written
    seed_everything(args.seed)
    preset = get_preset(args.model)
    args.global_batch = args.global_batch or preset.global_batch
    identity = {"model": args.model, "num_params": param_count(args.model), "global_batch": args.global_batch}
    universal = None
    if args.resume:  # before anything is built: the newest committed checkpoint, verified (converted if N differs)
        resume_tag, note, load_dir, universal = reshard.resume_source(
            args.output_dir, identity, timeout=0.9 * collective_timeout(args.collective_timeout),
            convert=args.reshard == "auto")
        verify.check_config(args.output_dir, gpt2_config(args.model).to_dict(), args.model)
        if note and rank == 0:
            print(note, flush=True)
        if nodes.writes_folder(args.node_local_storage):
            nodes.drop_partial(args.output_dir, resume_tag)
        plan = schedule.resume_schedule(args.model, args.steps, verify.step_of(resume_tag),
                                        schedule.saved_horizon(load_dir, resume_tag), args.new_schedule)
        said = schedule.describe(plan, args.steps)
        if said and rank == 0:
            print(said, flush=True)
    args.horizon = plan["horizon"] if args.resume else args.steps  # the LR schedule's total_num_steps
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.startswith("cuda"))

    # Tokenizer and data: trained on the shipped corpus (deterministic), or reused from the checkpoint.
    tokenizer = data.load_or_train_tokenizer(args.output_dir if args.resume else "", preset.vocab_size)
    tokens = data.encode_corpus(tokenizer)

    # The model is built partitioned: no rank ever holds all of it.
    saving = args.save_checkpoint or args.save_every or args.save_16bit or args.save_gathered
    gather16 = args.gather_16bit == "on" or (args.gather_16bit == "auto" and args.save_16bit)
    config = ds_config(args.model, steps=args.horizon, world_size=world, global_batch=args.global_batch, bf16=bf16,
                       gather_16bit_on_save=gather16,
                       comms_logger=bool(saving),  # its per-op byte counts give each save's collective bytes
                       persistence_threshold=args.persistence_threshold, load_universal=universal is not None,
                       node_local_storage=args.node_local_storage)
    config["checkpoint"].update(engines.writer_section(args.save_mode))  # DeepSpeed's own writers, by config
    engines.set_launcher_env()
    model, _hf_ds_config = (build_model if args.init == "hf" else build_model_bare)(args.model, config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    commits = engines.time_commits(engine) if args.save_mode in engines.WRITERS else None
    held, num_params = held_elements(engine.module), count_params(engine.module)
    print(f"rank {rank}/{world} on {device} ({backend}): holds {held['owned'] + held['persistent']:,} parameter "
          f"elements of {num_params:,}: its own slices, {held['owned']:,}, plus {held['persistent_tensors']} "
          f"persistent tensors kept whole, {held['persistent']:,} (stage3_param_persistence_threshold "
          f"{args.persistence_threshold:,})", flush=True)

    start_step = 0
    if args.resume:
        start_step = checkpoint.resume(engine, load_dir, resume_tag, restore_rng=universal is None)["step"]
        if rank == 0:
            print(f"resumed from {resume_tag} at step {start_step}", flush=True)

    share = data.rank_share(args.global_batch, world, rank)  # this rank's slice of every step's global batch
    saver = async_save.AsyncSaver(engine, args.output_dir, identity, keep_last=args.keep_last,
                                  timeout_s=collective_timeout(args.collective_timeout)) \
        if args.save_mode == "async" else None
    engine.train()
    steps, losses, lrs, log = [], [], [], SaveLog(args, rank)
    for step in range(start_step, args.steps):
        log.stall_ends()  # the previous save stopped training until here
        log.settle(saver.poll() if saver else None)  # an asynchronous save, once committed in the background
        batch = data.global_batch_for_step(tokens, step=step, seed=args.seed, global_batch=args.global_batch,
                                           seq_len=preset.seq_len)
        steps.append(step)
        lrs.append(engine.get_lr()[0])  # the LR this step trains with (the scheduler stepped after the last one)
        if commits:
            commits.take()  # commits inside a save call are in its measured time already
        losses.append(train_step(engine, batch, share, world, device))
        if commits:
            log.add_waits(commits.take())  # this step waited for a decoupled save's writer
        if rank == 0:  # the launcher parses these lines for its progress bar
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f}", flush=True)
        done = step + 1
        if (args.save_every and done % args.save_every == 0) or (args.save_checkpoint and done == args.steps):
            start = time.perf_counter()
            log.settle(saver.finish() if saver else None)  # at most one save in flight: this wait is stall too
            cost, outcome = measure.measure_partitioned(
                partial(save, args, engine, tokenizer, done, identity, saver), args.output_dir, step=done, rank=rank,
                device=device)
            log.add(outcome, start, durable=args.save_mode in ("commit", "async"), cost=cost.to_dict())
    log.stall_ends(step_starts=False)
    if commits and commits.is_decoupled():  # its writer finishes the last save (DeepSpeed writes no `latest` for it)
        commits.take()
        commits.cleanup()
        log.add_waits(commits.take())
    log.settle(saver.finish() if saver else None)  # the last save commits before the run ends

    placeholders = state_dict_placeholders(engine.module)  # right after training, before any route gathers
    save_costs = list(log.costs.values()) + consolidate.run_routes(engine, args.output_dir, gathered16=args.save_16bit,
                                         per_param=args.save_gathered, rank=rank, device=device)
    if args.save_reference:
        fixed = data.global_batch_for_step(tokens, step=args.steps, seed=args.seed, global_batch=2,
                                           seq_len=preset.seq_len)
        consolidate.save_reference(engine, fixed.to(device), args.output_dir, rank)

    tag = verify.latest_name(args.output_dir) if len(log.saves) > len(log.failed) else None
    records = gather_rank_records({
        "rank": rank,
        "peak_memory_bytes": peak_memory_bytes(device),
        "save_seconds": log.save_seconds,
        "saves": log.saves, "step_starts": log.step_starts, "loop_seconds": log.loop_seconds,
        "files": checkpoint.rank_files(args.output_dir, tag, rank) if tag else [],
        "held": held, "state_dict": placeholders,
        "save_costs": save_costs,
    })
    costs = [c for r in records for c in r.pop("save_costs")]  # one list over ranks: run.json's save_costs
    run_json_error = None
    if nodes.writes_folder(args.node_local_storage):  # rank 0, or each node's local rank 0 with node-local storage
        run = {
            "world_size": world, "backend": backend, "device": device, "model": args.model,
            "dtype": "bf16" if bf16 else "fp32", "seed": args.seed, "num_params": num_params,
            "vocab_size": preset.vocab_size, "tokenizer_vocab_size": len(tokenizer),
            "resumed_from_step": start_step if args.resume else None, "latest_tag": tag,
            "global_batch": args.global_batch, "gradient_accumulation_steps": config["gradient_accumulation_steps"],
            "resharded": universal, "schedule": plan if args.resume else {"horizon": args.horizon},
            "save_mode": args.save_mode, "failed_saves": log.failed, "rotation_errors": log.rotation_errors,
            "init": args.init,
            "persistence_threshold": args.persistence_threshold, "ds_config": config,
            "steps": steps, "losses": losses, "lrs": lrs, "wall_seconds": time.perf_counter() - wall_start,
            "save_costs": costs, "ranks": records,
        }
        try:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            commit.atomic_write(Path(args.output_dir) / "run.json", json.dumps(run, indent=1))  # never half a file
        except OSError as e:  # the disk stayed full or read-only: reported below in one line, not a traceback
            run_json_error = commit.describe_error(e, e.filename or Path(args.output_dir) / "run.json", rank)
            with suppress(OSError):
                (Path(args.output_dir) / "run.json.tmp").unlink(missing_ok=True)
    dist.barrier()
    dist.destroy_process_group()
    problem = ending_problem(log.saves, log.failed, run_json_error)
    if problem:
        raise RunIncomplete(f"rank {rank}: {problem}")


if __name__ == "__main__":
    main()
