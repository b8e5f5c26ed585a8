"""A checkpoint saved with DeepSpeed's `exclude_frozen_parameters=True` (a raw loop's tiny Llama, its input embedding
frozen, 2 CPU ranks): export and to-dcp refuse it in one line instead of writing a model whose frozen weights load
randomly initialised; `zckpt_nb.resume(..., strict=False)` resumes it; the same loop saved with its frozen weights
exports them."""

from __future__ import annotations

import json

import pytest
from conftest import cli
from safetensors.torch import load_file

from zckpt_nb.convert.inspect import excludes_frozen
from zckpt_nb.convert.safeload import load
from zckpt_nb.format.layout import MANIFEST
from zckpt_nb.run.launch import launch_module

LOOP = "zckpt_nb.examples.own_loop"
TAG = "global_step2"


def own_loop(out, *args) -> list[str]:
    log, _ = launch_module(LOOP, [str(out), *args], nproc=2, timeout=300, name=f"own loop {out}", verbose=False,
                           progress=False)
    return log


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The loop saved twice by DeepSpeed's engine.save_checkpoint: without and with its frozen weights; adopted."""
    root = tmp_path_factory.mktemp("frozen")
    for name, extra in (("excluded", ["--exclude_frozen"]), ("kept", [])):
        own_loop(root / name, "--steps", "2", "--freeze_embeddings", *extra)
        assert cli("adopt", root / name).returncode == 0
    return root


def test_deepspeed_marks_a_save_without_frozen_weights(saved):
    states = {name: load(saved / name / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt") for name in
              ("excluded", "kept")}
    assert excludes_frozen(states["excluded"]) and not excludes_frozen(states["kept"])
    assert "model.embed_tokens.weight" in states["kept"]["frozen_param_shapes"]


def test_inspect_and_adopt_count_the_frozen_parameters_or_say_they_were_not_saved(saved):
    kept, excluded = (cli("inspect", saved / name).stdout.splitlines()[0] for name in ("kept", "excluded"))
    embedding = 256 * 64  # the loop's vocabulary x width
    assert f"plus {embedding:,} frozen parameters" in kept and "frozen weights not saved" in excluded, (kept, excluded)
    facts = {name: json.loads((saved / name / TAG / MANIFEST).read_text())["adopted"] for name in ("kept", "excluded")}
    assert facts["kept"]["frozen_params"] == embedding and not facts["kept"]["frozen_excluded"]
    assert facts["excluded"]["frozen_params"] == 0 and facts["excluded"]["frozen_excluded"]


@pytest.mark.parametrize("command", ["export", "to-dcp"])
def test_export_and_to_dcp_refuse_a_model_missing_its_frozen_weights(saved, tmp_path, command):
    done = cli(command, saved / "excluded", tmp_path / "out")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "exclude_frozen_parameters=True" in lines[0] and "model.embed_tokens.weight" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_the_same_loop_saved_with_its_frozen_weights_exports_them(saved, tmp_path):
    assert cli("export", saved / "kept", tmp_path / "hf").returncode == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and weights["model.embed_tokens.weight"].abs().sum() > 0


def test_resume_with_strict_false_continues_a_save_without_frozen_weights(saved):
    log = own_loop(saved / "excluded", "--steps", "3", "--freeze_embeddings", "--exclude_frozen", "--resume")
    assert sum("resumed at step 2" in line for line in log) == 2, log
    assert sum("step 3 loss" in line for line in log) == 2, log
