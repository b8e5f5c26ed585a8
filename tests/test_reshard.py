"""Resume on another world size: DeepSpeed's universal checkpoint, converted once, committed, loaded on M ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from conftest import RESUME_STEP, STEPS, cli, torchrun
from weights import compare_weights, load_weights

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.convert.export import export
from zckpt_nb.convert.reshard import convert, ensure_universal, reusable
from zckpt_nb.convert.verify import verify_folder
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import MANIFEST, UNIVERSAL
from zckpt_nb.format.manifest import sha256_file
from zckpt_nb.run.launch import launch

TAG = f"global_step{RESUME_STEP}"


@pytest.fixture(scope="module")
def source(full_run, tmp_path_factory):
    """The 2-rank step-50 checkpoint of the session's default run, alone in a folder."""
    return copy_checkpoint(full_run.output_dir, tmp_path_factory.mktemp("source"), TAG)


@pytest.mark.parametrize("world", [1, 3])
def test_resume_on_another_world_size_continues_the_same_optimisation(full_run, source, tmp_path, world):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    run = launch(world, STEPS, dst, resume=True, verbose=False, progress=False, timeout=900)
    assert run.resumed_from_step == RESUME_STEP and run.world_size == world
    assert run.gradient_accumulation_steps == (2 if world == 1 else 1)  # tiny: 16 sequences, 8 at once
    worst = max(abs(a - b) for a, b in zip(full_run.losses[RESUME_STEP:], run.losses, strict=True))
    assert worst <= 1e-4, f"2 -> {world}: losses differ by up to {worst:.2e}"
    done = run.resharded
    assert done["source_world_size"] == 2 and not done["reused"]
    assert done["conversion"]["seconds"] > 0 and done["conversion"]["peak_rss_bytes"] > 2**20
    assert any(f"this run has {world}. Converted it to a universal checkpoint" in line for line in run.log)
    verify_folder(dst / UNIVERSAL / TAG, UNIVERSAL)  # committed: every file's size and SHA-256


