"""The commit protocol under real faults: kill -9 mid-save, a full disk, a read-only folder, a hung rank,
the seed's rank-0-only save, and damaged checkpoints. Real 2-rank ZeRO-3 runs, real files and mounts."""

import json
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import cli

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.convert.zero_to_fp32 import run_zero_to_fp32
from zckpt_nb.errors import CheckpointError, LaunchError, LaunchTimeout, describe_error
from zckpt_nb.examples import faults
from zckpt_nb.format.disk import atomic_write
from zckpt_nb.format.layout import MANIFEST, committed_tags, latest_name
from zckpt_nb.format.manifest import sha256_file
from zckpt_nb.run.launch import launch
from zckpt_nb.run.logs import rank_lines
from zckpt_nb.saving import rotation
from zckpt_nb.saving.commit import space_problem

STEPS, EVERY = 12, 4
FAULTS = "zckpt_nb.examples.faults"  # the worker with ZCKPT_FAULT's fault


def run(out, steps=STEPS, *, resume=False, nproc=2, model="tiny", **options):
    return launch(nproc, steps, out, save_every=EVERY, resume=resume, model=model, **options,
                  verbose=False, progress=False, timeout=600)


def failed_launch(out, steps=STEPS, **kw) -> str:
    """Launch a run that must fail (not time out); return its error text."""
    with pytest.raises(LaunchError) as err:
        run(out, steps, **kw)
    assert not isinstance(err.value, LaunchTimeout), "the fault must end the job, not the launcher's timeout"
    return str(err.value)


def verify_cli(ckpt_dir, *args) -> subprocess.CompletedProcess:
    return cli("verify", str(ckpt_dir), *args)


def same_losses(run_a, run_b) -> float:
    """Largest loss difference over the steps both runs trained."""
    by_step = dict(zip(run_a.steps, run_a.losses))
    return max(abs(by_step[s] - loss) for s, loss in zip(run_b.steps, run_b.losses))


@contextmanager
def small_disk(path: Path, options: str):
    """A real tmpfs at `path`, skipped with the reason when mounting is not allowed; always unmounted."""
    with faults.tmpfs(path, options) as why:
        if why:
            pytest.skip(why)
        yield path


@pytest.fixture(scope="session")
def ref_run(tmp_path_factory):
    """An uninterrupted tiny run saving every 4 steps, keeping the last 2 checkpoints."""
    return run(tmp_path_factory.mktemp("ref"), keep_last=2)


def test_committed_checkpoints_carry_a_manifest_and_rotation_keeps_the_newest(ref_run):
    out = ref_run.output_dir
    assert committed_tags(out) == ["global_step8", "global_step12"]  # global_step4 rotated away
    assert latest_name(out) == "global_step12" and ref_run.failed_saves == []
    manifest = json.loads((out / "global_step12" / MANIFEST).read_text())
    assert (manifest["world_size"], manifest["step"]) == (2, 12)
    assert manifest["identity"] == {"model": "tiny", "num_params": ref_run.num_params, "global_batch": 16}
    assert sorted((f["rank"], f["path"].split("_")[-2]) for f in manifest["files"]) == \
        [(0, "model"), (0, "optim"), (1, "model"), (1, "optim")]
    done = verify_cli(out)
    assert done.returncode == 0 and "every size and SHA-256 matches" in done.stdout
    saves = ref_run.ranks[0]["saves"]
    assert [s["deleted"] for s in saves] == [[], [], ["global_step4"]]
    assert all(s["timings"]["fsync"] > 0 and s["timings"]["hash"] > 0 for s in saves)


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """The small preset on 2 ranks, saving once after 2 steps."""
    return launch(2, 2, tmp_path_factory.mktemp("small"), save_checkpoint=True, model="small", verbose=False,
                  progress=False, timeout=600)


@pytest.mark.parametrize("which", ["ref_run", "small_run"])
def test_preflight_estimate_is_never_below_the_files_written_and_within_5_percent(which, request):
    result = request.getfixturevalue(which)
    for tag in committed_tags(result.output_dir):
        manifest = json.loads((result.output_dir / tag / MANIFEST).read_text())
        for record in result.ranks:
            written = sum(f["bytes"] for f in manifest["files"] if f["rank"] == record["rank"])
            estimate = next(s["estimated_bytes"] for s in record["saves"] if s["tag"] == tag)
            assert written <= estimate <= 1.05 * written, (tag, record["rank"], estimate, written)


