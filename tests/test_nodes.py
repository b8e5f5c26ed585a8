"""Two nodes simulated on 127.0.0.1 (two `train --nnodes 2` launches of one rank each): a shared output folder,
node-local folders, the start-up layout check, a node killed mid-save. Real launches, real files, no mocks."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli

from zckpt_nb.convert.zero_to_fp32 import run_zero_to_fp32
from zckpt_nb.format.layout import MANIFEST, committed_tags, latest_name
from zckpt_nb.run import lock
from zckpt_nb.run.launch import free_port, kill_tree

STEPS, EVERY = 6, 2
LAYOUT_LINE = "is not one shared folder: node 1"


def two_nodes(dirs: list[Path], *args: str, fault: str | None = None, timeout: float = 300) -> list[tuple[int, str]]:
    """Launch node 0 and node 1 (one rank each) into `dirs[0]` and `dirs[1]`; (exit code, output) per node.

    `fault` (ZCKPT_FAULT) goes to node 1 only. Past `timeout` every process of both launches is killed.
    """
    port, procs, logs = free_port(), [], []
    for node, out in enumerate(dirs):
        logs.append(out.parent / f"{out.name}.node{node}.txt")
        env = {k: v for k, v in os.environ.items() if k != "ZCKPT_FAULT"}
        if fault and node == 1:
            env["ZCKPT_FAULT"] = fault
        worker = ["--worker", "zckpt_nb.examples.faults"] if fault else []
        cmd = [sys.executable, "-m", "zckpt_nb", "train", "--nproc", "1", "--nnodes", "2", "--node_rank", str(node),
               "--master_port", str(port), "--output_dir", str(out), "--steps", str(STEPS), *worker, *args]
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-node launch ran past {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def verify_cli(ckpt_dir: Path) -> subprocess.CompletedProcess:
    return cli("verify", str(ckpt_dir))


def losses(out: Path) -> dict[int, float]:
    data = json.loads((out / "run.json").read_text())
    return dict(zip(data["steps"], data["losses"]))


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> Path:
    """Two nodes, one shared folder: save every 2 steps, keep the last 2."""
    out = tmp_path_factory.mktemp("shared") / "run"
    results = two_nodes([out, out], "--save_every", str(EVERY), "--keep_last", "2")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    return out


def test_two_nodes_share_one_folder_commit_rotate_and_verify(shared_run):
    assert committed_tags(shared_run) == ["global_step4", "global_step6"]  # global_step2 rotated away
    assert latest_name(shared_run) == "global_step6"
    manifest = json.loads((shared_run / "global_step6" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and sorted({f["rank"] for f in manifest["files"]}) == [0, 1]
    done = verify_cli(shared_run)
    assert done.returncode == 0 and "every size and SHA-256 matches" in done.stdout
    assert "[node 1 rank 1] rank 1/2 on cpu" in (shared_run / "launch.node1.log").read_text()  # labels name the node
    assert not list(shared_run.glob(".zckpt_lock*")) and not list(shared_run.glob(".zckpt_probe*"))


def test_two_nodes_resume_from_the_shared_folder(shared_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(shared_run, out)
    shutil.rmtree(out / "global_step6")  # resume from step 4, so steps 4 and 5 are trained again
    results = two_nodes([out, out], "--resume", "--save_checkpoint")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    again, first = losses(out), losses(shared_run)
    assert sorted(again) == [4, 5] and max(abs(again[s] - first[s]) for s in again) <= 1e-5
    assert latest_name(out) == "global_step6" and verify_cli(out).returncode == 0


def test_separate_folders_without_node_local_storage_are_refused_in_one_line(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    results = two_nodes(dirs, "--save_every", str(EVERY))
    for (code, text), out in zip(results, dirs):
        assert code != 0
        refusals = [line for line in text.splitlines() if LAYOUT_LINE in line]
        assert refusals and f"--output_dir {out} is not one shared folder" in refusals[0]
        assert "--node_local_storage" in refusals[0] and "step 1/" not in text  # refused before training
        assert sorted(p.name for p in out.iterdir()) == [f"launch{'.node1' if out.name == 'node1' else ''}.log"]


@pytest.mark.parametrize("point", ["shards", "before_commit"])
def test_a_node_killed_mid_save_keeps_the_previous_commit_and_resumes(shared_run, tmp_path, point):
    out = tmp_path / "run"
    results = two_nodes([out, out], "--save_every", str(EVERY), "--collective_timeout", "60", fault=f"{point}:1:4")
    assert results[0][0] != 0 and results[1][0] != 0
    assert f"rank 1 injects '{point}'" in results[1][1]
    assert latest_name(out) == "global_step2" and committed_tags(out) == ["global_step2"]
    assert verify_cli(out).returncode == 0
    results = two_nodes([out, out], "--resume", "--save_every", str(EVERY))
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    again, first = losses(out), losses(shared_run)
    assert sorted(again) == [2, 3, 4, 5] and max(abs(again[s] - first[s]) for s in again) <= 1e-5
    assert latest_name(out) == "global_step6" and verify_cli(out).returncode == 0


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> list[Path]:
    """Two nodes, each with its own folder (--node_local_storage): save every 2 steps, keep the last 2."""
    root = tmp_path_factory.mktemp("local")
    dirs = [root / "node0", root / "node1"]
    results = two_nodes(dirs, "--save_every", str(EVERY), "--keep_last", "2", "--node_local_storage")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    return dirs


def test_node_local_folders_hold_their_part_and_a_manifest_of_the_whole(local_run):
    for node, out in enumerate(local_run):
        assert committed_tags(out) == ["global_step4", "global_step6"]  # rotated on every node
        assert latest_name(out) == "global_step6"
        own = [f"zero_pp_rank_{node}_mp_rank_00_{kind}_states.pt" for kind in ("model", "optim")]
        assert sorted(p.name for p in (out / "global_step6").iterdir()) == [MANIFEST, *own]
        manifest = json.loads((out / "global_step6" / MANIFEST).read_text())
        assert manifest["node"] == node and [(f["rank"], f["node"]) for f in manifest["files"]] == \
            [(0, 0), (0, 0), (1, 1), (1, 1)]
        assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file() and (out / "run.json").is_file()
        done = verify_cli(out)
        assert done.returncode == 0 and len(done.stdout.strip().splitlines()) == 1
        assert f"node {node}'s part checked here" in done.stdout
        assert f"2 files live on node(s) {1 - node}" in done.stdout


def test_collect_assembles_the_parts_for_export_and_zero_to_fp32(local_run, tmp_path):
    import torch

    whole = tmp_path / "whole"
    done = cli("collect", *map(str, local_run), str(whole))
    assert done.returncode == 0, done.stderr
    assert verify_cli(whole).stdout.startswith("ok: global_step6 (step 6, 2 ranks, 4 files")
    state = torch.load(run_zero_to_fp32(whole, tmp_path / "fp32") / "pytorch_model.bin",
                       map_location="cpu", weights_only=True)
    assert sum({t.data_ptr(): t.numel() for t in state.values()}.values()) == json.loads(
        (local_run[0] / "run.json").read_text())["num_params"]
    exported = cli("export", str(whole), str(tmp_path / "hf"))
    assert exported.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), exported.stderr
    one = cli("collect", str(local_run[0]), str(tmp_path / "half"))
    assert one.returncode == 1 and "no folder given for node(s) 1" in one.stderr
    assert len(one.stderr.strip().splitlines()) == 1 and not (tmp_path / "half").exists()


def test_node_local_resume_takes_the_newest_checkpoint_committed_on_every_node(local_run, shared_run, tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for src, dst in zip(local_run, dirs):
        shutil.copytree(src, dst)
    (dirs[1] / "global_step6" / MANIFEST).unlink()  # node 0 committed step 6, node 1 crashed before it did
    results = two_nodes(dirs, "--resume", "--save_checkpoint", "--node_local_storage")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    note = next(line for line in results[0][1].splitlines() if "ignoring global_step6" in line)
    assert "(not committed on every node)" in note and note.endswith("resuming from global_step4")
    again, first = losses(dirs[0]), losses(shared_run)  # the same job as the shared one, file for file
    assert sorted(again) == [4, 5] and max(abs(again[s] - first[s]) for s in again) <= 1e-5
    assert all(verify_cli(out).returncode == 0 and latest_name(out) == "global_step6" for out in dirs)


def test_node_local_storage_in_one_shared_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    results = two_nodes([out, out], "--node_local_storage")
    for code, text in results:
        assert code != 0 and "--node_local_storage, but node 0" in text and "write into one shared folder" in text
        assert "step 1/" not in text


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "--nnodes 2 needs --master_port"),
    (["--nnodes", "2", "--node_rank", "2", "--master_port", "29500"], "--node_rank in 0..1"),
    (["--master_port", "70000"], "--master_port must be a TCP port"),
])
def test_bad_node_flags_are_refused_in_one_line_before_any_rank_starts(tmp_path, args, message):
    done = cli("train", "--output_dir", str(tmp_path / "out"), *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_nodes_of_one_job_share_a_folder_lock_and_another_job_is_refused(tmp_path):
    node0 = lock.take(tmp_path, "127.0.0.1:1111", 0)
    node1 = lock.take(tmp_path, "127.0.0.1:1111", 1)
    for job, node in [("127.0.0.1:2222", 2), ("", 0)]:  # another two-node job, a one-node job
        with pytest.raises(lock.FolderInUse, match="in use by another job"):
            lock.take(tmp_path, job, node)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK, f"{lock.LOCK}.node1"]
    lock.release(tmp_path, node1)
    lock.release(tmp_path, node0)
    assert not list(tmp_path.iterdir())
