"""What the package records, typed: the save modes and routes, one save's outcome and cost, and `run.json`.

`RunRecord.write` and `RunRecord.read` are the only places `run.json` is written and read; `format` is its version.
"""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError
from zckpt_nb.format.disk import atomic_write

RUN_JSON, RUN_FORMAT = "run.json", "zckpt-run/1"


class SaveMode(StrEnum):
    """How a training checkpoint is written (`Checkpointer(mode=...)`, `--save_mode`)."""

    COMMIT = "commit"  # the commit protocol: hashed, fsynced, agreed by every rank, a manifest written last
    ASYNC = "async"  # a host snapshot during the call; the write and the commit in a background thread
    ASYNC_PROCESS = "async_process"  # a shared-memory snapshot; the write in a writer process, the commit in a thread
    PLAIN = "plain"  # DeepSpeed's save_checkpoint alone: no fsync, no hash, no manifest
    DS_PYTHON = "ds_python"  # DeepSpeed's own checkpoint engines, chosen by its config (no manifest either)
    DS_DECOUPLED = "ds_decoupled"
    DS_FAST = "ds_fast"

    @property
    def durable(self) -> bool:
        """Whether a save in this mode is on disk, complete and resumable once it returns committed."""
        return self in (SaveMode.COMMIT, SaveMode.ASYNC, SaveMode.ASYNC_PROCESS)


class Route(StrEnum):
    """Where a model's weights come from: the partitioned save itself, or one of four consolidated routes."""

    PARTITIONED = "partitioned"  # every rank's own files: what a resume reads
    GATHERED16 = "gathered16"  # engine.save_16bit_model, in the ranks
    PER_PARAM = "per_param"  # one parameter gathered at a time, in the ranks
    OFFLINE = "offline"  # DeepSpeed's zero_to_fp32 after training, in one process
    HF = "hf"  # the Hugging Face export after training, in one process


class Record:
    """A dataclass that reads back from its JSON; `record["name"]` reads a field too (old run.json code)."""

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The record `data` holds (as `to_dict` wrote it); keys it does not know are left out."""
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: typed(hints[f.name], data[f.name]) for f in fields(cls) if f.name in data})


def typed(hint: Any, value: Any) -> Any:
    """`value` read from JSON as `hint` says: a record, or a list of records, is rebuilt; anything else is kept."""
    for kind in (hint, *typing.get_args(hint)):  # X, X | None, list[X]
        if isinstance(kind, type) and issubclass(kind, Record):
            if isinstance(value, dict):
                return kind.from_dict(value)
            if isinstance(value, list):
                return [kind.from_dict(item) for item in value]
    return value


@dataclass
class SaveOutcome(Record):
    """What one save did: the same on every rank, but for the figures of this rank's own files."""

    tag: str
    step: int
    committed: bool
    error: str | None = None  # one line: which rank, what failed, where (the same on every rank)
    seconds: float = 0.0  # the save call; for an asynchronous save, until its background commit
    timings: dict[str, float] = field(default_factory=dict)  # snapshot, write, fsync, hash, protocol (seconds)
    deleted: list[str] = field(default_factory=list)  # the tags --keep_last removed after the commit
    rotation_error: str | None = None  # what --keep_last could not delete; the commit stands regardless
    estimated_bytes: int = 0  # the preflight's prediction of this rank's files
    snapshot_bytes: int = 0  # asynchronous: host memory this rank's copy takes (kept for its next save)
    pinned_bytes: int | None = None  # asynchronous on GPU ranks: pinned host memory held after the snapshot
    durable_at: float | None = None  # asynchronous: time.perf_counter() of this process at the commit
    pending_micro_batches: int = 0  # trained since the last optimizer step: not in the checkpoint

    @property
    def in_flight(self) -> bool:
        """An asynchronous save still being written: neither committed nor failed yet."""
        return not self.committed and self.error is None


@dataclass
class SaveRecord(SaveOutcome):
    """One save in run.json: its outcome, how long it stopped training, how long until it was durable."""

    started_at: float = 0.0  # seconds since the training loop began on this rank
    stall_seconds: float | None = None  # from the save call to the start of the next step (or the loop's end)
    durable_seconds: float | None = None  # from the save call to the commit; None: not durable, or failed
    commit_wait_seconds: float = 0.0  # DeepSpeed's decoupled engine: how long a later step waited for its writer


@dataclass
class Failure(Record):
    """A save, or the rotation after it, that failed: the checkpoint's tag and step, and the error line."""

    tag: str
    step: int
    error: str


