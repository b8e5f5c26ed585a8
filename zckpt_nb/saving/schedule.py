"""The learning-rate schedule across a resume: the horizon is stored in the checkpoint, and a change is said aloud.

The package trains with DeepSpeed's `WarmupDecayLR`, whose horizon (`total_num_steps`) comes from `--steps`. DeepSpeed
saves only the scheduler's position (`last_batch_iteration`), not its horizon, so `--resume --steps 300` on a
checkpoint of a 150-step run would silently rebuild the schedule over 300 steps: the LR jumps at the resume step.
Here the horizon goes into the client state; a resume keeps it by default (past it `WarmupDecayLR` gives 0), and
`--new_schedule` opts into the new one. Either way one line says what happens, with the LR before and after.
"""

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
    """The schedule horizon in a checkpoint's client state (read weights-only); None if absent.

    Every rank's model-states file holds the same horizon; read whichever is here (with node-local storage a node
    holds only its own ranks' files).
    """
    states = load(min((Path(load_dir) / tag).glob("zero_pp_rank_*_mp_rank_00_model_states.pt")), mmap=True)
    return states.get(CLIENT_KEY, {}).get("steps")


def resume_schedule(model: str, steps: int, start: int, saved: int | None, new: bool) -> Schedule:
    """The horizon a resume trains with, and its record: both horizons and the LRs around the resume step.

    The first resumed step trains at the LR restored with the optimizer (the old schedule's); the scheduler DeepSpeed
    rebuilt from the config sets the next one, so a new horizon shows from step `start + 1`.
    """
    horizon = steps if new or saved is None else saved
    old = saved or steps
    return Schedule(horizon, saved, new, start, lr_restored=lr_at(model, start, old),
                    lr_next_old=lr_at(model, start + 1, old), lr_next_new=lr_at(model, start + 1, steps))


def describe_schedule(plan: Schedule, steps: int) -> str | None:
    """One line when --steps differs from the checkpoint's horizon: what happens to the LR (None otherwise)."""
    old, start = plan.checkpoint_horizon, plan.resume_step
    if old is None or old == steps:
        return None
    lrs = (f"step {start} trains at {plan.lr_restored:.3g} (restored with the optimizer), step {start + 1} at "
           f"{plan.lr_next_old:.3g} on the old schedule or {plan.lr_next_new:.3g} on the new")
    if plan.new_schedule:
        return f"--new_schedule: the LR now decays over {steps} steps instead of {old}; {lrs}"
    return (f"--steps {steps} but the checkpoint's LR schedule ends at step {old}: continuing it (the LR is 0 from "
            f"step {old + 1} on); {lrs}; pass --new_schedule to decay over {steps} steps")
