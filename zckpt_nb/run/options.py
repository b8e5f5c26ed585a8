"""The training worker's options, defined once: `launch()` takes them as typed keywords, and the `train` CLI and the
worker's argparse are derived from the same fields (help and choices in each field's metadata; a `bool` is a flag).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from zckpt_nb.errors import UsageError
from zckpt_nb.format.records import Record, SaveMode
from zckpt_nb.model import PRESETS


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its command-line help (and choices)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainOptions(Record):
    """Everything the worker (`python -m zckpt_nb.train`) takes; `launch(**options)` and `train --flag` alike."""

    output_dir: str = option(MISSING, "where checkpoints and run.json go")
    steps: int = option(150, "train until this step count")
    save_checkpoint: bool = option(False, "save a partitioned checkpoint at the end")
    save_every: int = option(0, "also save every K steps (0: never)")
    resume: bool = option(False, "continue from the newest committed checkpoint")
    model: str = option("tiny", "model preset", tuple(sorted(PRESETS)))
    seed: int = option(0, "seed of the model's initialisation and of every step's batch")
    new_schedule: bool = option(False, "with --resume and another --steps: decay the LR over the new --steps "
                                       "(default: keep the checkpoint's schedule, whose LR is 0 past its horizon)")
    reshard: str = option("auto", "auto: a checkpoint of another world size is converted (convert.reshard) and "
                                  "loaded universally; never: hand it to DeepSpeed's own loader as it is",
                          ("auto", "never"))
    global_batch: int = option(0, "sequences per optimizer step, shared by all ranks (0: the preset's); a resume "
                                  "keeps the checkpoint's, on any number of ranks")
    dtype: str = option("auto", "auto: bf16 on GPUs, fp32 on CPU ranks", ("auto", "fp32", "bf16"))
    deterministic: str = option("auto", "deterministic kernels, for exact resumes: torch.use_deterministic_algorithms, "
                                        "CUBLAS_WORKSPACE_CONFIG and SDPA's math backend (auto: on for GPU ranks, "
                                        "off for CPU ranks)", ("auto", "on", "off"))
    keep_last: int = option(0, "after each committed save keep only the newest K checkpoints (0: keep all)")
    on_save_error: str = option("continue", "a failed save: record it in run.json and train on, or stop every "
                                            "rank (exit 1)", ("continue", "abort"))
    collective_timeout: float | None = option(None, "seconds a collective may wait for the other ranks "
                                                    "(default: $ZCKPT_COLLECTIVE_TIMEOUT, else 600)")
    save_mode: str = option(SaveMode.COMMIT.value, "commit: the commit protocol; async: snapshot, then write and "
                                                   "commit in the background; async_process: the same, written by "
                                                   "a writer process from shared memory; plain: DeepSpeed's save "
                                                   "alone (the benchmarks' baseline); ds_python, ds_decoupled, "
                                                   "ds_fast: DeepSpeed's own checkpoint engines, no manifest or "
                                                   "commit",
                            tuple(SaveMode))
    save_16bit: bool = option(False, "after training, save DIR/gathered16/ with engine.save_16bit_model (route 1)")
    save_gathered: bool = option(False, "after training, save DIR/per_param/ gathering one parameter at a time "
                                        "(route 2)")
    persistence_threshold: int = option(0, "DeepSpeed's stage3_param_persistence_threshold: tensors of at most this "
                                           "many elements stay whole on every rank (0: every tensor is partitioned; "
                                           "DeepSpeed's default is 1e5)")
    gather_16bit: str = option("auto", "stage3_gather_16bit_weights_on_model_save (auto: on with --save_16bit); with "
                                       "off, save_16bit_model saves nothing", ("auto", "on", "off"))
    node_local_storage: bool = option(False, "each node keeps its part of every checkpoint in its own --output_dir "
                                             "(DeepSpeed's checkpoint.use_node_local_storage)")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One `--name` per field, typed from its default, with its help and choices."""
        for f in fields(cls):
            flag, meta = f"--{f.name}", f.metadata
            if f.default is MISSING:
                parser.add_argument(flag, required=True, help=meta["help"])
            elif isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", help=meta["help"])
            else:
                kind = float if f.name == "collective_timeout" else type(f.default)
                parser.add_argument(flag, type=kind, default=f.default, choices=meta["choices"], help=meta["help"])
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> TrainOptions:
        """The worker's command line, as options."""
        return cls.from_namespace(cls.add_arguments(argparse.ArgumentParser(prog="zckpt_nb.train")).parse_args(argv))

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> TrainOptions:
        """The options in a parsed namespace (which may hold other flags too, as the `train` CLI's does)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def build(cls, **options: Any) -> TrainOptions:
        """Options from keywords; an unknown name or a value outside its choices is a UsageError naming it."""
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise UsageError(f"unknown training option(s) {', '.join(unknown)}; the options are "
                             f"{', '.join(sorted(names))}")
        for name, value in options.items():
            choices, default = names[name].metadata["choices"], names[name].default
            if choices and value not in choices:
                raise UsageError(f"{name}={value!r} is not one of {', '.join(choices)}")
            kind = (int, float) if default is None or isinstance(default, float) else type(default)
            if default is not MISSING and not (value is None and default is None) and (
                    not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                expected = "number" if default is None else type(default).__name__
                raise UsageError(f"{name}={value!r}: expected a value of type {expected}")
        return cls(**options)

    def argv(self) -> list[str]:
        """The worker's flags for these options: the output folder, the steps, and every option off its default."""
        flags = ["--output_dir", str(self.output_dir), "--steps", str(self.steps)]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("output_dir", "steps") or value == f.default:
                continue
            flags += [f"--{f.name}"] + ([] if value is True else [str(value)])
        return flags
