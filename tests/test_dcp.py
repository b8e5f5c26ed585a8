"""Leaving and joining DeepSpeed: a ZeRO-3 checkpoint as PyTorch DCP (FSDP2) with its AdamW state, and back."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli

from zckpt_nb.convert.dcp import RANK_FILES, UNIVERSAL_COPY, to_dcp
from zckpt_nb.convert.reshard import ensure_universal
from zckpt_nb.convert.verify import verify_folder
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import DCP_KIND, universal_dir
from zckpt_nb.format.manifest import sha256_file
from zckpt_nb.format.writer import DirectFile
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
    """Its step-SWITCH checkpoint converted to DCP (straight from its rank files: no universal copy exists yet)."""
    out = tmp_path_factory.mktemp("dcp") / "step20"
    assert to_dcp(zero_run.output_dir, out, TAG).conversion["route"] == RANK_FILES
    return out


@pytest.fixture(scope="module")
def universal_copy(zero_run: RunResult, converted: Path) -> Path:
    """DeepSpeed's universal copy of the step-SWITCH checkpoint (ds_to_universal): the moments' reference."""
    ensure_universal(zero_run.output_dir, TAG)
    return universal_dir(zero_run.output_dir, TAG) / "zero"


def fsdp2_load(dcp_dir: Path, config_dir: Path, nproc: int, out: Path) -> dict:
    """The plain FSDP2 script on `nproc` ranks; the full state it loaded (written by its rank 0)."""
    launch_module("zckpt_nb.examples.fsdp2_load", [str(dcp_dir), str(config_dir), str(out)], nproc=nproc,
                  timeout=300, name=f"fsdp2 load on {nproc}", verbose=False, progress=False)
    return torch.load(out, weights_only=False)


def test_to_dcp_is_committed_with_the_metadata_before_the_manifest(converted: Path) -> None:
    manifest = verify_folder(converted, DCP_KIND)
    names = [f.path for f in manifest.files]
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    assert manifest.step == SWITCH and manifest.source_world_size == 2
    written = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    assert written[".metadata"] >= max(t for n, t in written.items() if n.endswith(".distcp"))
    assert written["zckpt_manifest.json"] >= written[".metadata"]


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_plain_fsdp2_loads_weights_moments_and_step_exactly(zero_run: RunResult, converted: Path, nproc: int,
                                                            universal_copy: Path, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    loaded = fsdp2_load(converted, zero_run.output_dir, nproc, tmp_path / "loaded.pt")
    assert loaded["world_size"] == nproc
    reference = get_fp32_state_dict_from_zero_checkpoint(str(zero_run.output_dir), TAG)
    assert sorted(loaded["model"]) == sorted(reference)
    assert all(torch.equal(loaded["model"][k], reference[k]) for k in reference)
    universal = universal_copy
    state = loaded["optimizer"]["state"]
    assert sorted(state) == sorted(p.name for p in universal.iterdir() if p.is_dir())
    for name, moments in state.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[kind].flatten(), torch.load(universal / name / f"{kind}.pt")), (name, kind)
        assert moments["step"].item() == SWITCH
    group = loaded["optimizer"]["param_groups"][0]
    hyper = zero_run.ds_config["optimizer"]["params"]
    assert (group["betas"], group["eps"], group["weight_decay"]) == (tuple(hyper["betas"]), hyper["eps"],
                                                                       hyper["weight_decay"])
    assert group["lr"] == pytest.approx(zero_run.lrs[SWITCH])  # the LR the next step trains with
    assert loaded["train_state"]["step"] == SWITCH
    assert loaded["lr_scheduler"]["last_batch_iteration"] == SWITCH - 1


@pytest.fixture(scope="module")
def zero_run_3(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """A tiny ZeRO-3 run on 3 CPU ranks (its partitions padded where 3 does not divide a parameter), saved at step 2."""
    out = tmp_path_factory.mktemp("zero3")
    return launch(3, 2, out, save_checkpoint=True, verbose=False, progress=False, timeout=300)


def dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read whole by its FQN."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from zckpt_nb.convert.dcp import read_dcp

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    return read_dcp(folder, {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                             if isinstance(m, TensorStorageMetadata)})


@pytest.mark.parametrize("nproc", [2, 3])
def test_rank_files_and_universal_copy_give_identical_dcp_tensors(zero_run: RunResult, zero_run_3: RunResult,
                                                                  nproc: int, tmp_path: Path) -> None:
    """to-dcp straight from the rank files writes, tensor for tensor, what it writes through DeepSpeed's universal
    copy (ds_to_universal, then one file per parameter), on 2 and 3 source ranks."""
    run = {2: zero_run, 3: zero_run_3}[nproc]
    tag = TAG if nproc == 2 else "global_step2"
    direct = to_dcp(run.output_dir, tmp_path / "direct", tag, route=RANK_FILES)
    assert direct.conversion["route"] == RANK_FILES and direct.source_world_size == nproc
    through = to_dcp(run.output_dir, tmp_path / "universal", tag, route=UNIVERSAL_COPY)
    assert through.conversion["route"] == UNIVERSAL_COPY
    a, b = dcp_tensors(tmp_path / "direct"), dcp_tensors(tmp_path / "universal")
    assert sorted(a) == sorted(b) and any(k.endswith(".exp_avg_sq") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_to_dcp_refuses_to_replace_a_folder_it_did_not_write(zero_run: RunResult, tmp_path: Path) -> None:
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    done = cli("to-dcp", str(zero_run.output_dir), str(keep))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "notes.txt, which zckpt_nb did not write" in done.stderr
    assert (keep / "notes.txt").read_text() == "keep me"


def test_to_dcp_refuses_a_corrupted_rank_file_and_commits_nothing(zero_run: RunResult, tmp_path: Path) -> None:
    """The rank files are hashed while they are converted: one byte flipped in rank 1's optimizer file is refused,
    a truncated file too (with the check's error, not the failed read's), the unfinished folder deleted, and an
    earlier conversion into the same folder kept whole."""
    ckpt = Path(shutil.copytree(zero_run.output_dir, tmp_path / "ckpt", ignore=shutil.ignore_patterns("universal")))
    first = to_dcp(ckpt, tmp_path / "dcp", TAG)
    optim = next((ckpt / TAG).glob("*rank_1_*optim_states.pt"))
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optim.write_bytes(bytes(data))
    for out in (tmp_path / "dcp", tmp_path / "fresh"):
        with pytest.raises(CheckpointError, match="does not match its SHA-256"):
            to_dcp(ckpt, out, TAG)
    optim = next((ckpt / TAG).glob("*rank_0_*optim_states.pt"))
    with open(optim, "r+b") as f:
        f.truncate(optim.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated or rewritten"):  # its load fails first: the check says why
        to_dcp(ckpt, tmp_path / "dcp", TAG)
    assert verify_folder(tmp_path / "dcp", DCP_KIND) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "dcp"]  # no `fresh`, no `.converting` folder


@pytest.mark.fast
def test_dcp_stream_hashes_what_it_wrote_and_tells_offsets(tmp_path: Path) -> None:
    stream, chunks = DirectFile(tmp_path / "f"), [os.urandom(5_000_000) for _ in range(4)]  # more than one block
    for chunk in chunks:
        assert stream.write(memoryview(chunk)) == len(chunk)
        assert stream.tell() == sum(map(len, chunks[:chunks.index(chunk) + 1]))  # where DCP's next item starts
    stream.close()
    assert (tmp_path / "f").read_bytes() == b"".join(chunks)
    assert stream.hexdigest() == sha256_file(tmp_path / "f")


@pytest.fixture(scope="module")
def fsdp_leg(zero_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The FSDP2 worker on 3 ranks resumed from the step-SWITCH conversion, trained SWITCH steps, saved with DCP."""
    out = tmp_path_factory.mktemp("fsdp3")
    to_dcp(zero_run.output_dir, out / TAG, TAG)
    return launch(3, 2 * SWITCH, out, resume=True, save_checkpoint=True, worker="zckpt_nb.train_fsdp",
                  verbose=False, progress=False, timeout=600)


