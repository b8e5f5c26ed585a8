"""The weights-only allowlist knows what DeepSpeed writes (fp16's dynamic loss scaler), refuses any other type by
name, and lets a user opt in to a class they trust ($ZCKPT_TRUST), never to a function."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from zckpt_nb.convert.safeload import TRUST, load
from zckpt_nb.errors import CheckpointError

pytestmark = pytest.mark.fast


def test_fp16s_dynamic_loss_scaler_loads_weights_only(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    torch.save({"loss_scaler": DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                                     consecutive_hysteresis=False)}, tmp_path / "optim.pt")
    assert load(tmp_path / "optim.pt")["loss_scaler"].cur_scale == 2**16


def test_a_client_state_class_is_refused_by_name_until_the_user_trusts_it(tmp_path, monkeypatch):
    path = tmp_path / "model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, path)
    offered = f"outside the allowlist .*argparse.Namespace.*{TRUST}=argparse.Namespace"
    with pytest.raises(CheckpointError, match=offered):
        load(path)
    monkeypatch.setenv(TRUST, "argparse.Namespace")
    assert load(path)["args"].lr == 0.1


def test_a_function_is_never_offered_for_trust_and_a_bad_name_is_one_line(tmp_path, monkeypatch):
    class Payload:
        def __reduce__(self):
            return os.system, ("true",)

    torch.save({"x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="trusted copy") as refused:
        load(tmp_path / "evil.pt")
    assert TRUST not in str(refused.value)
    monkeypatch.setenv(TRUST, "no_such_module.Thing")
    with pytest.raises(CheckpointError, match="cannot be imported"):
        load(tmp_path / "evil.pt")
