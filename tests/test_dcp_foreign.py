"""from-dcp on DCP checkpoints zckpt_nb did not write: a plain FSDP2 `dcp.save` of `get_state_dict` (nested and
flattened) and a torchtitan-style step folder, written by tests/foreign_dcp_writer.py on 2 CPU ranks; and the round
trip to-dcp -> from-dcp of an adopted checkpoint. Weights, Adam's moments and step compared exactly."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import cli
from conftest import refused as refused_line

from zckpt_nb.format.layout import universal_dir
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.run.launch import launch_module

WRITER = Path(__file__).with_name("foreign_dcp_writer.py")
RESUMER = Path(__file__).with_name("foreign_dcp_resume.py")
STEP = 3


refused = partial(refused_line, code=1)  # from-dcp's refusals exit 1


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The writer's checkpoints, config and reference (plain PyTorch under torchrun, 2 gloo ranks)."""
    out = tmp_path_factory.mktemp("foreign_dcp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WRITER), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(written: Path) -> dict:
    """What the writer's model and AdamW held when it saved (full state dicts by parameter FQN)."""
    return torch.load(written / "reference.pt", weights_only=False)


def universal_state(out: Path) -> tuple[dict, dict]:
    """From-dcp's output as DeepSpeed's universal load reads it: per parameter its fp32 weights and moments (flat),
    and the optimizer state file (step, param group)."""
    zero = universal_dir(out, f"global_step{STEP}") / "zero"
    tensors = {p.name: {k: torch.load(p / f"{k}.pt") for k in ("fp32", "exp_avg", "exp_avg_sq")}
               for p in zero.iterdir() if p.is_dir()}
    return tensors, torch.load(zero / "optimizer_state.pt", weights_only=False)


def assert_same_training_state(out: Path, reference: dict) -> None:
    """Every weight and both moments equal the writer's to the bit; the step, the LR and the betas are kept."""
    tensors, optim = universal_state(out)
    assert sorted(tensors) == sorted(reference["model"])
    for name, weight in reference["model"].items():
        state = reference["optim"]["state"][name]
        assert torch.equal(tensors[name]["fp32"], weight.flatten()), name
        assert all(torch.equal(tensors[name][m], state[m].flatten()) for m in ("exp_avg", "exp_avg_sq")), name
        assert state["step"].item() == STEP
    group = optim["optimizer_state_dict"]["param_groups"][0]
    assert optim["optimizer_state_dict"]["state"][0]["step"].item() == STEP
    assert (group["lr"], group["betas"], group["weight_decay"]) == (reference["lr"], (0.9, 0.95), 0.1)
    assert read_manifest(universal_dir(out, f"global_step{STEP}")).step == STEP


@pytest.mark.parametrize("layout, args", [("nested/global_step3", ()), ("flat/ckpt", ("--step", STEP)),
                                          ("titan/step-3", ())])
def test_from_dcp_converts_a_plain_fsdp2_checkpoint_exactly(written: Path, reference: dict, tmp_path: Path,
                                                            layout: str, args: tuple) -> None:
    out = tmp_path / "zero"
    done = cli("from-dcp", written / layout, out, "--config", written / "config", *args)
    assert done.returncode == 0, done.stderr
    assert "saved by 2 ranks" in done.stdout and "load_universal" in done.stdout
    assert_same_training_state(out, reference)
    assert cli("verify", out).returncode == 0


@pytest.fixture(scope="module")
def titan_zero(written: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torchtitan-style step folder through from-dcp."""
    out = tmp_path_factory.mktemp("titan_zero") / "zero"
    done = cli("from-dcp", written / "titan" / "step-3", out, "--config", written / "config")
    assert done.returncode == 0, done.stderr
    return out


def test_torchtitans_scheduler_is_carried_and_its_other_state_never_read(titan_zero: Path) -> None:
    """The LambdaLR state goes into DeepSpeed's model states; the dataloader's bytes and the train state's BytesIO
    (which a weights-only load refuses) are not read at all."""
    states = torch.load(universal_dir(titan_zero, "global_step3") / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=False)
    assert states["lr_scheduler"]["last_epoch"] == STEP and states["global_steps"] == STEP
    assert states["zckpt"] == {"step": STEP} and "global_samples" not in states


def test_deepspeed_resumes_the_conversion_with_every_weight_and_moment_exact(written: Path, reference: dict,
                                                                            titan_zero: Path) -> None:
    """A raw ZeRO-3 engine on 1 rank (tests/foreign_dcp_resume.py: DeepSpeed's own `load_universal`, nothing of
    zckpt_nb) holds, after loading the conversion, the writer's weights and Adam moments to the bit, its step and LR."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    loaded = titan_zero.parent / "resumed.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(RESUMER), str(titan_zero), str(written / "config"), str(loaded)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(loaded, weights_only=False)
    assert sorted(got["params"]) == sorted(reference["model"])
    for name, weight in reference["model"].items():
        state, held = reference["optim"]["state"][name], got["params"][name]
        assert torch.equal(held["fp32"], weight), name
        assert all(torch.equal(held[m], state[m]) for m in ("exp_avg", "exp_avg_sq")), name
    assert (got["global_steps"], got["lr"], got["betas"], got["weight_decay"]) == (STEP, reference["lr"],
                                                                                    (0.9, 0.95), 0.1)


def test_from_dcp_output_converts_back_to_the_same_dcp_tensors(written: Path, reference: dict,
                                                                tmp_path: Path) -> None:
    """to-dcp of from-dcp's output (its universal copy) gives the writer's weights and moments again."""
    assert cli("from-dcp", written / "nested" / "global_step3", tmp_path / "zero", "--config",
               written / "config").returncode == 0
    assert cli("to-dcp", tmp_path / "zero", tmp_path / "again").returncode == 0
    again = dcp_tensors(tmp_path / "again")
    for name, weight in reference["model"].items():
        assert torch.equal(again[f"model.{name}"], weight), name
        state = reference["optim"]["state"][name]
        assert all(torch.equal(again[f"optimizer.state.{name}.{m}"], state[m]) for m in ("exp_avg", "exp_avg_sq"))


def test_from_dcp_refuses_in_one_line_and_leaves_nothing(written: Path, tmp_path: Path) -> None:
    config, out = written / "config", tmp_path / "zero"
    refused(cli("from-dcp", written / "titan_final" / "step-3", out, "--config", config), "no optimizer state",
            "earlier step")
    refused(cli("from-dcp", written / "flat" / "ckpt", out, "--config", config), "records no step", "--step N")
    refused(cli("from-dcp", written / "titan" / "step-3", out, "--config", config, "--step", 7), "records step 3",
            "drop --step")
    refused(cli("from-dcp", written / "titan", out, "--config", config), "not a DCP checkpoint", "step-3")
    bigger = tmp_path / "bigger.json"
    bigger.write_text((config / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3'))
    refused(cli("from-dcp", written / "nested" / "global_step3", out, "--config", bigger), "model.layers.2",
            "--config")
    smaller = tmp_path / "smaller.json"
    smaller.write_text((config / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 1'))
    refused(cli("from-dcp", written / "nested" / "global_step3", out, "--config", smaller), "model.layers.1",
            "no place")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bigger.json", "smaller.json"]
    assert cli("from-dcp", written / "flat" / "ckpt", out, "--config", config, "--step", STEP).returncode == 0


def test_a_forged_metadata_without_a_manifest_is_refused_unrun(written: Path, tmp_path: Path) -> None:
    """No manifest vouches for a foreign checkpoint: its `.metadata` is still unpickled building DCP's types only."""
    folder, marker = tmp_path / "step-3", tmp_path / "ran"
    shutil.copytree(written / "nested" / "global_step3", folder)

    class Payload:
        def __reduce__(self) -> tuple:
            return open, (str(marker), "w")

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    refused(cli("from-dcp", folder, tmp_path / "zero", "--config", written / "config"), "refusing it")
    assert not marker.exists() and not (tmp_path / "zero").exists()


def dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read whole by its FQN through the package's reader."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from zckpt_nb.convert.dcp import dcp_metadata, read_dcp

    meta = dcp_metadata(folder).state_dict_metadata
    return read_dcp(folder, {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                             if isinstance(m, TensorStorageMetadata)})


@pytest.fixture(scope="module")
def adopted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw DeepSpeed loop's 2-rank checkpoint (zckpt_nb.examples.own_loop, tiny Llama), adopted."""
    out = tmp_path_factory.mktemp("adopted") / "ckpt"
    launch_module("zckpt_nb.examples.own_loop", [str(out), "--steps", "4"], nproc=2, timeout=300,
                  name="own loop", verbose=False, progress=False)
    assert cli("adopt", out).returncode == 0
    return out


def test_an_adopted_checkpoint_goes_to_dcp_and_back_exactly(adopted: Path, tmp_path: Path) -> None:
    """to-dcp writes the step into train_state; from-dcp of it, then to-dcp again, gives the same tensors, and the
    weights equal DeepSpeed's own fp32 reconstruction of the adopted checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    first, back, again = tmp_path / "dcp", tmp_path / "zero", tmp_path / "again"
    assert cli("to-dcp", adopted, first).returncode == 0
    done = cli("from-dcp", first, back, "--config", adopted / "config.json")
    assert done.returncode == 0, done.stderr
    assert read_manifest(back / "global_step4").step == 4 and cli("verify", back).returncode == 0
    assert cli("to-dcp", back, again).returncode == 0
    a, b = dcp_tensors(first), dcp_tensors(again)
    from zckpt_nb.convert.dcp import read_dcp

    assert read_dcp(first, {"train_state.step": None})["train_state.step"] == 4  # an adopted save's step, kept
    assert sorted(a) == sorted(b) and any(k.endswith(".exp_avg_sq") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    masters = get_fp32_state_dict_from_zero_checkpoint(str(adopted), "global_step4")
    assert all(torch.equal(a[f"model.{k}"], v) for k, v in masters.items())


def test_the_plain_fsdp2_load_script_reads_a_foreign_llama_checkpoint(written: Path, reference: dict,
                                                                      tmp_path: Path) -> None:
    """examples/fsdp2_load.py (nothing of zckpt_nb) on the writer's nested {"model", "optim"} Llama checkpoint, on 2
    ranks: every weight and both Adam moments equal the writer's."""
    launch_module("zckpt_nb.examples.fsdp2_load", [str(written / "nested" / "global_step3"), str(written / "config"),
                                                   str(tmp_path / "loaded.pt")], nproc=2, timeout=300,
                  name="fsdp2_load", verbose=False, progress=False)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert sorted(loaded["model"]) == sorted(reference["model"])
    for name, weight in reference["model"].items():
        state, got = reference["optim"]["state"][name], loaded["optimizer"]["state"][name]
        assert torch.equal(loaded["model"][name], weight), name
        assert all(torch.equal(got[m], state[m]) for m in ("exp_avg", "exp_avg_sq")) and got["step"] == STEP, name
