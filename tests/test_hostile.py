"""Hostile and careless inputs on real checkpoints (a 2-rank ZeRO-3 save, its universal copy, its DCP conversion).

Every test asserts three things: no payload ran (a pickle whose `__reduce__` would create a marker file), nothing
outside the command's output changed (every file's size and mtime, every folder), and every refusal is one line
with a non-zero exit code. docs/security.md maps each promise to the test that proves it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import cli, refused, torchrun

from zckpt_nb.convert.dcp import to_dcp
from zckpt_nb.convert.reshard import ensure_universal
from zckpt_nb.convert.zero_to_fp32 import run_zero_to_fp32
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import MANIFEST, UNIVERSAL
from zckpt_nb.format.manifest import sha256_file
from zckpt_nb.run.launch import launch, launch_module

TAG = "global_step4"


class Payload:
    """Pickles as a call to os.system: unpickled with weights_only=False, it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A 2-rank checkpoint of tiny (4 steps), its universal copy and its DCP conversion, made once."""
    root = tmp_path_factory.mktemp("hostile")
    launch(2, 4, root / "ckpt", save_checkpoint=True, verbose=False, progress=False, timeout=300)
    to_dcp(root / "ckpt", root / "dcp", TAG)
    ensure_universal(root / "ckpt", TAG)
    return root


@pytest.fixture
def work(pristine: Path, tmp_path: Path) -> Path:
    """This test's own copy of `pristine`."""
    for name in ("ckpt", "dcp"):
        shutil.copytree(pristine / name, tmp_path / name, symlinks=True)
    return tmp_path


@pytest.fixture
def marker(tmp_path_factory) -> Path:
    """Where a payload that ran would leave its mark (outside every folder a command reads or writes)."""
    return tmp_path_factory.mktemp("marks") / "PAYLOAD_RAN"


def plant(path: Path, marker: Path) -> Path:
    """A torch file at `path` whose unpickling with weights_only=False runs the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": torch.ones(2), "extra": Payload(marker)}, path)
    return path


def forge(folder: Path) -> None:
    """Rewrite `folder`'s manifest to list every file there with its true size and SHA-256, as whoever hands over a
    folder can."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    known = {e["path"]: e for e in manifest["files"]}
    manifest["files"] = [{**known.get(rel, {"path": rel, "rank": None}), "bytes": p.stat().st_size,
                          "sha256": sha256_file(p)}
                         for p in sorted(folder.rglob("*")) if p.is_file() and (rel := str(p.relative_to(folder)))
                         != MANIFEST]
    path.write_text(json.dumps(manifest))


def flip(path: Path) -> None:
    """One byte in the middle of `path` changed: the size stays, the SHA-256 does not."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """Every path under `root` (outputs in `skip` left out) with its size and mtime, links not followed."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if not any(rel == s or rel.startswith(f"{s}/") for s in skip):
            info = path.lstat()
            found[rel] = (info.st_size if path.is_file() else 0, info.st_mtime_ns)
    return found


def readers(work: Path) -> dict[str, tuple[str, ...]]:
    """The commands that read a checkpoint's rank files, each with its own output folder."""
    ckpt = work / "ckpt"
    return {"verify": ("verify", ckpt), "inspect": ("inspect", ckpt), "export": ("export", ckpt, work / "hf"),
            "reshard": ("reshard", ckpt), "to-dcp": ("to-dcp", ckpt, work / "out_dcp")}


# --- 1. verified means exactly what is opened: a file the manifest does not list is refused by every reader ---

