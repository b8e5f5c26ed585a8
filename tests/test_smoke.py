"""The fast tier's one real run (`make test-fast`): 2 CPU ranks train, save through the commit protocol, resume."""

from __future__ import annotations

import pytest

from zckpt_nb.convert.verify import verify
from zckpt_nb.format.layout import committed_tags, latest_name
from zckpt_nb.run.launch import launch

pytestmark = pytest.mark.fast


def test_two_ranks_train_commit_and_resume_exactly(tmp_path):
    whole = launch(2, 4, tmp_path / "whole", save_every=2, verbose=False, progress=False, timeout=300)
    assert committed_tags(whole.output_dir) == ["global_step2", "global_step4"]
    assert verify(whole.output_dir).world_size == 2  # every size and SHA-256 matches its manifest
    half = launch(2, 2, tmp_path / "half", save_every=2, verbose=False, progress=False, timeout=300)
    resumed = launch(2, 4, half.output_dir, resume=True, save_checkpoint=True, verbose=False, progress=False,
                     timeout=300)
    assert resumed.steps == [2, 3] and latest_name(resumed.output_dir) == "global_step4"
    assert resumed.losses == pytest.approx(whole.losses[2:], abs=1e-6)  # the same steps, as if never stopped
