"""The learning-rate schedule across a resume. DeepSpeed saves `WarmupDecayLR`'s position, not its horizon (`--steps`):
a resume with other `--steps` would silently rebuild the schedule. The horizon goes into the client state instead; a
resume keeps it (past it the LR is 0) unless `--new_schedule` asks for the new one."""

from __future__ import annotations

from pathlib import Path

from zckpt_nb.convert.safeload import load
from zckpt_nb.format.client_state import CLIENT_KEY
from zckpt_nb.format.records import Schedule
from zckpt_nb.model import ds_config


def lr_at(model: str, step: int, horizon: int) -> float:
    """The LR that DeepSpeed's WarmupDecayLR, configured as `model.ds_config` does, uses at optimizer step `step`."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    from deepspeed.utils import logger

    params = ds_config(model, steps=horizon)["scheduler"]["params"]
    optimizer = torch.optim.SGD([torch.zeros(1)], lr=params["warmup_max_lr"])
    level = logger.level
    logger.setLevel("ERROR")  # step 0 makes it warn that it has not started, which is what step 0 means
    try:
        return WarmupDecayLR(optimizer, last_batch_iteration=step - 1, **params).get_lr()[0]  # init steps to `step`
    finally:
        logger.setLevel(level)


def saved_horizon(load_dir: str | Path, tag: str) -> int | None:
    """The schedule horizon in a checkpoint's client state; None if absent."""
    states = load(min((Path(load_dir) / tag).glob("zero_pp_rank_*_mp_rank_00_model_states.pt")), mmap=True)
    return states.get(CLIENT_KEY, {}).get("steps")


def resume_schedule(model: str, steps: int, start: int, saved: int | None, new: bool) -> Schedule:
    """The schedule a resume trains with: both horizons and the LRs around the resume step."""
    horizon = steps if new or saved is None else saved
    old = saved or steps
    return Schedule(horizon, saved, new, start, lr_restored=lr_at(model, start, old),
                    lr_next_old=lr_at(model, start + 1, old), lr_next_new=lr_at(model, start + 1, steps))
