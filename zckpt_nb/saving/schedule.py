"""The learning-rate schedule across a resume. DeepSpeed saves `WarmupDecayLR`'s position, not its horizon (`--steps`):
a resume with other `--steps` would silently rebuild the schedule. The horizon goes into the client state instead; a
resume keeps it (past it the LR is 0) unless `--new_schedule` asks for the new one."""

from __future__ import annotations

from pathlib import Path

from zckpt_nb.convert.safeload import load
from zckpt_nb.format.client_state import CLIENT_KEY
from zckpt_nb.format.records import Schedule


def saved_horizon(load_dir: str | Path, tag: str) -> int | None:
    """The schedule horizon in a checkpoint's client state; None if absent."""
    states = load(min((Path(load_dir) / tag).glob("zero_pp_rank_*_mp_rank_00_model_states.pt")), mmap=True)
    return states.get(CLIENT_KEY, {}).get("steps")


def resume_schedule(steps: int, saved: int | None, new: bool) -> Schedule:
    """The schedule a resume trains with: its horizon and the checkpoint's."""
    return Schedule(steps if new or saved is None else saved, saved, new)