def test_export_after_a_universal_load_equals_the_source_export(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    assert cli("reshard", dst).returncode == 0
    # --steps = the checkpoint's step: load on 3 ranks, train nothing, gather every parameter (route 2)
    run = launch(3, RESUME_STEP, dst, resume=True, save_gathered=True, verbose=False, progress=False,
                 timeout=600)
    assert run.resharded["reused"], "the copy `reshard` made was converted again"
    gathered = load_weights(dst / "per_param")
    exported = load_weights(export(source, tmp_path / "export", tag=TAG))
    assert compare_weights(gathered, exported)["exact"]


def test_a_crash_mid_conversion_is_never_loaded(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    partial = dst / UNIVERSAL / f".{TAG}.killed.partial"  # a conversion's own folder, as `staged` names it
    child = subprocess.Popen([sys.executable, "-m", "zckpt_nb.convert.reshard", dst / TAG, partial],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(partial.rglob("*.pt")) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.01)
    child.kill()  # kill -9 once the converter has written part of its output
    child.wait()
    assert any(partial.rglob("*.pt")) and not (partial / MANIFEST).exists()
    assert reusable(dst, TAG) is None
    with pytest.raises(CheckpointError, match="took over"):
        convert(dst, TAG, timeout=0.5)  # a conversion past its bound stops, nothing committed, its folder removed
    assert reusable(dst, TAG) is None and sorted(p.name for p in (dst / UNIVERSAL).iterdir()) == [partial.name]
    manifest, reused = ensure_universal(dst, TAG)
    assert not reused and manifest.source_world_size == 2
    assert sorted(p.name for p in (dst / UNIVERSAL).iterdir()) == [partial.name, TAG]  # another run's folder: kept


def test_a_damaged_or_stale_copy_is_converted_again(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    manifest, _ = ensure_universal(dst, TAG)
    assert ensure_universal(dst, TAG)[1], "an intact copy is reused"
    victim = dst / UNIVERSAL / TAG / manifest.files[-1].path
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    bad = cli("verify", dst / UNIVERSAL, "--tag", TAG)
    assert bad.returncode == 1 and "does not match its SHA-256" in bad.stderr and len(bad.stderr.splitlines()) == 1
    assert not ensure_universal(dst, TAG)[1]
    # a copy of other bytes than the source's current ones (its manifest hash changed) is stale too
    source_manifest = dst / TAG / MANIFEST
    source_manifest.write_text(source_manifest.read_text() + "\n")
    assert reusable(dst, TAG) is None


def test_a_universal_manifest_cannot_point_outside_its_folder(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    ensure_universal(dst, TAG)
    path = dst / UNIVERSAL / TAG / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][0]["path"] = "../../" + TAG + "/" + manifest["files"][0]["path"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is not a relative path of a file"):
        verify_folder(path.parent, UNIVERSAL)


def test_reshard_inspect_and_verify_from_the_shell(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    done = cli("reshard", dst)
    assert done.returncode == 0, done.stderr
    assert f"{TAG} was saved by 2 ranks." in done.stdout and "every size and SHA-256 matches" in done.stdout
    shown = cli("inspect", dst / UNIVERSAL, "--tag", TAG)  # a universal copy is verify's, not inspect's
    assert shown.returncode == 2 and "describes universal" in shown.stderr
    assert cli("verify", dst / UNIVERSAL, "--tag", TAG).returncode == 0
    missing = cli("reshard", tmp_path / "nothing")
    assert missing.returncode == 1 and "no committed checkpoint" in missing.stderr


class Payload:
    """Pickles as a call to os.system: unpickling it with weights_only=False creates `marker`."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_malicious_pickle_in_a_forged_universal_copy_never_runs(source, tmp_path):
    import torch

    dst = shutil.copytree(source, tmp_path / "ckpt")
    ensure_universal(dst, TAG)
    folder, marker = dst / UNIVERSAL / TAG, tmp_path / "PAYLOAD_RAN"
    manifest = json.loads((folder / MANIFEST).read_text())
    entry = next(e for e in manifest["files"] if e["path"].endswith("fp32.pt"))
    path = folder / entry["path"]
    torch.save({"weights": torch.load(path), "extra": Payload(marker)}, path)
    entry["bytes"], entry["sha256"] = path.stat().st_size, sha256_file(path)
    (folder / MANIFEST).write_text(json.dumps(manifest))  # forged: every size and hash matches again
    with pytest.raises(CheckpointError, match="outside the allowlist") as refused:
        ensure_universal(dst, TAG)  # what a resume on another world size calls first
    assert entry["path"] in str(refused.value) and not marker.exists(), "the payload ran"


UNIVERSAL_RESUME = """import sys

import deepspeed
import torch
import torch.distributed as dist

import zckpt_nb
from zckpt_nb.examples.own_loop import build
from zckpt_nb.run import lifeline

deepspeed.init_distributed(dist_backend="gloo")
engine, _, _ = build("fp32", universal=True)  # DeepSpeed's "checkpoint": {"load_universal": true}
step = zckpt_nb.resume(engine, sys.argv[1])["step"]
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    if dist.get_rank() == 0:
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, sys.argv[2])
print(f"rank {dist.get_rank()}: resumed at step {step}", flush=True)
dist.barrier()
lifeline.leave(0)  # no interpreter teardown, where a gloo thread can abort a finished rank (SIGABRT)
"""


@pytest.mark.parametrize("world", [3])  # 1 rank is covered by the worker's resume above
def test_the_api_resumes_on_another_world_size_from_the_copy_reshard_made(tmp_path, world):
    """A user's loop saved by zckpt_nb.save on 2 ranks, `reshard` once, then zckpt_nb.resume on `world` ranks in an
    engine built with load_universal: every weight equals the checkpoint's (DeepSpeed's own fp32 reconstruction), and
    the copy was reused, not converted again."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from zckpt_nb.run.launch import launch_module

    saved = tmp_path / "saved"
    launch_module("zckpt_nb.examples.own_loop", [str(saved), "--steps", "2", "--save", "zckpt"], nproc=2,
                  timeout=300, name="own loop", verbose=False, progress=False)
    assert cli("reshard", saved).returncode == 0
    copy = saved / UNIVERSAL / "global_step2" / MANIFEST
    made = copy.stat().st_mtime_ns
    (tmp_path / "resume.py").write_text(UNIVERSAL_RESUME)
    said = torchrun(tmp_path / "resume.py", world, saved, tmp_path / "weights.pt")
    assert "".join(said).count("resumed at step 2") == world, said  # ranks' lines may interleave
    assert copy.stat().st_mtime_ns == made  # reshard's copy reused
    loaded, reference = torch.load(tmp_path / "weights.pt"), get_fp32_state_dict_from_zero_checkpoint(str(saved))
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_the_api_on_another_world_size_without_load_universal_says_what_to_do(tmp_path):
    saved = tmp_path / "saved"
    from zckpt_nb.run.launch import launch_module

    launch_module("zckpt_nb.examples.own_loop", [str(saved), "--steps", "1", "--save", "zckpt"], nproc=2,
                  timeout=300, name="own loop", verbose=False, progress=False)
    script = tmp_path / "plain.py"
    script.write_text(UNIVERSAL_RESUME.replace("universal=True", "universal=False"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", str(script), saved,
                           tmp_path / "w.pt"], capture_output=True, text=True, timeout=300,
                          env=dict(__import__("os").environ, DS_ACCELERATOR="cpu"))
    assert done.returncode != 0 and "was saved by 2 ranks; this run has 1" in done.stderr, done.stderr[-2000:]
    assert '"load_universal": true' in done.stderr
