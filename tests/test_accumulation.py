"""A save in the middle of gradient accumulation (issue 36, item 6): a user's loop with gradient_accumulation_steps
2 saves through zckpt_nb.save after 3 micro-batches, one past an optimizer step. DeepSpeed's checkpoint holds the
state after that step only; the save says so once, records it in the outcome and the client state, and a save on an
accumulation boundary says nothing."""

from __future__ import annotations

from zckpt_nb.convert.safeload import load
from zckpt_nb.run.launch import launch_module
from zckpt_nb.saving.api import PENDING_KEY

LOOP = "zckpt_nb.examples.own_loop"


def own_loop(out, *args: str) -> list[str]:
    return launch_module(LOOP, [str(out), "--save", "zckpt", "--accumulation", "2", *args], nproc=2, timeout=300,
                         name="own loop", verbose=False, progress=False)[0]


def client_state(out, tag: str) -> dict:
    return load(out / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")


def test_a_save_mid_accumulation_says_what_it_left_out(tmp_path):
    lines = own_loop(tmp_path / "mid", "--steps", "3")
    said = [line for line in lines if "micro-batches of optimizer step" in line]
    assert len(said) == 1 and "saved after 1 of 2 micro-batches of optimizer step 2" in said[0], lines
    assert sum("committed True" in line for line in lines) == 2, lines
    state = client_state(tmp_path / "mid", "global_step3")
    assert state[PENDING_KEY] == 1 and state["global_steps"] == 1  # one optimizer step in the saved state


def test_a_save_on_an_accumulation_boundary_says_nothing(tmp_path):
    lines = own_loop(tmp_path / "edge", "--steps", "4")
    assert not any("micro-batches" in line for line in lines), lines
    assert PENDING_KEY not in client_state(tmp_path / "edge", "global_step4")
