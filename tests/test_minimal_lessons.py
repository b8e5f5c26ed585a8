"""Notebook 03's helper: what each load restored."""

from __future__ import annotations

import pytest

from zckpt_nb.lessons import contents

pytestmark = pytest.mark.fast


def test_restored_compares_each_load_with_the_run_that_saved():
    saved = {"adam_step": 2, "lr": 0.003, "global_steps": 2, "exp_avg_abs_sum": 1.0}
    fresh = {"adam_step": 0, "lr": 0.0, "global_steps": 0, "exp_avg_abs_sum": 0.0}
    loads = {"saved": saved, **{name: {**saved, "trainable_max_diff": 0.0, "frozen_max_diff": 0.0}
                                for name in contents.LOADS}}
    loads["frozen_excluded"]["frozen_max_diff"] = 0.1
    loads["load_module_only=True"] |= {**fresh, "trainable_max_diff": 0.2}
    grid = contents.restored(loads)
    assert grid["frozen"] == dict.fromkeys(contents.PARTS, True)
    assert grid["frozen_excluded"]["frozen weights"] is False and grid["frozen_excluded"]["trainable weights"]
    assert grid["full resume"]["frozen weights"] is None  # that model froze nothing
    assert not any(grid["load_module_only=True"][p] for p in ("trainable weights", "Adam's state", "LR schedule"))
    warm = contents.load_label(contents.WARM_START, ",\n")  # the row names both switches: why its LR is not back
    assert "load_lr_scheduler_states=False" in warm and grid[warm]["LR schedule"]
