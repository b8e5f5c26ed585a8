"""One way in for every save: `Checkpointer.save`, and `save`, `wait` and `resume` for a training loop of your own.

Every rank calls `save` (under ZeRO-3 `save_checkpoint` is collective: the seed's `if rank == 0:` around it hangs);
what one process alone should do, the folder and the tokenizer, the folder's writer does in the preflight. The mode
is a `SaveMode` (as torchtitan's `CheckpointManager.save` takes an `AsyncMode`), or a `Route` run in the ranks.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError
from zckpt_nb.format.layout import ADAPTER_CONFIG, SHARED_FILES, UNIVERSAL, tag_for, writes_folder
from zckpt_nb.format.records import Route, SaveMode, SaveOutcome
from zckpt_nb.format.writer import skip_crc32
from zckpt_nb.saving import rotation
from zckpt_nb.saving.async_save import AsyncSaver
from zckpt_nb.saving.collective import timeout_seconds
from zckpt_nb.saving.commit import prepare_folder, save_committed
from zckpt_nb.saving.engine import install
from zckpt_nb.saving.process_writer import ProcessWriter
from zckpt_nb.saving.resume import agreed_resume_tag, load_verified, universal_copy
from zckpt_nb.saving.routes import save_gathered16, save_per_param

ROUTE_SAVES = {Route.GATHERED16: save_gathered16, Route.PER_PARAM: save_per_param}  # the routes run in the ranks
PENDING_KEY = "zckpt_pending_micro_batches"  # the client state's record of a save made mid-accumulation


def adapter(engine: Any) -> Any:
    """The peft config of a peft-wrapped model (its LoRA adapter's), else None."""
    configs = getattr(engine.module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


def write_shared(engine: Any, tokenizer: Any, folder: str) -> None:
    """What rank 0 writes beside the checkpoints: tokenizer, config.json, and a peft adapter_config.json."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    config = getattr(engine.module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(folder)
    peft = adapter(engine)
    if peft is not None:
        peft.save_pretrained(folder)


class Checkpointer:
    """Every save mode behind one call; build one and call `save` on every rank at the same steps."""

    def __init__(self, engine: Any, output_dir: str | Path, *, mode: str = SaveMode.COMMIT, tokenizer: Any = None,
                 keep_last: int = 0, identity: dict[str, Any] | None = None,
                 collective_timeout: float | None = None) -> None:
        if mode not in [*SaveMode, *ROUTE_SAVES]:
            raise UsageError(f"save mode {mode!r} is not one of {', '.join([*SaveMode, *ROUTE_SAVES])}")
        self.engine, self.output_dir, self.tokenizer = engine, Path(output_dir), tokenizer
        self.mode = Route(mode) if mode in ROUTE_SAVES else SaveMode(mode)  # a Route runs in the ranks
        self.keep_last, self.identity = keep_last, identity or {}
        install(engine)  # the package's checkpoint engine, given to DeepSpeed once
        if isinstance(self.mode, SaveMode) and self.mode.durable:
            skip_crc32()  # each file is hashed as it is written (format.writer)
        self.saver = None
        if self.mode in (SaveMode.ASYNC, SaveMode.ASYNC_PROCESS):
            # the writer process writes torch's zip format where DeepSpeed's torch engine does (its config's default)
            zipfile = getattr(install(engine).inner, "zipfile_serialization", True)
            process = ProcessWriter(zipfile) if self.mode == SaveMode.ASYNC_PROCESS else None
            self.saver = AsyncSaver(engine, output_dir, self.identity, keep_last=keep_last,
                                    timeout_s=timeout_seconds(collective_timeout), process=process)

    def save(self, step: int, client_state: dict[str, Any] | None = None) -> SaveOutcome:
        """Save at `step` with `client_state` on every rank; a failed write sets `.committed` False, no raise."""
        state, tag, engine = dict(client_state or {}), tag_for(step), self.engine
        # micro-batches trained since the engine's last optimizer step: their gradients are in no checkpoint
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        pending = engine.micro_steps % engine.gradient_accumulation_steps() if managed else 0
        if pending:  # in the checkpoint (resume hands it back), in the outcome, and said once on rank 0
            state[PENDING_KEY] = pending
            if engine.global_rank == 0:
                warnings.warn(f"{tag}: saved after {pending} of {engine.gradient_accumulation_steps()} "
                              f"micro-batches of optimizer step {engine.global_steps + 1}; their gradients are "
                              "not saved, so a resume trains them again (save right after the engine.step() that "
                              "ends an accumulation)", stacklevel=2)
        return replace(self.saved(step, tag, state), pending_micro_batches=pending)

    def saved(self, step: int, tag: str, state: dict[str, Any]) -> SaveOutcome:
        """The save itself, in this checkpointer's mode."""
        start = time.perf_counter()
        if self.mode in ROUTE_SAVES:
            ROUTE_SAVES[self.mode](self.engine, self.output_dir)
            return SaveOutcome(self.mode, step, True, seconds=time.perf_counter() - start)
        if self.saver:
            self.saver.finish()  # at most one in flight (the worker has already waited, and reported it)
            return self.saver.save(tag, state, step, self.preparation(tag))
        if self.mode != SaveMode.COMMIT:  # DeepSpeed's save alone: no fsync, no hash, no manifest; rank 0 moves latest
            self.engine.save_checkpoint(str(self.output_dir), tag=tag, client_state=state)
            seconds = time.perf_counter() - start
            return SaveOutcome(tag, step, True, seconds=seconds, timings={"write": seconds})
        outcome = save_committed(self.engine, self.output_dir, tag, state, step=step, identity=self.identity,
                                 prepare=self.preparation(tag))
        if outcome.committed and self.keep_last:  # the same on every rank, so every rank joins rotation's gather
            rotation.after_commit(self.output_dir, self.keep_last, outcome, self.engine.use_node_local_storage())
        return outcome

    def poll(self) -> SaveOutcome | None:
        """At a step boundary: an asynchronous save's outcome once its background commit is done, else None."""
        return self.saver.poll() if self.saver else None

    def finish(self) -> SaveOutcome | None:
        """Wait for the asynchronous save in flight, if any; its outcome."""
        return self.saver.finish() if self.saver else None

    def preparation(self, tag: str) -> Any:
        """What the folder's writer does before a save (the folder, the tokenizer and config once); None elsewhere."""
        if not writes_folder(self.engine.use_node_local_storage()):
            return None
        wanted = {"config.json", *(SHARED_FILES[:2] if self.tokenizer is not None else ()),
                  *((ADAPTER_CONFIG,) if adapter(self.engine) is not None else ())}
        shared = tuple(name for name in SHARED_FILES if name in wanted)
        return partial(prepare_folder, self.output_dir, tag, partial(write_shared, self.engine, self.tokenizer),
                       shared)


_OPEN: dict[tuple[int, str, str], Checkpointer] = {}  # save()'s checkpointers: an async save outlives its call


def save(engine: Any, output_dir: str | Path, *, step: int | None = None, mode: str = SaveMode.COMMIT,
         tokenizer: Any = None, client_state: dict[str, Any] | None = None, keep_last: int = 0,
         identity: dict[str, Any] | None = None, collective_timeout: float | None = None) -> SaveOutcome:
    """Save a ZeRO-3 checkpoint of `engine` from every rank (default step: the engine's `global_steps`)."""
    key = (id(engine), str(Path(output_dir).resolve()), mode)
    if key not in _OPEN or _OPEN[key].engine is not engine:
        _OPEN[key] = Checkpointer(engine, output_dir, mode=mode, tokenizer=tokenizer, keep_last=keep_last,
                                  identity=identity, collective_timeout=collective_timeout)
    return _OPEN[key].save(engine.global_steps if step is None else step, client_state)


def wait(engine: Any) -> list[SaveOutcome]:
    """Every rank: finish the asynchronous saves `save` started for `engine`; their outcomes."""
    done = [c.finish() for key, c in _OPEN.items() if key[0] == id(engine)]
    return [outcome for outcome in done if outcome is not None]


def resume(engine: Any, output_dir: str | Path, tag: str | None = None, *, strict: bool = True) -> dict[str, Any]:
    """Every rank: load the newest committed checkpoint (or `tag`), verified; returns the client state."""
    if engine.load_universal_checkpoint():
        tag, _, _ = universal_copy(output_dir, None, tag=tag)
        return load_verified(engine, Path(output_dir) / UNIVERSAL, tag, restore_rng=False, strict=strict)
    tag = agreed_resume_tag(output_dir, None, tag)[0]  # an explicit tag is verified too
    return load_verified(engine, output_dir, tag, strict=strict)