def test_fsdp2_on_3_ranks_continues_the_zero3_run(zero_run: RunResult, fsdp_leg: RunResult) -> None:
    """The loss after the switch stays within 1e-4 of the uninterrupted ZeRO-3 run for SWITCH steps."""
    assert fsdp_leg.steps == list(range(SWITCH, 2 * SWITCH)) and fsdp_leg.world_size == 3
    expected = zero_run.losses[SWITCH:2 * SWITCH]
    gaps = [abs(a - b) for a, b in zip(fsdp_leg.losses, expected)]
    assert max(gaps) < 1e-4, gaps
    assert fsdp_leg.lrs == pytest.approx(zero_run.lrs[SWITCH:2 * SWITCH], rel=1e-9)
    assert (fsdp_leg.output_dir / f"global_step{2 * SWITCH}" / ".metadata").is_file()


@pytest.fixture(scope="module")
def back_to_zero(fsdp_leg: RunResult, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FSDP2 leg's last DCP checkpoint converted back with from-dcp (the CLI, as a user runs it)."""
    out = tmp_path_factory.mktemp("back") / "zero"
    done = cli("from-dcp", str(fsdp_leg.output_dir / f"global_step{2 * SWITCH}"), str(out), "--config", "tiny")
    assert done.returncode == 0, done.stderr
    return out


def test_zero3_on_1_rank_resumes_from_dcp_and_continues_the_run(zero_run: RunResult, back_to_zero: Path) -> None:
    """The round trip ZeRO-3 (2) -> FSDP2 (3) -> ZeRO-3 (1) stays within 1e-4 of the uninterrupted run."""
    resumed = launch(1, STEPS, back_to_zero, resume=True, verbose=False, progress=False, timeout=600)
    assert resumed.resumed_from_step == 2 * SWITCH and resumed.resharded
    gaps = [abs(a - b) for a, b in zip(resumed.losses, zero_run.losses[2 * SWITCH:])]
    assert len(gaps) == SWITCH and max(gaps) < 1e-4, gaps


def test_zero3_on_3_ranks_resumes_from_dcp(zero_run: RunResult, back_to_zero: Path, tmp_path: Path) -> None:
    import shutil

    copy = shutil.copytree(back_to_zero, tmp_path / "zero3")
    resumed = launch(3, 2 * SWITCH + 4, copy, resume=True, verbose=False, progress=False, timeout=600)
    assert resumed.world_size == 3 and resumed.steps == list(range(2 * SWITCH, 2 * SWITCH + 4))
    assert max(abs(a - b) for a, b in zip(resumed.losses, zero_run.losses[2 * SWITCH:])) < 1e-4


def test_from_dcp_refuses_bad_input_in_one_line(converted: Path, tmp_path: Path) -> None:
    for args in ([str(tmp_path / "nothing"), str(tmp_path / "a")], [str(converted), str(tmp_path / "b"),
                                                                      "--config", str(tmp_path / "none.json")]):
        done = cli("from-dcp", *args, *([] if "--config" in args else ["--config", "tiny"]))
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "b").exists()


def test_export_of_from_dcp_output_says_how_to_get_a_save_it_reads(back_to_zero: Path, tmp_path: Path) -> None:
    done = cli("export", str(back_to_zero), str(tmp_path / "hf"))
    line = done.stderr.strip()
    assert done.returncode != 0 and "\n" not in line and "converted back from the DCP checkpoint" in line, line
    assert "load_universal" in line and not (tmp_path / "hf").exists()