def test_zero_to_fp32_converts_the_committed_checkpoint(ref_run, tmp_path):
    # DeepSpeed's own script reads a checkpoint written through the protocol (load_checkpoint: the resumes below).
    import torch

    out = run_zero_to_fp32(ref_run.output_dir, tmp_path / "fp32")
    state = torch.load(out / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert sum({t.data_ptr(): t.numel() for t in state.values()}.values()) == ref_run.num_params


def test_train_cli_passes_the_save_flags_to_the_worker(tmp_path):
    out = tmp_path / "cli"
    done = cli("train", "--nproc", "2", "--steps", "8", "--save_every", "4", "--keep_last", "1",
               "--collective_timeout", "120", "--output_dir", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert committed_tags(out) == ["global_step8"] and latest_name(out) == "global_step8"


@pytest.mark.parametrize("point, rank", [("shards", 1), ("before_commit", 0), ("latest", 0)])
def test_kill_9_mid_save_loses_nothing_and_resume_matches(ref_run, tmp_path, monkeypatch, point, rank):
    out = tmp_path / "run"
    monkeypatch.setenv("ZCKPT_FAULT", f"{point}:{rank}:8")
    text = failed_launch(out, worker=FAULTS)  # the same schedule as ref_run (the LR decays over STEPS); dies at step 8
    assert f"rank {rank} injects '{point}'" in text
    monkeypatch.delenv("ZCKPT_FAULT")
    # `latest` never moved: it names the step-4 checkpoint, which verifies completely.
    assert latest_name(out) == "global_step4" and verify_cli(out).returncode == 0
    # Killed before the manifest, step 8 is incomplete; killed while moving `latest`, it had committed.
    committed_8 = point == "latest"
    assert ("global_step8" in committed_tags(out)) == committed_8
    resumed = run(out, resume=True)
    start = 8 if committed_8 else 4
    assert resumed.resumed_from_step == start and resumed.steps == list(range(start, STEPS))
    assert same_losses(ref_run, resumed) <= 1e-5
    if not committed_8:
        assert any("ignoring incomplete checkpoint global_step8" in line for line in resumed.log)
    assert latest_name(out) == "global_step12" and verify_cli(out).returncode == 0


def test_full_disk_and_read_only_folder_mid_training_lose_nothing(tmp_path, monkeypatch):
    with small_disk(tmp_path / "disk", "size=24m") as disk:
        out = disk / "run"
        (out / "global_step12").mkdir(parents=True)
        with small_disk(out / "global_step12", "ro,size=1m"):  # the step-12 save meets a read-only folder
            monkeypatch.setenv("ZCKPT_FAULT", "fill:0:8")  # a neighbour fills the disk during the step-8 save
            result = run(out, 16, worker=FAULTS)
            assert result.steps == list(range(16)), "training went on after both failed saves"
            failed = {f["step"]: f["error"] for f in result.failed_saves}
            assert set(failed) == {8, 12}
            assert "ENOSPC" in failed[8] and "zero_pp_rank_" in failed[8]
            assert "EROFS" in failed[12] and "global_step12" in failed[12]
            assert not (out / "global_step8").exists(), "the failed save's partial files are removed"
            assert committed_tags(out) == ["global_step4", "global_step16"]
            for tag in ("global_step4", "global_step16"):
                assert verify_cli(out, "--tag", tag).returncode == 0
            printed = [line for line in result.log if "save global_step8 failed" in line]
            assert len(printed) == 2 and all("training continues" in line for line in printed)  # one line per rank


def test_save_that_cannot_fit_is_refused_and_abort_stops_every_rank(tmp_path):
    with small_disk(tmp_path / "small", "size=8m") as disk:  # one tiny checkpoint (5.2 MB) fits, a second does not
        out = disk / "run"
        text = failed_launch(out, on_save_error="abort")
        assert "save global_step8 failed" in text and "not enough free space" in text
        assert "stopping every rank (--on_save_error abort)" in text
        assert not (out / "global_step8").exists()
        assert latest_name(out) == "global_step4" and verify_cli(out).returncode == 0


def test_hung_rank_is_reported_within_the_collective_timeout(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("ZCKPT_FAULT", "stall:1:8:120")  # rank 1 blocks in its write like a hung NFS mount
    text = failed_launch(out, collective_timeout=10, worker=FAULTS)
    assert "save of global_step8 stopped" in text and "Timed out waiting 10000ms" in text
    assert latest_name(out) == "global_step4" and verify_cli(out).returncode == 0


def test_a_failed_copy_of_deepspeeds_recovery_script_fails_the_save_on_every_rank(tmp_path):
    out = tmp_path / "run"
    (out / "zero_to_torch.py").mkdir(parents=True)  # rank 0 copies DeepSpeed's script there after its last file
    text = failed_launch(out, EVERY, collective_timeout=60)
    printed = [line for line in text.splitlines() if "save global_step4 failed" in line]
    assert len(printed) == 2 and all("EISDIR" in line and "zero_to_torch.py" in line for line in printed)
    assert "all 1 saves failed" in text and committed_tags(out) == []  # every rank agreed: no peer failure


def test_seed_rank0_only_save_is_reported_not_an_endless_hang(tmp_path):
    out = tmp_path / "run"
    text = failed_launch(out, worker="zckpt_nb.examples.rank0_only", collective_timeout=10)
    assert "was called on rank 0 only" in text and "every rank must call save_checkpoint" in text
    assert committed_tags(out) == [] and latest_name(out) is None
    lines = rank_lines(out, last=50)  # what each rank printed: rank 1 skipped the seed's `if rank == 0` block
    assert not any("failed" in line and "save" in line for line in lines["rank 1"])
    assert any("was called on rank 0 only" in line for line in lines["rank 0"])


@pytest.fixture
def copy(ref_run, tmp_path):
    """A private copy of the newest committed checkpoint, to damage."""
    return copy_checkpoint(ref_run.output_dir, tmp_path / "copy", "global_step12")


def shard(ckpt: Path, rank: int) -> Path:
    return ckpt / "global_step12" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def lead_out(ckpt: Path, how: str) -> None:
    """Rank 1's optimizer file moves out of its tag folder, byte for byte; the manifest or a symlink follows it."""
    inside, outside = shard(ckpt, 1), ckpt / "outside.pt"
    shutil.move(inside, outside)
    if how == "symlink":
        inside.symlink_to(outside)
        return
    manifest = json.loads((inside.parent / MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["path"] == inside.name:
            entry["path"] = "../outside.pt" if how == "dotdot" else str(outside)
    (inside.parent / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, message", [
    (lambda c: truncate(shard(c, 1)), "truncated"),
    (lambda c: flip_byte(shard(c, 0)), "does not match its SHA-256"),
    (lambda c: shard(c, 1).unlink(), "is missing"),
    (lambda c: shutil.copy(shard(c, 1), c / "global_step12" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
     "is not listed in"),
    (lambda c: (c / "global_step12" / MANIFEST).unlink(), "never committed"),
    (lambda c: lead_out(c, "dotdot"), "'../outside.pt', which is not a relative path of a file"),
    (lambda c: lead_out(c, "absolute"), "outside.pt', which is not a relative path of a file"),
    (lambda c: lead_out(c, "symlink"), "a symlink leading out"),
    (lambda c: (c / "latest").write_text("../global_step12"), "is not a folder name inside"),
], ids=["truncated", "flipped-byte", "missing-rank-file", "extra-rank-file", "no-manifest", "dotdot-path",
        "absolute-path", "symlink-out", "latest-leading-out"])
def test_verify_names_the_bad_file(copy, damage, message):
    damage(copy)
    done = verify_cli(copy)
    assert done.returncode == 1 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_resume_verifies_first_and_changes_nothing(copy):
    flip_byte(shard(copy, 0))
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    text = failed_launch(copy, resume=True)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt does not match its SHA-256" in text
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != "launch.log"} == \
        {p: b for p, b in before.items() if p.name != "launch.log"}


def test_resume_and_export_refuse_a_manifest_entry_leading_out(copy, tmp_path):
    lead_out(copy, "symlink")  # the rank files all look present: only the manifest check can refuse
    assert "a symlink leading out" in failed_launch(copy, resume=True)
    done = cli("export", str(copy), str(tmp_path / "hf"))
    assert done.returncode == 2 and "a symlink leading out" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kw, message", [
    ({"global_batch": 32}, "global_batch 16 (this run: 32)"),
    ({"model": "small"}, "model 'tiny' (this run: 'small')"),
], ids=["other-global-batch", "other-model"])
def test_resume_refuses_a_checkpoint_that_does_not_fit(copy, kw, message):
    text = failed_launch(copy, resume=True, **kw)
    assert message in text
    assert verify_cli(copy).returncode == 0, "the checkpoint is untouched"


def fake_tag(root: Path, tag: str, committed: bool) -> None:
    """A tag folder with one real rank file, committed (a manifest) or not."""
    (root / tag).mkdir(parents=True)
    (root / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    if committed:
        (root / tag / MANIFEST).write_text("{}")


def test_rotation_keeps_the_newest_committed_and_never_the_only_one(tmp_path):
    for tag, ok in [("global_step4", True), ("global_step6", False), ("global_step8", True), ("global_step12", False)]:
        fake_tag(tmp_path, tag, ok)
    assert rotation.rotate(tmp_path, keep_last=1) == (["global_step4", "global_step6"], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step12", "global_step8"]  # newer incomplete kept
    assert rotation.rotate(tmp_path, keep_last=1) == ([], None), "the only committed checkpoint is never deleted"
    assert rotation.rotate(tmp_path, keep_last=0) == ([], None)


@contextmanager
def immutable(path: Path):
    """`chattr +i`: not even root may delete or rename `path` (chmod does not stop root); always undone."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("stuck, left", [
    (MANIFEST, "is left whole"),
    ("zero_pp_rank_0_mp_rank_00_model_states.pt", "lost its manifest first, so it is incomplete"),
], ids=["manifest", "rank-file"])
def test_a_rotation_that_cannot_delete_says_what_it_left(tmp_path, stuck, left):
    for tag in ("global_step4", "global_step8"):
        fake_tag(tmp_path, tag, committed=True)
    with immutable(tmp_path / "global_step4" / stuck):
        deleted, error = rotation.rotate(tmp_path, keep_last=1)
        assert deleted == [] and "EPERM" in error and "global_step4" in error and left in error
        assert committed_tags(tmp_path)[-1] == "global_step8"
        assert ("global_step4" in committed_tags(tmp_path)) == (stuck == MANIFEST)


def test_failed_rotation_keeps_the_new_checkpoint_and_latest(copy):
    stuck = shard(copy, 1)  # the old checkpoint cannot be deleted completely
    with immutable(stuck):
        result = run(copy, 16, resume=True, keep_last=1)
        assert result.steps == list(range(12, 16)), "training went on to the end"
        assert committed_tags(copy) == ["global_step16"] and latest_name(copy) == "global_step16"
        assert verify_cli(copy).returncode == 0, "the new checkpoint is whole and 'latest' names it"
        assert stuck.is_file() and not (copy / "global_step12" / MANIFEST).exists(), "the old one is incomplete"
        [error] = result.rotation_errors
        assert (error["tag"], error["step"]) == ("global_step16", 16)
        assert "EPERM" in error["error"] and str(stuck) in error["error"]
        assert result.failed_saves == [] and result.ranks[0]["saves"][-1]["deleted"] == []
        printed = [line for line in result.log if "rotation after global_step16 failed" in line]
        assert len(printed) == 2 and all("'latest' names it" in line for line in printed)  # one line per rank


def test_atomic_write_leaves_the_old_content_when_interrupted_before_the_rename(tmp_path):
    latest = tmp_path / "latest"
    atomic_write(latest, "global_step4")

    def crash():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(latest, "global_step8", before_rename=crash)
    assert latest.read_text() == "global_step4" and (tmp_path / "latest.tmp").read_text() == "global_step8"


def test_error_lines_name_errno_rank_and_path(tmp_path):
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped.__context__ = OSError(28, "No space left on device")  # how torch's zip writer reports ENOSPC
    line = describe_error(wrapped, tmp_path / "shard.pt", 1)
    assert line == f"rank 1: ENOSPC (No space left on device) writing {tmp_path / 'shard.pt'}"
    reports = [{"rank": 0, "need": 6 * 2**20, "free": 2**20}, {"rank": 1, "need": 2**20, "free": 2**20}]
    assert "rank 0: not enough free space" in space_problem(reports, tmp_path)


def test_unknown_fault_point_is_refused():
    with pytest.raises(ValueError, match="shards, before_commit, latest, background, stall, fill"):
        faults.parse("explode:0:8")


class Payload:
    """Pickles as a call to os.system: unpickling it with weights_only=False creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def plant_payload(ckpt: Path, kind: str, marker: Path, forge: bool) -> Path:
    """Rank 0's `kind` file keeps its content plus the payload; with `forge` the manifest gets its new size and hash."""
    import torch

    from zckpt_nb.convert.safeload import load

    path = ckpt / "global_step12" / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt"
    state = load(path)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    if forge:
        manifest = json.loads((path.parent / MANIFEST).read_text())
        for entry in manifest["files"]:
            if entry["path"] == path.name:
                entry["bytes"], entry["sha256"] = path.stat().st_size, sha256_file(path)
        (path.parent / MANIFEST).write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("kind", ["model", "optim"])
@pytest.mark.parametrize("forge", [False, True], ids=["manifest-kept", "manifest-forged"])
def test_a_malicious_pickle_is_refused_and_never_runs(copy, tmp_path, kind, forge):
    marker = tmp_path / "PAYLOAD_RAN"
    path = plant_payload(copy, kind, marker, forge)
    said = "holds a type outside the allowlist" if forge else "the manifest says"  # the size check comes first
    for command in (["export", str(copy), str(tmp_path / "hf")], ["inspect", str(copy)]):
        done = subprocess.run([sys.executable, "-m", "zckpt_nb", *command], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and str(path) in done.stderr and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match=said):
        run_zero_to_fp32(copy, tmp_path / "fp32")
    text = failed_launch(copy, resume=True)
    assert path.name in text and said in text
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "hf").exists() and not (tmp_path / "fp32").exists()
    import torch

    torch.load(path, weights_only=False)  # what DeepSpeed's own load does: the payload is live
    assert marker.exists()


def other_preset_config(ckpt: Path) -> None:
    from zckpt_nb.model import gpt2_config

    gpt2_config("small").save_pretrained(str(ckpt))


def forge_shared(ckpt: Path, name: str) -> None:
    """The manifest takes the edited shared file's new size and hash, as an attacker or a careless copy would."""
    path, manifest_path = ckpt / name, ckpt / "global_step12" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    [entry] = [e for e in manifest["shared"] if e["path"] == name]
    entry["bytes"], entry["sha256"] = path.stat().st_size, sha256_file(path)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name, edit", [
    ("tokenizer.json", lambda c: (c / "tokenizer.json").write_text((c / "tokenizer.json").read_text()
                                                                    .replace('"<|endoftext|>"', '"<|end|>"', 1))),
    ("config.json", other_preset_config),
], ids=["edited-tokenizer", "other-preset-config"])
def test_the_manifest_covers_the_tokenizer_and_config(copy, name, edit):
    manifest = json.loads((copy / "global_step12" / MANIFEST).read_text())
    assert [e["path"] for e in manifest["shared"]] == ["tokenizer.json", "tokenizer_config.json", "config.json"]
    edit(copy)
    changed = ("the manifest says", "does not match its SHA-256")  # the size, else the hash
    done = verify_cli(copy)
    assert done.returncode == 1 and f"{copy / name} " in done.stderr and any(c in done.stderr for c in changed)
    text = failed_launch(copy, resume=True)
    assert f"{copy / name} " in text and any(c in text for c in changed)
    if name == "config.json":  # a manifest that vouches for the other config: resume compares it with --model
        forge_shared(copy, name)
        text = failed_launch(copy, resume=True)
        assert f"{copy / name} describes" in text and "'n_embd': " in text and "this run's --model tiny is" in text


def test_zero_to_fp32_script_must_be_deepspeeds_own(copy, tmp_path):
    with (copy / "zero_to_fp32.py").open("a") as f:
        f.write("\nimport os; os.system('touch PAYLOAD')\n")
    with pytest.raises(CheckpointError, match="differs from DeepSpeed's own"):
        run_zero_to_fp32(copy, tmp_path / "fp32")
    assert not (tmp_path / "fp32").exists()


def test_a_run_whose_saves_all_fail_ends_with_one_line_and_exit_1(tmp_path):
    with small_disk(tmp_path / "tiny_disk", "size=3m") as disk:  # not even one checkpoint fits
        out = disk / "run"
        text = failed_launch(out)
        assert "all 3 saves failed, so this run committed no checkpoint" in text and "not enough free space" in text
        assert "Traceback" not in text
        run_json = json.loads((out / "run.json").read_text())  # whole, and it says what failed
        assert [f["step"] for f in run_json["failed_saves"]] == [4, 8, 12] and run_json["latest_tag"] is None
        assert committed_tags(out) == []


def test_a_run_json_that_cannot_be_written_is_one_line_and_exit_1(tmp_path):
    out = tmp_path / "run"
    (out / "run.json.tmp").mkdir(parents=True)  # run.json's temporary file cannot be opened (EISDIR)
    text = failed_launch(out, 4)
    assert "rank 0: run.json was not written (rank 0: EISDIR" in text and "Traceback" not in text
    assert not (out / "run.json").exists(), "no half-written run.json"
    assert committed_tags(out) == ["global_step4"], "the save itself committed"