@dataclass
class SaveCost(Record):
    """What one save or route cost on one rank, measured (`measure.meters.measure`; predicted: `plan.costs`)."""

    mode: str  # a Route
    rank: int
    seconds: float
    peak_memory_bytes: int  # host RSS: the process's peak while saving (the kernel's VmHWM)
    extra_peak_bytes: int  # host RSS: that peak minus what the process held when the save began
    bytes_written: int  # sizes of the files this rank wrote, read from disk
    comm_bytes: int | None  # DeepSpeed's logged message bytes (None: a process group without the logger)
    comm_ops: dict[str, dict[str, int]] = field(default_factory=dict)  # op -> {'count', 'bytes', 'max_bytes'}
    heap_extra_peak_bytes: int | None = None  # host heap allocations at their peak, above the start (glibc only)
    cuda_peak_bytes: int | None = None  # CUDA allocated at its peak while saving; None on CPU ranks
    cuda_extra_peak_bytes: int | None = None  # that peak minus what was allocated when the save began
    pinned_host_bytes: int | None = None  # pinned host memory torch's caching allocator holds after the save
    bytes_read: int = 0  # the checkpoint files a route read (offline conversion, HF export)
    protocol_comm_ops: int = 0  # the commit protocol's object collectives (DeepSpeed's logger does not see them)
    protocol_comm_bytes: int = 0  # their pickled payload, as every rank holds it after the call
    files: list[str] = field(default_factory=list)


@dataclass
class Schedule(Record):
    """The LR schedule's horizon and, across a resume, the checkpoint's horizon."""

    horizon: int
    checkpoint_horizon: int | None = None  # the horizon the checkpoint was trained with
    new_schedule: bool = False  # --new_schedule: decay over this run's --steps instead


@dataclass
class RankRecord(Record):
    """One rank's part of run.json: its memory peaks, its saves, its steps' start times and its files."""

    rank: int
    peak_memory_bytes: int = 0  # host RSS over the whole run
    cuda_peak_bytes: int | None = None
    pinned_host_bytes: int | None = None
    save_seconds: float = 0.0  # all its save calls
    saves: list[SaveRecord] = field(default_factory=list)
    step_starts: list[float] = field(default_factory=list)  # seconds since the loop began
    loop_seconds: float = 0.0  # when the loop ended, on the same clock
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, bytes} of its files in the newest checkpoint
    held: dict[str, int] = field(default_factory=dict)  # parameter elements held: owned, persistent(_tensors)


@dataclass
class RunRecord(Record):
    """run.json: a training run's set-up, every step's loss and LR, every save and every rank's record."""

    world_size: int
    backend: str
    device: str
    model: str
    num_params: int
    vocab_size: int
    steps: list[int]
    losses: list[float]
    ranks: list[RankRecord]
    format: str = RUN_FORMAT
    worker: str = "zero3"  # or "fsdp2"
    lrs: list[float] = field(default_factory=list)
    dtype: str = "fp32"
    seed: int = 0
    deterministic: str = ""  # whether the kernels were deterministic, and how
    global_batch: int = 0
    gradient_accumulation_steps: int = 1
    tokenizer_vocab_size: int = 0
    persistence_threshold: int = 0
    save_mode: str = SaveMode.COMMIT
    resumed_from_step: int | None = None
    resharded: dict[str, Any] | None = None  # the universal copy's manifest, when the world size changed
    schedule: Schedule | None = None
    latest_tag: str | None = None
    failed_saves: list[Failure] = field(default_factory=list)
    rotation_errors: list[Failure] = field(default_factory=list)
    save_costs: list[SaveCost] = field(default_factory=list)  # every rank's saves and routes
    ds_config: dict[str, Any] = field(default_factory=dict)
    wall_seconds: float = 0.0

    def write(self, folder: str | Path) -> None:
        """Write `folder/run.json` atomically: never half a file."""
        atomic_write(Path(folder) / RUN_JSON, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def read(cls, folder: str | Path) -> RunRecord:
        """The run.json in `folder`; UsageError for a record of another format."""
        data = json.loads((Path(folder) / RUN_JSON).read_text())
        if data.get("format", RUN_FORMAT) != RUN_FORMAT:
            raise UsageError(f"{Path(folder) / RUN_JSON} is a {data['format']} record; this zckpt_nb reads "
                             f"{RUN_FORMAT}: run the job again")
        return cls.from_dict(data)