@pytest.mark.parametrize("name", ["a_model_states.pt", "zz_optim_states.pt",
                                  "zero_pp_rank_0_mp_rank_01_model_states.pt",
                                  "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                  "sub/zero_pp_rank_0_x_model_states.pt"])
def test_an_unlisted_payload_beside_a_genuine_manifest_is_refused_by_every_reader(work, marker, name):
    plant(work / "ckpt" / TAG / name, marker)
    before = snapshot(work)
    for args in readers(work).values():
        refused(cli(*args), "is not listed in")
    with pytest.raises(CheckpointError, match="is not listed in"):
        run_zero_to_fp32(work / "ckpt", work / "fp32")  # DeepSpeed's own script, as a user runs it
    assert snapshot(work) == before and not marker.exists()


def test_an_unlisted_payload_in_the_universal_copy_is_never_loaded(work, marker):
    """The copy DeepSpeed's universal load opens by fixed names: one entry dropped from its manifest and the file
    replaced is an unlisted file; verify refuses it, and a resume converts again instead of loading it."""
    copy = work / "ckpt" / UNIVERSAL / TAG
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"] = [e for e in manifest["files"] if e["path"] != "zero/optimizer_state.pt"]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    plant(copy / "zero" / "optimizer_state.pt", marker)
    refused(cli("verify", work / "ckpt" / UNIVERSAL, "--tag", TAG), "optimizer_state.pt is not listed")
    manifest, reused = ensure_universal(work / "ckpt", TAG)  # what train --resume on another world size calls
    assert not reused and "zero/optimizer_state.pt" in {e.path for e in manifest.files}
    assert not marker.exists()


# --- 2. no code from a file's bytes, even with a forged manifest ---

@pytest.mark.parametrize("victim", ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_payload_under_a_forged_manifest_is_refused_by_every_reader(work, marker, victim):
    plant(work / "ckpt" / TAG / victim, marker)
    forge(work / "ckpt" / TAG)
    shutil.rmtree(work / "ckpt" / UNIVERSAL)  # else to-dcp and reshard would read the intact copy
    before = snapshot(work)
    for name, args in readers(work).items():
        done = cli(*args)
        if name == "verify":  # sizes and hashes match the forged manifest: nothing is unpickled
            assert done.returncode == 0, done.stderr
        else:
            refused(done, "outside the allowlist", victim)
    with pytest.raises(CheckpointError, match="outside the allowlist"):
        run_zero_to_fp32(work / "ckpt", work / "fp32")
    assert snapshot(work) == before and not marker.exists()


@pytest.mark.parametrize("victim", ["zero/optimizer_state.pt", "zero/transformer.wte.weight/fp32.pt"])
def test_a_payload_in_a_forged_universal_copy_is_refused_before_deepspeed_loads_it(work, marker, victim):
    copy = work / "ckpt" / UNIVERSAL / TAG
    plant(copy / victim, marker)
    forge(copy)
    with pytest.raises(CheckpointError, match="outside the allowlist"):
        ensure_universal(work / "ckpt", TAG)
    assert not marker.exists()


def metadata_of(folder: Path):
    """DCP's metadata of a folder this test made itself (trusted: plain pickle)."""
    import pickle

    return pickle.loads((folder / ".metadata").read_bytes())


def write_metadata(folder: Path, metadata) -> None:
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    forge(folder)


def payload_metadata(folder: Path, marker: Path) -> None:
    write_metadata(folder, Payload(marker))


def metadata_leading_out(folder: Path, marker: Path) -> None:
    metadata = metadata_of(folder)
    for info in metadata.storage_data.values():
        info.relative_path = f"../ckpt/{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    write_metadata(folder, metadata)


def metadata_too_large_a_tensor(folder: Path, marker: Path) -> None:
    metadata = metadata_of(folder)
    item = metadata.state_dict_metadata["model.transformer.wte.weight"]
    item.size = torch.Size([10**12, 10**3])
    write_metadata(folder, metadata)


def payload_byte_item(folder: Path, marker: Path) -> None:
    """A DCP checkpoint whose train state holds a pickled payload (DCP writes non-tensors with torch.save)."""
    import torch.distributed.checkpoint as dcp

    metadata = metadata_of(folder)
    state = {k: torch.empty(m.size) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    from zckpt_nb.convert.dcp import read_dcp

    state |= {k: None for k in metadata.state_dict_metadata if k not in state}
    read_dcp(folder, state)
    state["train_state.step"] = Payload(marker)
    for path in folder.iterdir():
        if path.name != MANIFEST:
            path.unlink()
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    forge(folder)


@pytest.mark.parametrize("tamper", [payload_metadata, metadata_leading_out, metadata_too_large_a_tensor,
                                    payload_byte_item])
def test_from_dcp_reads_a_forged_dcp_checkpoint_without_running_it(work, marker, tamper):
    tamper(work / "dcp", marker)
    before = snapshot(work)
    done = cli("from-dcp", work / "dcp", work / "back", "--config", "tiny")
    refused(done, "refusing" if tamper is not payload_byte_item else "outside the allowlist")
    assert snapshot(work) == before and not marker.exists()


def test_the_fsdp2_worker_refuses_forged_dcp_metadata_before_loading(work, marker):
    folder = work / "fsdp" / TAG
    shutil.copytree(work / "dcp", folder)
    payload_metadata(folder, marker)
    done = subprocess.run([sys.executable, "-m", "zckpt_nb", "train", "--nproc", "1", "--worker", "zckpt_nb.train_fsdp",
                           "--output_dir", work / "fsdp", "--steps", "6", "--resume", "--timeout", "300"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "refusing it" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not marker.exists()


# --- 3. touch nothing it does not own ---

def test_export_overwrite_replaces_only_its_own_export(work):
    ckpt, run = work / "ckpt", work / "run"
    shutil.copytree(ckpt, run)  # a training run: tags, tokenizer, run.json
    old = work / "old_export"  # an export of another tool (or of zckpt_nb before it kept a record)
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"weights")
    target = work / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (work / "link").symlink_to(target)
    before = snapshot(work)
    for out, words in ((run, ("global_step4", "did not write")), (old, ("config.json", "did not write")),
                       (work / "link", ("symbolic link",)), (ckpt, ("contains the checkpoint",))):
        refused(cli("export", ckpt, out, "--overwrite"), *words)
    assert snapshot(work) == before
    assert cli("export", ckpt, work / "hf").returncode == 0
    (work / "hf" / "notes.txt").write_text("mine")
    refused(cli("export", ckpt, work / "hf", "--overwrite"), "notes.txt", "did not write")
    (work / "hf" / "notes.txt").unlink()
    assert cli("export", ckpt, work / "hf", "--overwrite").returncode == 0
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_to_dcp_and_from_dcp_write_only_their_output(work):
    mine = work / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (work / "out.converting").mkdir()  # a folder of the user's named like an old temporary one
    (work / "out.converting" / "keep.txt").write_text("keep")
    (work / "link").symlink_to(mine)
    before = snapshot(work, skip=("out",))
    for args, words in ((("to-dcp", work / "ckpt", mine), ("notes.txt", "did not write")),
                        (("to-dcp", work / "ckpt", work / "link"), ("symbolic link",)),
                        (("from-dcp", work / "dcp", mine, "--config", "tiny"), ("not empty",)),
                        (("from-dcp", work / "dcp", work / "link", "--config", "tiny"), ("symbolic link",))):
        refused(cli(*args), *words)
    assert cli("to-dcp", work / "ckpt", work / "out").returncode == 0
    assert snapshot(work, skip=("out",)) == before
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("latest", ["absolute", "../victim", "victim"])
def test_adopt_never_follows_latest_out_of_the_checkpoint(work, latest):
    victim = work / "victim"
    shutil.copytree(work / "ckpt" / TAG, victim, ignore=shutil.ignore_patterns(MANIFEST))
    ckpt = work / "raw"
    (ckpt / TAG).mkdir(parents=True)
    if latest == "victim":  # a tag folder that is a link to a folder elsewhere
        (ckpt / TAG).rmdir()
        (ckpt / TAG).symlink_to(victim)
    (ckpt / "latest").write_text(str(victim) if latest == "absolute" else latest if latest != "victim" else TAG)
    before = snapshot(work)
    refused(cli("adopt", ckpt), "is not a tag folder inside")
    assert snapshot(work) == before and not (victim / MANIFEST).exists()


def test_a_save_into_a_linked_tag_folder_deletes_nothing_it_points_to(work):
    from zckpt_nb.saving.commit import prepare_folder

    victim = work / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    (work / "out").mkdir()
    (work / "out" / "global_step8").symlink_to(victim)
    with pytest.raises(FileExistsError, match="symbolic link"):
        prepare_folder(work / "out", "global_step8")
    assert (victim / "precious.txt").read_text() == "keep"


def test_reshard_and_collect_write_only_their_own_folders(work):
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt / UNIVERSAL)
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    (ckpt / UNIVERSAL).symlink_to(elsewhere)
    (work / "file").write_text("a file")
    before = snapshot(work)
    refused(cli("reshard", ckpt), "symbolic link")
    refused(cli("collect", ckpt, work / "file"), "is a file")
    refused(cli("collect", ckpt, work / "dcp"), "not empty")
    assert snapshot(work) == before and not any(elsewhere.iterdir())


# --- 4. bounded input: sizes are checked before anything is read or allocated ---

def sparse(path: Path, size: int) -> None:
    """A file of `size` bytes that takes no disk space (read, it would take `size` of memory)."""
    with open(path, "wb") as f:
        f.truncate(size)


def repeated_entries(tag_dir: Path) -> None:
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    manifest["files"] = manifest["files"] * 5_000
    (tag_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("tamper, words", [
    (lambda ckpt: sparse(ckpt / TAG / MANIFEST, 1 << 30), ("larger than 16 MiB",)),
    (lambda ckpt: repeated_entries(ckpt / TAG), ("twice",)),
    (lambda ckpt: sparse(ckpt / "latest", 1 << 30), ("is not a folder name",)),
], ids=["manifest-of-1-GiB", "20000-entries", "latest-of-1-GiB"])
def test_oversized_manifests_and_latest_are_refused_unread(work, tamper, words):
    tamper(work / "ckpt")
    before = snapshot(work)
    for name, args in readers(work).items():  # a bad 'latest': the others take the newest committed tag instead
        if name in ("verify", "inspect") or "latest" not in tamper.__code__.co_consts:
            refused(cli(*args), *(words if name in ("verify", "inspect", "export") else ()))
    assert snapshot(work) == before


@pytest.mark.parametrize("change, words", [
    ({"n_layer": 10**6}, ("1,000,000 layers",)), ({"vocab_size": 10**12}, ("1,000,000,000,000 x",)),
    ({"n_embd": 128, "n_head": 4}, ("the shape (1024, 128)",)), ({"tie_word_embeddings": False}, ("lm_head",)),
])
def test_an_export_config_is_checked_against_the_weights_before_anything_is_written(work, change, words):
    config = json.loads((work / "ckpt" / "config.json").read_text()) | change
    (work / "config.json").write_text(json.dumps(config))
    before = snapshot(work)
    refused(cli("export", work / "ckpt", work / "hf", "--config", work / "config.json"), *words)
    assert snapshot(work) == before


# --- 5. one line for every bad input and I/O failure; nothing half-written ---

@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small RAM disk at `path` (the tests run as root), unmounted after."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(work):
    with tmpfs(work / "disk", "1m") as disk:
        for args in (("export", work / "ckpt", disk / "hf"), ("to-dcp", work / "ckpt", disk / "dcp"),
                     ("from-dcp", work / "dcp", disk / "back", "--config", "tiny")):
            refused(cli(*args), "No space left on device (ENOSPC) on", "free space")
            assert not any(disk.iterdir()), list(disk.iterdir())


def test_a_read_only_disk_is_one_line_and_reading_still_works(work):
    with tmpfs(work / "disk", "32m") as disk:
        shutil.copytree(work / "ckpt", disk / "ckpt", ignore=shutil.ignore_patterns(UNIVERSAL))
        shutil.copytree(work / "ckpt", disk / "raw", ignore=shutil.ignore_patterns(UNIVERSAL, MANIFEST))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert cli("verify", disk / "ckpt").returncode == 0 and cli("adopt", disk / "ckpt").returncode == 0
        refused(cli("reshard", disk / "ckpt"), "Read-only file system (EROFS) on", "writable")
        refused(cli("adopt", disk / "raw"), "Read-only file system (EROFS) on", "writable")
        refused(cli("export", work / "ckpt", disk / "hf"), "cannot be written")
        assert not (disk / "ckpt" / UNIVERSAL).exists() and not (disk / "raw" / TAG / MANIFEST).exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_permission_denied_is_one_line_naming_the_file(work):
    """As root every file is readable: the command runs without the capability that bypasses file modes."""
    victim = work / "ckpt" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.chmod(0)
    done = subprocess.run(["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                           "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m", "zckpt_nb",
                           "verify", work / "ckpt"], capture_output=True, text=True, timeout=120)
    refused(done, f"Permission denied (EACCES) on {victim}", "permissions")


RESUME = """import sys
from pathlib import Path

import deepspeed
import torch.distributed as dist

import zckpt_nb
from zckpt_nb.errors import CheckpointError
from zckpt_nb.examples.own_loop import build
from zckpt_nb.run import lifeline

deepspeed.init_distributed(dist_backend="gloo")
engine, _, _ = build("fp32")
said = []
for folder in sys.argv[2:]:
    try:
        said.append(f"resumed at step {zckpt_nb.resume(engine, folder, tag='global_step2')['step']}")
    except CheckpointError as e:
        said.append(f"refused: {e}")
Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text("\\n".join(said))
lifeline.leave(0)
"""


def test_resume_with_an_explicit_tag_verifies_every_rank_first(tmp_path, marker):
    """zckpt_nb.resume(engine, dir, tag=T) in a user's own loop: a corrupted file or an unlisted payload is refused on
    every rank, naming the rank that found it; an intact copy resumes."""
    saved = tmp_path / "saved"
    launch_module("zckpt_nb.examples.own_loop", [str(saved), "--steps", "2", "--save", "zckpt"], nproc=2,
                  timeout=300, name="own loop", verbose=False, progress=False)
    corrupted, planted = shutil.copytree(saved, tmp_path / "corrupted"), shutil.copytree(saved, tmp_path / "planted")
    optim = corrupted / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(optim)
    plant(planted / "global_step2" / "zero_pp_rank_0_mp_rank_01_model_states.pt", marker)
    (tmp_path / "resume.py").write_text(RESUME)
    torchrun(tmp_path / "resume.py", 2, tmp_path, corrupted, planted, saved)
    said = [line for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    assert said.count(f"refused: rank 1: {optim} does not match its SHA-256 in the manifest (corrupted)") == 2, said
    assert sum("is not listed in" in line for line in said) == 2 and said.count("resumed at step 2") == 2, said
    assert not marker.exists()


def damaged_manifest(ckpt: Path) -> None:
    manifest = json.loads((ckpt / TAG / MANIFEST).read_text())
    manifest["files"][2]["bytes"] = str(manifest["files"][2]["bytes"])
    (ckpt / TAG / MANIFEST).write_text(json.dumps(manifest))


def corrupted_file(ckpt: Path) -> None:
    flip(ckpt / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("damage, words", [(damaged_manifest, "files[2]'s 'bytes' is"),
                                           (corrupted_file, "rank 1: ")])
def test_train_resume_refuses_a_damaged_checkpoint_in_one_line_of_its_own(work, damage, words):
    """The refusal is one rank's own line (never a dead peer), between the job's line and the log's; no traceback,
    no abort."""
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt / UNIVERSAL)
    damage(ckpt)
    done = subprocess.run([sys.executable, "-m", "zckpt_nb", "train", "--nproc", "2", "--output_dir", ckpt,
                           "--steps", "6", "--resume", "--timeout", "300"], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 3 and words in lines[1], done.stderr
    assert "peer" not in done.stderr and "Traceback" not in done.stderr and "SIGABRT" not in done.stderr
