"""Deterministic kernels for exact resumes: the option's plumbing from launch() to the worker and its record."""

import pytest

from zckpt_nb.errors import UsageError
from zckpt_nb.run.options import TrainOptions
from zckpt_nb.train import set_determinism

pytestmark = pytest.mark.fast


def test_the_option_reaches_the_worker_command_line_and_back(tmp_path):
    opts = TrainOptions.build(output_dir=str(tmp_path), deterministic="on")
    assert "--deterministic" in opts.argv() and TrainOptions.parse(opts.argv()).deterministic == "on"
    assert "--deterministic" not in TrainOptions.build(output_dir=str(tmp_path)).argv()  # auto: the default
    with pytest.raises(UsageError, match="deterministic='yes' is not one of auto, on, off"):
        TrainOptions.build(output_dir=str(tmp_path), deterministic="yes")


def test_auto_is_off_on_cpu_ranks_and_on_enforces_it(monkeypatch):
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert set_determinism("auto", "cpu").startswith("not enforced")
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        said = set_determinism("on", "cpu")
        assert torch.are_deterministic_algorithms_enabled() and said.startswith("deterministic (--deterministic on)")
        assert "SDPA" not in said  # the GPU's settings are named only where they were made
    finally:
        torch.use_deterministic_algorithms(False)
