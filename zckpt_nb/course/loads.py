"""What a ZeRO-3 `load_checkpoint` builds or reads, and how far it raises the heap, measured inside the rank.

`install()` wraps three DeepSpeed functions (once per process, before the engines are built): the whole fp32 state
dict `get_fp32_state_dict_from_zero_checkpoint` joins from every rank's files, the parameters a `GatheredParameters`
block gathers whole, and the engine's read of this rank's own optimizer file. `watched(call)` runs a call while a thread
samples the heap (`meters.heap_in_use`) every millisecond; during it, and only then, each wrapper notes its bytes and
the heap at that moment. `largest_moment` reads Adam's moments after a load (0 in a fresh optimizer).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from zckpt_nb.measure.meters import heap_in_use

MARKS: list[dict[str, Any]] = []  # during a watched call: {"what", "bytes", "heap"} for each wrapped call
_START: dict[str, int | None] = {"heap": None}  # the heap when the watched call began; None outside one


def _mark(what: str, nbytes: int) -> None:
    if _START["heap"] is not None:
        MARKS.append({"what": what, "bytes": int(nbytes), "heap": (heap_in_use() or 0) - _START["heap"]})


def install() -> None:
    """Wrap the three DeepSpeed functions a ZeRO-3 load can go through; outside `watched` they note nothing."""
    import deepspeed
    import deepspeed.runtime.engine as engine_module
    import torch.distributed as dist
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    build = engine_module.get_fp32_state_dict_from_zero_checkpoint
    read = DeepSpeedEngine._get_all_zero_checkpoint_state_dicts

    def built(*args: Any, **kwargs: Any) -> Any:  # the whole model in fp32, joined from every rank's files
        state = build(*args, **kwargs)
        _mark("fp32_state_dict", sum({t.data_ptr(): t.nbytes for t in state.values()}.values()))  # tied: once
        return state

    def own_file(self: Any, names: list[str]) -> Any:  # the default load: this rank's own optimizer file
        state = read(self, names)
        _mark("own_optimizer_file", os.path.getsize(names[dist.get_rank()]))
        return state

    class Gathered(GatheredParameters):  # parameters gathered whole onto every rank
        def __enter__(self) -> Any:
            entered = super().__enter__()
            if self.enabled:
                _mark("gathered", sum(p.ds_numel * p.element_size() for p in self.params))
            return entered

    engine_module.get_fp32_state_dict_from_zero_checkpoint = built
    DeepSpeedEngine._get_all_zero_checkpoint_state_dicts = own_file
    deepspeed.zero.GatheredParameters = Gathered  # the name engine.py and transformers look up when they call it


def watched(call: Callable[[], Any]) -> tuple[Any, int, list[dict[str, Any]]]:
    """Run `call`: what it returned, the highest heap rise above its start (sampled every millisecond, and read at
    each mark), and the marks the wrapped functions noted during it."""
    MARKS.clear()
    _START["heap"] = start = heap_in_use() or 0
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], (heap_in_use() or 0) - start)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        returned = call()
    finally:
        done.set()
        sampler.join()
        _START["heap"] = None
    return returned, max([peak[0]] + [m["heap"] for m in MARKS]), list(MARKS)


def largest_moment(engine: Any) -> float:
    """The largest |value| in Adam's two moments on this rank: 0 in a fresh optimizer."""
    return max((t.abs().max().item() for state in engine.optimizer.optimizer.state.values()
                for key, t in state.items() if key in ("exp_avg", "exp_avg_sq")), default=0.0)
