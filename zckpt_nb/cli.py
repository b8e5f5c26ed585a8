"""`python -m zckpt_nb COMMAND ...`: the same functions the notebooks call, from the shell.

Each command imports what it needs when it runs, so that `verify` or `costs` start without loading torch.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from zckpt_nb.errors import CheckpointError, LaunchError, UsageError, os_error_line
from zckpt_nb.format.units import counted, secs, size
from zckpt_nb.run import lifeline


def cmd_train(args: argparse.Namespace) -> int:
    from zckpt_nb.run.launch import launch
    from zckpt_nb.run.nodes import Nodes
    from zckpt_nb.run.options import TrainOptions

    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    run = launch(args.nproc, timeout=args.timeout, nodes=nodes, worker=args.worker,
                 **TrainOptions.from_namespace(args).to_dict())
    first, last = (run.losses[0], run.losses[-1]) if run.losses else (float("nan"), float("nan"))
    print(f"trained {run.num_params:,} parameters on {counted(run.world_size, run.device + ' rank')} ({run.backend}): "
          f"steps {len(run.steps)}, loss {first:.4f} -> {last:.4f}, {run.launch_seconds:.1f} s; "
          f"run.json in {run.output_dir}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from zckpt_nb.convert.inspect import format_inspection, inspect_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed logs to stdout on import; keep the output clean
            info = inspect_checkpoint(args.ckpt_dir, args.tag)
            text = json.dumps(info.to_dict(), indent=1) if args.json else format_inspection(info)
    except (FileNotFoundError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    print(text)
    return 0


def checked(command: str, convert: Callable[[], Any], describe: Callable[[Any], list[str]],
            prefix: str = "bad checkpoint: ") -> int:
    """Run one converter: a CheckpointError is one line on stderr and exit 1; otherwise print what `describe` says."""
    try:
        result = convert()
    except CheckpointError as e:
        print(f"zckpt_nb {command}: {prefix}{e}", file=sys.stderr)
        return 1
    print("\n".join(describe(result)))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.reshard import describe_conversion, ensure_universal
    from zckpt_nb.convert.verify import describe_manifest, newest_committed

    def convert() -> tuple[dict, bool]:
        tag = args.tag or newest_committed(args.ckpt_dir, "converting")
        return ensure_universal(args.ckpt_dir, tag, timeout=args.timeout)

    return checked("reshard", convert, lambda r: [describe_conversion(r[0], r[1], world=None),
                                                  describe_manifest(r[0])])


def cmd_verify(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.verify import describe_manifest, verify

    return checked("verify", lambda: verify(args.ckpt_dir, args.tag), lambda m: [describe_manifest(m)])


def cmd_adopt(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.adopt import adopt, describe_adoption
    from zckpt_nb.convert.verify import describe_manifest

    return checked("adopt", lambda: adopt(args.ckpt_dir, args.tag),
                   lambda m: [describe_adoption(m), describe_manifest(m)], prefix="")


def cmd_collect(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.collect import collect
    from zckpt_nb.convert.verify import describe_manifest

    return checked("collect", lambda: collect(args.parts, args.out, args.tag), lambda m: [
        f"collected {len(args.parts)} node folders into {args.out}: {describe_manifest(m)}"], prefix="")


def cmd_costs(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from zckpt_nb.plan.costs import predict
    from zckpt_nb.plan.planning import Bandwidths, plan

    sizes = args.nproc
    if min(sizes) < 1:
        raise UsageError(f"world sizes must be at least 1 (got {sizes})")
    name = args.config or args.model
    bw = Bandwidths(args.write_gbps, args.read_gbps, args.net_gbps, args.step_latency_us, args.file_ms)
    preds = [predict(name, n, args.dtype, args.persistence_threshold) for n in sizes]
    plans = [plan(name, n, bw, args.dtype, args.persistence_threshold, args.gather_16bit == "on") for n in sizes]
    if args.json:
        data = [{"prediction": p.to_dict(), "plan": [asdict(r) for r in rows]} for p, rows in zip(preds, plans)]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=1))
        return 0
    for pred in preds:  # what each rank holds and what its partitioned save writes and sends
        part = pred.saves["partitioned"]
        print(f"{pred.model}: P = {pred.num_params:,} in {pred.num_tensors:,} tensors, N = {pred.world_size:,}, "
              f"{pred.dtype}, persistence threshold {pred.persistence_threshold:,}")
        print(f"  slice per rank {pred.slice_numel:,} elements (padding {pred.padding_numel:,} over all ranks), "
              f"{pred.persistent_tensors:,} persistent tensors held whole ({pred.persistent_numel:,} elements)")
        print(f"  held per rank: params {size(pred.param_bytes)}, grads {size(pred.grad_bytes)}, fp32 master "
              f"{size(pred.master_bytes)}, Adam {size(pred.optimizer_bytes)}")
        print(f"  partitioned save: {part.written_bytes:,} B of tensors per rank; collectives "
              f"{part.comm_bytes:,} B per rank (tag check {pred.tag_check_bytes}, regather {pred.regather_bytes:,})")
    table = [("N", "route", "rank 0 writes", "rank 0 extra peak", "stall", "to durable", "resumes training")] + [
        (f"{r.world_size:,}", r.route, size(r.written_bytes), size(r.extra_peak_bytes), f"{secs(r.stall_s)} s",
         f"{secs(r.durable_s)} s", "yes" if r.resumable else "no") for rows in plans for r in rows]
    widths = [max(len(cell) for cell in column) for column in zip(*table)]  # aligned under the column names
    print("\n" + "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table))
    print("\nseconds by kind of work (write, read, net: bytes over the bandwidths; steps: ring steps x latency; "
          "files: rank files opened x cost per file)")
    for r in (r for rows in plans for r in rows):
        print(f"  N = {r.world_size:,} {r.route}: " + ", ".join(f"{k} {secs(v)} s" for k, v in r.seconds.items()))
    for rows in plans:
        least = min((r for r in rows if r.route != "offline"), key=lambda r: r.stall_s)
        soonest = min((r for r in rows if r.route != "partitioned"), key=lambda r: r.durable_s)
        print(f"N = {rows[0].world_size:,}: least stall {least.route} ({secs(least.stall_s)} s); a consolidated "
              f"model on disk soonest with {soonest.route} ({secs(soonest.durable_s)} s)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.export import export

    out = export(args.ckpt_dir, args.out_dir, tag=args.tag, max_shard_size=args.max_shard_size,
                 overwrite=args.overwrite, config=args.config, adapter_config=args.adapter_config, merge=args.merge)
    files = sorted(p for p in out.iterdir() if p.is_file())
    if not (out / "tokenizer.json").is_file() and (out / "config.json").is_file():  # an adapter is not generate's
        print(f"{args.ckpt_dir} has no tokenizer beside its tags, so the export has none: pass token ids to "
              "generate (--token_ids), or add the tokenizer the model was trained with")
    print(f"exported {args.ckpt_dir} to {out}: {len(files)} files, {sum(p.stat().st_size for p in files):,} bytes "
          f"({', '.join(p.name for p in files)})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.export import generate

    print(generate(args.model_dir, args.prompt, args.max_new_tokens, token_ids=args.token_ids))
    return 0


def add_train(sub: Any) -> None:
    from zckpt_nb.run.options import TrainOptions

    train = TrainOptions.add_arguments(sub.add_parser("train", help="train with ZeRO-3 on N ranks (CPU or GPU)"))
    train.add_argument("--nproc", type=int, default=2, help="ranks of this node: one per GPU, else CPU processes")
    train.add_argument("--nnodes", type=int, default=1, help="nodes of the job: run this command once on each")
    train.add_argument("--node_rank", type=int, default=0, help="this node's number, 0..nnodes-1")
    train.add_argument("--master_addr", default="127.0.0.1", help="address of the node of --node_rank 0")
    train.add_argument("--master_port", type=int, default=0,
                       help="a free port on the node of --node_rank 0, the same on every node (default: any free "
                            "port, one node only)")
    train.add_argument("--timeout", type=float, default=1800, help="kill every rank after this many seconds")
    train.add_argument("--worker", default="zckpt_nb.train",
                       help="the module torchrun starts: the ZeRO-3 worker, zckpt_nb.train_fsdp (FSDP2: resumes and "
                            "saves DCP checkpoints, to-dcp), or another taking the same flags")
    train.set_defaults(func=cmd_train)


def checkpoint_command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], about: str,
                       tag_default: str = "what 'latest' names", ckpt_dir: str | None = None) -> Any:
    """A command that reads one checkpoint tag: CKPT_DIR (its help `ckpt_dir`) and --tag."""
    parser = sub.add_parser(name, help=about)
    parser.add_argument("ckpt_dir", help=ckpt_dir)
    parser.add_argument("--tag", default=None, help=f"checkpoint tag (default: {tag_default})")
    parser.set_defaults(func=func)
    return parser


def add_checkpoint_commands(sub: Any) -> None:
    checkpoint_command(sub, "inspect", cmd_inspect, "per-rank files, sizes and partition sizes of a checkpoint"
                       ).add_argument("--json", action="store_true")
    checkpoint_command(sub, "verify", cmd_verify, "check a checkpoint against its manifest: files, sizes, SHA-256, "
                       "ranks")
    checkpoint_command(sub, "reshard", cmd_reshard, "convert a checkpoint to DeepSpeed's universal format, loadable "
                       "on any number of ranks (train --resume does this itself when N changes)",
                       "the newest committed").add_argument(
        "--timeout", type=float, default=1800, help="stop the conversion after this many seconds")
    checkpoint_command(sub, "adopt", cmd_adopt, "check a DeepSpeed ZeRO-3 checkpoint zckpt_nb did not write (a raw "
                       "engine's, Trainer's checkpoint-N) and commit it, so verify, export and reshard read it",
                       ckpt_dir="the folder holding 'latest' and the tag folders, or a tag folder itself")

    col = sub.add_parser("collect", help="assemble the node-local parts of a checkpoint into one folder")
    col.add_argument("parts", nargs="+", metavar="DIR", help="each node's --output_dir")
    col.add_argument("out", metavar="OUT", help="a new folder for the whole checkpoint")
    col.add_argument("--tag", default=None, help="checkpoint tag (default: what 'latest' names)")
    col.set_defaults(func=cmd_collect)


def cmd_to_dcp(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.dcp import describe_to_dcp, to_dcp

    return checked("to-dcp", lambda: to_dcp(args.ckpt_dir, args.out_dir, args.tag), lambda m: [describe_to_dcp(m)])


def cmd_from_dcp(args: argparse.Namespace) -> int:
    from zckpt_nb.convert.dcp import from_dcp
    from zckpt_nb.convert.reshard import describe_conversion

    return checked("from-dcp", lambda: from_dcp(args.dcp_dir, args.out_dir, args.config, args.step),
                   lambda m: [describe_conversion(m, False, None)])


def add_dcp_commands(sub: Any) -> None:
    """Leaving and joining DeepSpeed: ZeRO-3 to PyTorch DCP (FSDP2) with the optimizer, and back."""
    checkpoint_command(sub, "to-dcp", cmd_to_dcp, "a ZeRO-3 checkpoint as a PyTorch DCP checkpoint with its AdamW "
                       "state, which FSDP2 loads on any number of ranks", "the newest committed").add_argument(
        "out_dir", help="a new or empty folder (or an earlier to-dcp output, replaced)")
    back = sub.add_parser("from-dcp", help="a DCP checkpoint of a causal LM (to-dcp's, the FSDP2 worker's, a plain "
                                           "dcp.save of get_state_dict, a torchtitan step folder) into a ZeRO-3 "
                                           "checkpoint that DeepSpeed loads on any number of ranks")
    back.add_argument("dcp_dir")
    back.add_argument("out_dir", help="a new or empty folder")
    back.add_argument("--config", required=True, help="the model: a preset (tiny, ...), a config.json or a folder")
    back.add_argument("--step", type=int, default=None,
                      help="the training step, for a checkpoint that records none (no train_state.step) in a folder "
                           "whose name gives none (step-100, global_step100, ...)")
    back.set_defaults(func=cmd_from_dcp)


def add_costs(sub: Any) -> None:
    from zckpt_nb.model import PRESETS, shipped_configs

    costs = sub.add_parser("costs", help="plan a ZeRO-3 checkpoint from the model config alone: bytes and seconds")
    which = costs.add_mutually_exclusive_group()
    which.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    which.add_argument("--config", metavar="PATH_OR_DIR",
                       help="a transformers config.json of a causal LM (or its folder, or a shipped config: "
                            f"{', '.join(shipped_configs())}); built on the meta device, nothing downloaded")
    costs.add_argument("--nproc", type=int, nargs="+", default=[2], help="world sizes (default 2)")
    costs.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    costs.add_argument("--persistence_threshold", type=int, default=0,
                       help="stage3_param_persistence_threshold (DeepSpeed's default: 100000)")
    costs.add_argument("--gather_16bit", default="on", choices=["on", "off"],
                       help="stage3_gather_16bit_weights_on_model_save (off: save_16bit_model writes nothing)")
    costs.add_argument("--write_gbps", type=float, default=2.0, help="GB/s one rank writes to storage (default 2)")
    costs.add_argument("--read_gbps", type=float, default=2.0, help="GB/s the offline conversion reads (default 2)")
    costs.add_argument("--net_gbps", type=float, default=25.0, help="GB/s of one rank's network link (default 25)")
    costs.add_argument("--step_latency_us", type=float, default=0.0,
                       help="µs per ring step of one collective call (each call takes N - 1 steps; default 0: "
                            "not modelled)")
    costs.add_argument("--file_ms", type=float, default=0.0,
                       help="ms to open, check and unpickle one rank file in the offline conversion (it reads 2 per "
                            "rank; default 0: not modelled)")
    costs.add_argument("--json", action="store_true")
    costs.set_defaults(func=cmd_costs)


def add_export_commands(sub: Any) -> None:
    exp = checkpoint_command(sub, "export", cmd_export, "a ZeRO-3 checkpoint as a Hugging Face folder (safetensors, "
                             "tokenizer)")
    exp.add_argument("out_dir")
    exp.add_argument("--max_shard_size", default="5GB", help="split the weights into shards of at most this size")
    exp.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    exp.add_argument("--config", default=None, metavar="PATH",
                     help="the model's config.json (or its folder), when none lies beside the checkpoint")
    exp.add_argument("--adapter_config", default=None, metavar="FILE",
                     help="a peft (LoRA) run's adapter_config.json, when none lies beside the checkpoint: the export "
                          "is then the adapter folder that PeftModel.from_pretrained(base, OUT_DIR) loads")
    exp.add_argument("--merge", action="store_true",
                     help="a peft run: write the model with the adapter merged (merge_and_unload), not the adapter")

    gen = sub.add_parser("generate", help="greedy text from an exported model, without DeepSpeed")
    gen.add_argument("model_dir")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None, help="text to continue (the folder's tokenizer encodes it)")
    prompt.add_argument("--token_ids", type=int, nargs="+", default=None,
                        help="the prompt as token ids, for a model exported without a tokenizer; prints ids")
    gen.add_argument("--max_new_tokens", type=int, default=40)
    gen.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser: training, the checkpoint tools, planning, export."""
    parser = argparse.ArgumentParser(prog="python -m zckpt_nb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_train, add_checkpoint_commands, add_dcp_commands, add_costs, add_export_commands):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Every command but train reads or converts files in this process and never uses an accelerator: DeepSpeed is
    # told so (it then prints no "Setting accelerator to CPU" warning into their output). train uses GPUs if any.
    if args.command != "train":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with lifeline.signals_interrupt():  # SIGTERM, SIGHUP: stop every rank as Ctrl-C does, not die alone
            return args.func(args)
    except (UsageError, CheckpointError) as e:
        print(f"zckpt_nb {args.command}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except LaunchError as e:
        from zckpt_nb.run.logs import failure_report

        folder = getattr(args, "output_dir", None)
        print(f"zckpt_nb {args.command}: {failure_report(e, folder) if folder else e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, lifeline.Stopped) else signal.SIGINT
        print(f"zckpt_nb {args.command}: interrupted by {signal.Signals(signum).name}; every rank was stopped",
              file=sys.stderr)
        return 128 + signum
    except (OSError, RuntimeError) as e:  # the disk refused (torch's zip writer wraps its OSError in a RuntimeError)
        line = os_error_line(e)
        if line is None:
            raise
        print(f"zckpt_nb {args.command}: error: {line}", file=sys.stderr)
        return 1
