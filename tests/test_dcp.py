"""Leaving and joining DeepSpeed: a ZeRO-3 checkpoint as PyTorch DCP (FSDP2) with its AdamW state, and back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zckpt_nb.convert.dcp import to_dcp
from zckpt_nb.convert.verify import verify_universal
from zckpt_nb.format.layout import DCP_KIND, universal_dir
from zckpt_nb.run.launch import RunResult, launch, launch_module

STEPS, SWITCH = 60, 20  # the uninterrupted run saves every SWITCH steps; each leg trains SWITCH steps
TAG = f"global_step{SWITCH}"


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The uninterrupted tiny run: ZeRO-3 on 2 CPU ranks, saving every SWITCH steps."""
    out = tmp_path_factory.mktemp("zero2")
    return launch(2, STEPS, out, save_every=SWITCH, verbose=False, progress=False, timeout=600)


@pytest.fixture(scope="module")
def converted(zero_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its step-SWITCH checkpoint converted to DCP."""
    out = tmp_path_factory.mktemp("dcp") / "step20"
    to_dcp(zero_run.output_dir, out, TAG)
    return out


def fsdp2_load(dcp_dir: Path, config_dir: Path, nproc: int, out: Path) -> dict:
    """The plain FSDP2 script on `nproc` ranks; the full state it loaded (written by its rank 0)."""
    launch_module("zckpt_nb.examples.fsdp2_load", [str(dcp_dir), str(config_dir), str(out)], nproc=nproc,
                  timeout=300, name=f"fsdp2 load on {nproc}", verbose=False, progress=False)
    return torch.load(out, weights_only=False)


def test_to_dcp_is_committed_with_the_metadata_before_the_manifest(converted: Path) -> None:
    manifest = verify_universal(converted, kind=DCP_KIND)
    names = [f["path"] for f in manifest["files"]]
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    assert manifest["step"] == SWITCH and manifest["source_world_size"] == 2
    written = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    assert written[".metadata"] >= max(t for n, t in written.items() if n.endswith(".distcp"))
    assert written["zckpt_manifest.json"] >= written[".metadata"]


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_plain_fsdp2_loads_weights_moments_and_step_exactly(zero_run: RunResult, converted: Path, nproc: int,
                                                            tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    loaded = fsdp2_load(converted, zero_run.output_dir, nproc, tmp_path / "loaded.pt")
    assert loaded["world_size"] == nproc
    reference = get_fp32_state_dict_from_zero_checkpoint(str(zero_run.output_dir), TAG)
    assert sorted(loaded["model"]) == sorted(reference)
    assert all(torch.equal(loaded["model"][k], reference[k]) for k in reference)
    universal = universal_dir(zero_run.output_dir, TAG) / "zero"
    state = loaded["optimizer"]["state"]
    assert sorted(state) == sorted(p.name for p in universal.iterdir() if p.is_dir())
    for name, moments in state.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[kind].flatten(), torch.load(universal / name / f"{kind}.pt")), (name, kind)
        assert moments["step"].item() == SWITCH
    group = loaded["optimizer"]["param_groups"][0]
    hyper = zero_run.data["ds_config"]["optimizer"]["params"]
    assert (group["betas"], group["eps"], group["weight_decay"]) == (tuple(hyper["betas"]), hyper["eps"],
                                                                       hyper["weight_decay"])
    assert group["lr"] == pytest.approx(zero_run.data["lrs"][SWITCH])  # the LR the next step trains with
    assert loaded["train_state"]["step"] == SWITCH
    assert loaded["lr_scheduler"]["last_batch_iteration"] == SWITCH - 1


def test_to_dcp_refuses_to_replace_a_folder_it_did_not_write(zero_run: RunResult, tmp_path: Path) -> None:
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    done = subprocess.run([sys.executable, "-m", "zckpt_nb", "to-dcp", str(zero_run.output_dir), str(keep)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "not a DCP checkpoint" in done.stderr
    assert (keep / "notes.txt").read_text() == "keep me"
