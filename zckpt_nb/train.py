"""The training worker, one process per rank: read it top to bottom. The set-up (process group, tokenizer and data,
the ZeRO-3 engine), an optional resume, the loop with its saves (`saving.api.Checkpointer`, `--save_mode`), the
consolidated saves, `run.json`. By hand: torchrun --nproc_per_node 2 -m zckpt_nb.train --steps 50 --output_dir out
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import warnings
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb import data
from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.verify import check_config
from zckpt_nb.errors import (
    CheckpointError,
    CollectiveTimeout,
    LayoutError,
    RunIncomplete,
    describe_error,
    gist,
    is_peer_failure,
)
from zckpt_nb.format.client_state import CLIENT_KEY, client_state
from zckpt_nb.format.layout import latest_name, rank_files, tag_for, writes_folder
from zckpt_nb.format.records import RankRecord, Route, RunRecord, SaveCost, SaveMode, Schedule
from zckpt_nb.measure.meters import files_under, flush_writes, measure, peak_memory
from zckpt_nb.model import (
    Preset,
    build_model,
    count_params,
    ds_config,
    get_preset,
    gpt2_config,
    held_elements,
    param_count,
)
from zckpt_nb.run import lifeline
from zckpt_nb.run.options import TrainOptions
from zckpt_nb.saving.api import Checkpointer
from zckpt_nb.saving.collective import gather, timeout_seconds
from zckpt_nb.saving.engine import ZckptEngine, install, launcher_env, writer_section
from zckpt_nb.saving.log import SaveLog
from zckpt_nb.saving.nodes import check_layout, drop_partial
from zckpt_nb.saving.resume import load_verified, resume_source

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs to be deterministic (CUDA's and torch's reproducibility notes)


@dataclass
class ResumeSource:
    """Where a resume loads from: the tag, its folder (the universal copy's when N changed) and the LR plan."""

    tag: str
    load_dir: Path
    universal: dict[str, Any] | None  # the universal copy's manifest, when the world size changed
    plan: Schedule  # the LR schedule across the resume


@dataclass
class Worker:
    """What the set-up made, handed to the resume, the loop and the report."""

    opts: TrainOptions
    rank: int
    world: int
    backend: str
    device: str
    preset: Preset
    identity: dict[str, Any]  # what the manifest records of the model, checked again on resume
    horizon: int  # the LR schedule's total_num_steps
    bf16: bool
    source: ResumeSource | None
    tokenizer: Any = None
    tokens: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    engine: Any = None
    hf_config: Any = None  # transformers' HfDeepSpeedConfig, kept alive while the engine lives
    held: dict[str, int] = field(default_factory=dict)
    wall_start: float = 0.0
    determinism: str = ""  # one line for run.json: whether this run's kernels were deterministic


@dataclass
class History:
    """Every step this run trained: its number, its global batch's mean loss, the LR it trained with."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


def setup_distributed(timeout_s: float) -> tuple[str, str]:
    """Join the process group: NCCL with one GPU per rank, else gloo; (backend, device)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_gpu = accelerator.device_name() == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        skip_shm_op()
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s))
    return backend, (f"cuda:{accelerator.current_device()}" if on_gpu else "cpu")


