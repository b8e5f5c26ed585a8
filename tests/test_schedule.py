"""Resuming with another --steps: the LR schedule's horizon is stored, kept by default, replaced on request."""

from __future__ import annotations

import pytest
from conftest import STEPS

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.model import ds_config
from zckpt_nb.run.launch import launch

LONGER = STEPS + 20


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


@pytest.fixture(scope="module", params=[False, True], ids=["keep", "new_schedule"])
def extended(request, full_run, tmp_path_factory):
    """The session's 150-step run resumed from its last checkpoint to 170 steps, with or without --new_schedule."""
    folder = copy_checkpoint(full_run.output_dir, tmp_path_factory.mktemp("extended"), f"global_step{STEPS}")
    return launch(2, LONGER, folder, resume=True, new_schedule=request.param, verbose=False, progress=False,
                  timeout=600)


def test_every_step_trains_at_the_lr_deepspeeds_scheduler_gives(full_run, extended):
    plan = extended.schedule
    new = plan.new_schedule
    assert [round(x, 12) for x in full_run.lrs] == \
        [round(lr_at("tiny", s, STEPS), 12) for s in full_run.steps]
    horizon = LONGER if new else STEPS
    assert (plan.checkpoint_horizon, plan.horizon, extended.resumed_from_step) == (STEPS, horizon, STEPS)
    first, *rest = zip(extended.steps, extended.lrs)
    assert first[1] == pytest.approx(lr_at("tiny", STEPS, STEPS))  # restored with the optimizer
    assert all(lr == pytest.approx(lr_at("tiny", s, horizon), abs=1e-12) for s, lr in rest)
    assert (max(lr for _, lr in rest) > 0) == new, "past its horizon the kept schedule's LR is 0"


def test_the_change_is_said_in_one_line(extended):
    [line] = [text for text in extended.log if "LR schedule" in text or "--new_schedule:" in text]
    assert ("--new_schedule:" in line) == extended.schedule.new_schedule
    assert f"{STEPS}" in line and f"{LONGER}" in line


def test_a_resume_with_the_same_steps_says_nothing(resumed_run):
    assert resumed_run.schedule.checkpoint_horizon == STEPS
    assert not any("LR schedule" in text or "--new_schedule" in text for text in resumed_run.log)
