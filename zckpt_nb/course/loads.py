"""What a ZeRO-3 `load_checkpoint` builds, reads or gathers, noted inside the rank (notebook 03).

`install()` wraps four DeepSpeed functions (once per process; the first `watched` call runs it): zero_to_fp32's read
of every rank's optimizer file, the whole fp32 state dict `get_fp32_state_dict_from_zero_checkpoint` joins from them,
the parameters a `GatheredParameters` block gathers whole, and the engine's read of its optimizer files (the paths its
`checkpoint_engine.load` opens, recorded).
`watched(call)` runs a call; during it, and only then, each wrapper notes its bytes. `largest_moment` reads Adam's
moments after a load (0 in a fresh optimizer).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

MARKS: list[dict[str, Any]] = []  # during a watched call: {"what", "bytes"} for each wrapped call (+ "files")
_WATCHING = [False]
_INSTALLED = [False]


def _mark(what: str, nbytes: int, **more: Any) -> None:
    if _WATCHING[0]:
        MARKS.append({"what": what, "bytes": int(nbytes), **more})


def install() -> None:
    """Wrap the four DeepSpeed functions a ZeRO-3 load can go through; outside `watched` they note nothing. Once per
    process: a second call does nothing."""
    if _INSTALLED[0]:
        return
    _INSTALLED[0] = True
    import deepspeed
    import deepspeed.runtime.engine as engine_module
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.utils import zero_to_fp32

    parse = zero_to_fp32.parse_optim_states
    build = engine_module.get_fp32_state_dict_from_zero_checkpoint
    read = DeepSpeedEngine._get_all_zero_checkpoint_state_dicts

    def parsed(files: list[str], *args: Any) -> Any:  # every rank's optimizer file, mapped; the masters are read
        stage, world, flat_groups, paddings = parse(files, *args)
        _mark("masters_read", sum(t.nbytes for groups in flat_groups for t in groups))  # all N files' fp32 slices
        return stage, world, flat_groups, paddings

    def built(*args: Any, **kwargs: Any) -> Any:  # the whole model in fp32, joined from every rank's files
        state = build(*args, **kwargs)
        _mark("fp32_state_dict", sum({t.data_ptr(): t.nbytes for t in state.values()}.values()))  # tied: once
        return state

    def own_file(self: Any, names: list[str]) -> Any:  # the default load: the optimizer files the engine opens
        opened, engine_load = [], self.checkpoint_engine.load

        def recording(path: str, *args: Any, **kwargs: Any) -> Any:  # the engine's file read, its path noted
            opened.append(path)
            return engine_load(path, *args, **kwargs)

        self.checkpoint_engine.load = recording
        try:
            state = read(self, names)
        finally:
            self.checkpoint_engine.load = engine_load
        _mark("own_optimizer_file", sum(os.path.getsize(path) for path in opened),
              files=[os.path.basename(path) for path in opened])
        return state

    class Gathered(GatheredParameters):  # parameters gathered whole onto every rank
        def __enter__(self) -> Any:
            entered = super().__enter__()
            if self.enabled:
                _mark("gathered", sum(p.ds_numel * p.element_size() for p in self.params))
            return entered

    zero_to_fp32.parse_optim_states = parsed  # looked up by name in zero_to_fp32 when it joins the state dict
    engine_module.get_fp32_state_dict_from_zero_checkpoint = built
    DeepSpeedEngine._get_all_zero_checkpoint_state_dicts = own_file
    deepspeed.zero.GatheredParameters = Gathered  # the name engine.py and transformers look up when they call it


def watched(call: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]]]:
    """Run `call`: what it returned, and the marks the wrapped functions noted during it (`install` first, once)."""
    install()
    MARKS.clear()
    _WATCHING[0] = True
    try:
        returned = call()
    finally:
        _WATCHING[0] = False
    return returned, list(MARKS)


def largest_moment(engine: Any) -> float:
    """The largest |value| in Adam's two moments on this rank: 0 in a fresh optimizer."""
    return max((t.abs().max().item() for state in engine.optimizer.optimizer.state.values()
                for key, t in state.items() if key in ("exp_avg", "exp_avg_sq")), default=0.0)