def skip_shm_op() -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, so no rank builds or loads it."""
    import deepspeed.ops

    # The op serves only inference_all_reduce; loading it takes torch's extension file lock, which a killed rank
    # leaves behind, and every later job on the machine then waits forever.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def set_determinism(choice: str, device: str) -> str:
    """Make this rank's kernels deterministic when asked (`auto`: on GPU ranks); one line saying what holds."""
    import torch

    on_gpu = device.startswith("cuda")
    if choice == "off" or (choice == "auto" and not on_gpu):
        return f"not enforced (--deterministic {choice}): torch.use_deterministic_algorithms off"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    if on_gpu:  # exact resume on GPUs: SDPA's flash and memory-efficient backward are not deterministic
        for backend in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
        torch.backends.cuda.enable_math_sdp(True)
    gpu = f", CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}, SDPA math backend" if on_gpu else ""
    return f"deterministic (--deterministic {choice}): torch.use_deterministic_algorithms(True){gpu}"


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every rank builds the same initial model."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def sum_over_ranks(value: float, device: str) -> float:
    """`value` summed over ranks, identical on every rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def train_step(engine: Any, batch: Any, share: range, world: int, device: str) -> float:
    """One optimizer step on this rank's `share` of the global `batch`; the global batch's mean loss."""
    import torch

    gas, total = engine.gradient_accumulation_steps(), 0.0
    # The weight makes the averaged gradient the global batch's mean however it is split; a rank with no sample in
    # a micro-step runs one with weight 0 (it still joins ZeRO-3's collectives).
    for part in data.micro_steps(share, gas):
        x = batch[list(part) or [0]].to(device)
        loss = engine(input_ids=x, attention_mask=torch.ones_like(x), labels=x).loss
        engine.backward(loss * (len(part) * world * gas / len(batch)))
        engine.step()
        total += loss.item() * len(part)
    return sum_over_ranks(total, device) / len(batch)


def main(argv: list[str] | None = None, engine_kind: type[ZckptEngine] = ZckptEngine) -> None:
    """Run the worker; an unusable checkpoint or a lost collective ends it with one line, exit 1."""
    lifeline.arm()  # no rank outlives torchrun or the launching process, however they were killed
    try:
        train(TrainOptions.parse(argv), engine_kind)
        lifeline.leave(0)  # everything is written and the process group destroyed: skip the teardown
    except (CheckpointError, CollectiveTimeout, RunIncomplete, LayoutError) as e:
        print(f"zckpt_nb.train: error: {e}", file=sys.stderr, flush=True)
        lifeline.leave(1)  # the line is out: skip the teardown, where gloo can turn exit 1 into SIGABRT
    except RuntimeError as e:  # a collective outside the package's save timed out or lost a peer: one line
        if not is_peer_failure(e):
            raise
        print(f"zckpt_nb.train: error: rank {os.environ.get('RANK', '?')}: a collective in a training step or in "
              "DeepSpeed's own save_checkpoint (its tag check and barrier) timed out or lost a rank "
              f"({gist(e)}); is some rank stuck, dead or saving alone?",
              file=sys.stderr, flush=True)
        lifeline.leave(1)


def train(opts: TrainOptions, engine_kind: type[ZckptEngine] = ZckptEngine) -> None:
    """Set up, resume if asked, train with periodic saves, then the consolidated saves and run.json."""
    quiet_libraries()
    worker = set_up(opts, engine_kind)
    start_step = resume(worker) if worker.source else 0
    log, history = loop(worker, start_step)
    wrap_up(worker, log, history, start_step)


def quiet_libraries() -> None:
    """Keep the streamed log readable: no library deprecation chatter."""
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()


def set_up(opts: TrainOptions, engine_kind: type[ZckptEngine] = ZckptEngine) -> Worker:
    """Join the process group, check the folder, find the checkpoint to resume, build tokenizer, data and engine."""
    import torch.distributed as dist

    wall_start = time.perf_counter()
    backend, device = setup_distributed(timeout_seconds(opts.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    check_layout(opts.output_dir, opts.node_local_storage)  # before anything is built or written
    determinism = set_determinism(opts.deterministic, device)
    seed_everything(opts.seed)
    preset = get_preset(opts.model)
    opts = replace(opts, global_batch=opts.global_batch or preset.global_batch)
    identity = {"model": opts.model, "num_params": param_count(opts.model), "global_batch": opts.global_batch}
    source = find_resume_source(opts, identity, rank) if opts.resume else None
    bf16 = opts.dtype == "bf16" or (opts.dtype == "auto" and device.startswith("cuda"))
    worker = Worker(opts, rank, world, backend, device, preset, identity,
                    horizon=source.plan.horizon if source else opts.steps, bf16=bf16, source=source,
                    wall_start=wall_start, determinism=determinism)
    # Tokenizer and data: trained on the shipped corpus (deterministic), or reused from the checkpoint.
    worker.tokenizer = data.load_or_train_tokenizer(opts.output_dir if opts.resume else "", preset.vocab_size)
    worker.tokens = data.encode_corpus(worker.tokenizer)
    build_engine(worker, engine_kind)
    return worker


def find_resume_source(opts: TrainOptions, identity: dict[str, Any], rank: int) -> ResumeSource:
    """Every rank: the newest committed checkpoint, verified (converted when N differs), and the LR plan across it."""
    tag, note, load_dir, universal = resume_source(opts.output_dir, identity, convert=opts.reshard == "auto",
                                                   timeout=0.9 * timeout_seconds(opts.collective_timeout))
    check_config(opts.output_dir, gpt2_config(opts.model).to_dict(), opts.model)
    if note and rank == 0:
        print(note, flush=True)
    if writes_folder(opts.node_local_storage):
        drop_partial(opts.output_dir, tag)
    # DeepSpeed saves WarmupDecayLR's position, not its horizon: the client state keeps it ("steps"), and a resume
    # with other --steps continues it (past it the LR is 0) unless --new_schedule asks for the new one
    states = load(min((load_dir / tag).glob("zero_pp_rank_*_mp_rank_00_model_states.pt")), mmap=True)
    old, new = states.get(CLIENT_KEY, {}).get("steps"), opts.new_schedule
    plan = Schedule(opts.steps if new or old is None else old, old, new)
    if rank == 0 and old not in (None, opts.steps):  # say what happens to the LR
        print(f"--new_schedule: the LR now decays over {opts.steps} steps instead of {old}" if plan.new_schedule
              else f"--steps {opts.steps} but the checkpoint's LR schedule ends at step {old}: continuing it (the LR "
                   f"is 0 from step {old + 1} on); pass --new_schedule to decay over {opts.steps} steps",
              flush=True)
    return ResumeSource(tag, load_dir, universal, plan)


def build_engine(worker: Worker, engine_kind: type[ZckptEngine]) -> None:
    """The ZeRO-3 engine: the model is built partitioned, so no rank ever holds all of it."""
    import deepspeed

    opts = worker.opts
    saving = opts.save_checkpoint or opts.save_every or opts.save_16bit or opts.save_gathered
    gather16 = opts.gather_16bit == "on" or (opts.gather_16bit == "auto" and opts.save_16bit)
    config = ds_config(opts.model, steps=worker.horizon, world_size=worker.world, global_batch=opts.global_batch,
                       bf16=worker.bf16, gather_16bit_on_save=gather16,
                       comms_logger=bool(saving),  # its per-op byte counts give each save's collective bytes
                       persistence_threshold=opts.persistence_threshold,
                       load_universal=bool(worker.source and worker.source.universal),
                       node_local_storage=opts.node_local_storage)
    config["checkpoint"].update(writer_section(opts.save_mode))  # DeepSpeed's own writers, by config
    for key, value in launcher_env().items():  # what DeepSpeed's launcher would have exported
        os.environ.setdefault(key, value)
    model, worker.hf_config = build_model(opts.model, config)
    worker.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    install(worker.engine, engine_kind)  # the package's checkpoint engine, given to DeepSpeed once
    worker.config, worker.held = config, held_elements(worker.engine.module)
    held = worker.held
    print(f"rank {worker.rank}/{worker.world} on {worker.device} ({worker.backend}): holds "
          f"{held['owned'] + held['persistent']:,} parameter elements of {count_params(worker.engine.module):,}: its "
          f"own slices, {held['owned']:,}, plus {held['persistent_tensors']} persistent tensors kept whole, "
          f"{held['persistent']:,} (stage3_param_persistence_threshold {opts.persistence_threshold:,})", flush=True)


def resume(worker: Worker) -> int:
    """Load the verified checkpoint into the engine (this rank's RNG too, on the same world size); its step."""
    source = worker.source
    state = load_verified(worker.engine, source.load_dir, source.tag, restore_rng=source.universal is None)
    step = state[CLIENT_KEY]["step"]
    if worker.rank == 0:
        print(f"resumed from {source.tag}: {step} steps done, the next is step {step + 1}", flush=True)
    return step


def loop(worker: Worker, start_step: int) -> tuple[SaveLog, History]:
    """Train from `start_step` to `--steps`, saving every `--save_every` steps into the SaveLog."""
    opts, engine = worker.opts, worker.engine
    checkpointer = Checkpointer(engine, opts.output_dir, mode=opts.save_mode, tokenizer=worker.tokenizer,
                                keep_last=opts.keep_last, identity=worker.identity,
                                collective_timeout=opts.collective_timeout)
    writer = install(engine)  # it times DeepSpeed's commits: a decoupled save's writer stalls a later step
    share = data.rank_share(opts.global_batch, worker.world, worker.rank)  # this rank's slice of every batch
    engine.train()
    log, history = SaveLog(opts.output_dir, opts.on_save_error, worker.rank), History()
    for step in range(start_step, opts.steps):
        log.stall_ends()  # the previous save stopped training until here
        log.settle(checkpointer.poll())  # an asynchronous save, once committed in the background
        batch = data.global_batch_for_step(worker.tokens, step=step, seed=opts.seed, global_batch=opts.global_batch,
                                           seq_len=worker.preset.seq_len)
        history.steps.append(step)
        history.lrs.append(engine.get_lr()[0])  # the LR this step trains with (the scheduler stepped after the last)
        writer.take_waits()  # commits inside a save call are in its measured time already
        history.losses.append(train_step(engine, batch, share, worker.world, worker.device))
        log.add_waits(writer.take_waits())  # this step waited for a decoupled save's writer
        if worker.rank == 0:  # the launcher parses these lines for its progress bar
            print(f"step {step + 1}/{opts.steps} loss {history.losses[-1]:.4f}", flush=True)
        done = step + 1
        if (opts.save_every and done % opts.save_every == 0) or (opts.save_checkpoint and done == opts.steps):
            save_now(worker, checkpointer, log, done)
    log.stall_ends(step_starts=False)
    if writer.is_decoupled():  # its writer finishes the last save (DeepSpeed writes no `latest` for it)
        writer.take_waits()
        writer.cleanup()
        log.add_waits(writer.take_waits())
    log.settle(checkpointer.finish())  # the last save commits before the run ends
    return log, history


def save_now(worker: Worker, checkpointer: Checkpointer, log: SaveLog, step: int) -> None:
    """One save at `step`, measured on this rank (time, memory, bytes written, collective bytes)."""
    opts, start, outcome = worker.opts, time.perf_counter(), []
    log.settle(checkpointer.finish())  # at most one save in flight: this wait is stall too
    state = client_state(step, opts.seed, opts.global_batch, worker.engine.dp_world_size, worker.horizon)
    root = Path(opts.output_dir)
    cost = measure(Route.PARTITIONED, lambda: outcome.append(checkpointer.save(step, state)),
                   written=lambda: [root / f["path"] for f in rank_files(root, tag_for(step), worker.rank)],
                   rank=worker.rank, device=worker.device)
    log.add(outcome[0], start, durable=SaveMode(opts.save_mode).durable, cost=cost)


def consolidated_saves(worker: Worker) -> list[SaveCost]:
    """The consolidated routes asked for, on every rank, each into its own folder; their costs."""
    import torch.distributed as dist

    opts, rank = worker.opts, worker.rank
    routes = [route for route, asked in ((Route.GATHERED16, opts.save_16bit), (Route.PER_PARAM, opts.save_gathered))
              if asked]
    costs = []
    for route in routes:
        folder = Path(opts.output_dir) / route
        flush_writes()
        dist.barrier()  # every rank's flush is done before any clock starts (not in the comms log)
        costs.append(measure(route, partial(Checkpointer(worker.engine, folder, mode=route).save, opts.steps),
                             rank=rank, device=worker.device,
                             written=lambda folder=folder: files_under(folder) if rank == 0 else []))
    return costs


def wrap_up(worker: Worker, log: SaveLog, history: History, start_step: int) -> None:
    """After training: the consolidated saves, every rank's record into run.json, then the end."""
    import torch.distributed as dist

    opts, rank = worker.opts, worker.rank
    costs = [c for mine in gather(list(log.costs.values()) + consolidated_saves(worker)) for c in mine]
    tag = latest_name(opts.output_dir) if len(log.saves) > len(log.failed) else None
    records = gather(RankRecord(
        rank, **peak_memory(worker.device), save_seconds=log.save_seconds, saves=log.saves,
        step_starts=log.step_starts, loop_seconds=log.loop_seconds,
        files=rank_files(opts.output_dir, tag, rank, committed=True) if tag else [], held=worker.held))
    problems = []
    if log.saves and len(log.failed) == len(log.saves):  # a full or read-only disk to the end
        problems.append(f"all {len(log.saves)} saves failed, so this run committed no checkpoint (the last: "
                        f"{log.failed[-1].error}); free space or choose another --output_dir")
    if writes_folder(opts.node_local_storage):  # rank 0, or each node's local rank 0 with node-local storage
        out = Path(opts.output_dir)
        try:  # atomically: never half a file
            out.mkdir(parents=True, exist_ok=True)
            run_record(worker, log, history, start_step, tag, records, costs).write(out)
        except OSError as e:  # the disk stayed full or read-only: reported in one line, not a traceback
            with suppress(OSError):
                (out / "run.json.tmp").unlink(missing_ok=True)
            problems.append(f"run.json was not written ({describe_error(e, e.filename or out / 'run.json', rank)})")
    dist.barrier()
    dist.destroy_process_group()
    if problems:
        raise RunIncomplete(f"rank {rank}: {'; '.join(problems)}")


def run_record(worker: Worker, log: SaveLog, history: History, start_step: int, tag: str | None,
               records: list[RankRecord], costs: list[SaveCost]) -> RunRecord:
    """What run.json holds: the run's set-up, every step's loss and LR, every save, every rank's record."""
    opts, source = worker.opts, worker.source
    return RunRecord(
        world_size=worker.world, backend=worker.backend, device=worker.device, model=opts.model,
        num_params=count_params(worker.engine.module), vocab_size=worker.preset.vocab_size, steps=history.steps,
        losses=history.losses, ranks=records, lrs=history.lrs, dtype="bf16" if worker.bf16 else "fp32",
        seed=opts.seed, deterministic=worker.determinism, global_batch=opts.global_batch,
        gradient_accumulation_steps=worker.config["gradient_accumulation_steps"],
        tokenizer_vocab_size=len(worker.tokenizer), persistence_threshold=opts.persistence_threshold,
        save_mode=opts.save_mode, resumed_from_step=start_step if source else None,
        resharded=source.universal if source else None,
        schedule=source.plan if source else Schedule(worker.horizon), latest_tag=tag, failed_saves=log.failed,
        rotation_errors=log.rotation_errors, save_costs=costs, ds_config=worker.config,
        wall_seconds=time.perf_counter() - worker.wall_start)


if __name__ == "__main__":
    main()
