"""claims.reshard_sentence holds each dtype's resumes to a tolerance it can meet, and says which."""

import pytest

from zckpt_nb.lessons.claims import RESUME_TOLERANCE, reshard_sentence

pytestmark = pytest.mark.fast


def rows(*diffs):
    return [{"resumed on N": n, "max |loss difference|": d, "steps compared": 3} for n, d in zip((1, 3, 4), diffs)]


def test_fp32_resumes_are_held_to_1e_4():
    assert reshard_sentence(rows(2e-6, 5e-5)).startswith("Every resumed run (1, 3 ranks) continued")
    said = reshard_sentence(rows(2e-6, 1e-2))
    assert said.startswith("1 of 2 resumed runs left") and "above the 1e-04 fp32 can meet" in said


def test_bf16_resumes_are_held_to_what_bf16_can_meet_and_the_sentence_says_so():
    assert RESUME_TOLERANCE["bf16"] > RESUME_TOLERANCE["fp32"]
    said = reshard_sentence(rows(0.0, 1e-2), "bf16")
    assert said.startswith("Every resumed run") and f"within the {RESUME_TOLERANCE['bf16']:.0e}" in said
    assert "bf16" in said
    assert "left the uninterrupted" in reshard_sentence(rows(0.0, 0.2), "bf16")
