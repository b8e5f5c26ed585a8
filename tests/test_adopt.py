"""Checkpoints this package did not write: a raw DeepSpeed loop's tiny Llama (GQA, untied head), fp32 and bf16,
through adopt, inspect, verify, export, generate, reshard; and a user's loop through zckpt_nb.save / resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli

from zckpt_nb.convert.adopt import ACCELERATE_FILE
from zckpt_nb.errors import LaunchError
from zckpt_nb.format.layout import MANIFEST
from zckpt_nb.run.launch import launch_module

LOOP = "zckpt_nb.examples.own_loop"
TAG = "global_step4"


def own_loop(out, *args, nproc=2) -> list[str]:
    """The user's script on `nproc` CPU ranks under torchrun; its output lines."""
    log, _ = launch_module(LOOP, [str(out), "--steps", "4", *args], nproc=nproc, timeout=300, name=f"own loop {out}",
                           verbose=False, progress=False)
    return log


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def foreign(request, tmp_path_factory):
    """A 2-rank checkpoint saved by DeepSpeed's engine.save_checkpoint alone, then copied aside untouched."""
    out = tmp_path_factory.mktemp(f"llama_{request.param}") / "ckpt"
    own_loop(out, "--dtype", request.param)
    pristine = out.parent / "pristine"
    shutil.copytree(out, pristine)
    return request.param, out, pristine


def test_an_unadopted_checkpoint_is_inspected_read_only_and_verify_points_to_adopt(foreign):
    _, _, pristine = foreign
    shown = cli("inspect", pristine)
    assert shown.returncode == 0 and "N = 2 ranks" in shown.stdout
    assert "not committed: it has no manifest" in shown.stdout
    checked = cli("verify", pristine)
    assert checked.returncode == 1 and f"python -m zckpt_nb adopt {pristine} --tag {TAG}" in checked.stderr
    assert "incomplete checkpoint" not in checked.stderr
    assert not (pristine / TAG / MANIFEST).exists()  # reading wrote nothing


def test_adopt_commits_what_the_files_record(foreign):
    import deepspeed

    dtype, out, _ = foreign
    done = cli("adopt", out)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / TAG / MANIFEST).read_text())
    facts = manifest["adopted"]
    assert (facts["world_size"], facts["dtype"], facts["step"]) == (2, dtype, 4)
    assert facts["deepspeed_version"] == deepspeed.__version__ and manifest["identity"]["model_type"] == "llama"
    assert {e["path"] for e in manifest["shared"]} == {"config.json"}  # no tokenizer was saved
    assert cli("verify", out).returncode == 0 and "adopted (written by DeepSpeed" in cli("inspect", out).stdout
    assert cli("adopt", out).returncode == 0  # a second time: already committed, only verified


def test_adopt_refuses_an_incomplete_checkpoint_naming_what_is_missing(foreign, tmp_path):
    _, _, pristine = foreign
    partial = tmp_path / "partial"
    shutil.copytree(pristine, partial)
    optim = next((partial / TAG).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    optim.unlink()
    done = cli("adopt", partial)
    assert done.returncode == 1 and "rank 1's optim states missing" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (partial / TAG / MANIFEST).exists()


def test_the_export_equals_deepspeeds_fp32_reconstruction_and_its_card_states_only_facts(foreign, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    _, out, _ = foreign
    assert cli("adopt", out).returncode == 0
    hf = tmp_path / "hf"
    done = cli("export", out, hf)
    assert done.returncode == 0, done.stderr
    assert "has no tokenizer" in done.stdout and not (hf / "tokenizer.json").exists()
    exported = load_file(hf / "model.safetensors")
    reference = get_fp32_state_dict_from_zero_checkpoint(str(out), TAG)
    assert set(exported) == set(reference) and "lm_head.weight" in exported  # untied: the head has its own weights
    assert max(float((exported[k] - reference[k].detach()).abs().max()) for k in exported) == 0.0
    card = (hf / "README.md").read_text()
    assert "`llama`" in card and "the output head has weights of its own" in card and "- llama" in card
    assert "gpt2" not in card and "corpus" not in card and "preset" not in card
    ids = cli("generate", hf, "--token_ids", 5, 6, 7, "--max_new_tokens", 4)
    assert ids.returncode == 0 and len(ids.stdout.split()) == 7 and ids.stdout.split()[:3] == ["5", "6", "7"]
    text = cli("generate", hf, "--prompt", "hello")
    assert text.returncode == 2 and len(text.stderr.strip().splitlines()) == 1 and "--token_ids" in text.stderr


def test_an_adopted_checkpoint_reshards_and_train_resume_says_what_to_do(foreign, tmp_path):
    _, out, _ = foreign
    assert cli("adopt", out).returncode == 0
    done = cli("reshard", out)
    assert done.returncode == 0 and "ok: universal copy of global_step4" in done.stdout, done.stderr
    resumed = cli("train", "--nproc", 2, "--output_dir", out, "--resume", "--steps", 6, "--timeout", 300)
    refusals = [line for line in resumed.stderr.splitlines() if "trained outside zckpt_nb (adopted)" in line]
    assert resumed.returncode == 1 and "zckpt_nb.resume(engine, output_dir)" in resumed.stderr
    assert len(resumed.stderr.strip().splitlines()) == 3 and len(refusals) == 1, resumed.stderr  # job, why, log


def test_a_users_loop_commits_and_resumes_with_no_tokenizer_and_no_scheduler(tmp_path):
    out = tmp_path / "mine"
    saved = own_loop(out, "--save", "zckpt")
    assert sum(line.endswith("save global_step4: committed True") for line in saved) == 2  # both ranks
    assert cli("verify", out).returncode == 0
    resumed, _ = launch_module(LOOP, [str(out), "--steps", "6", "--save", "zckpt", "--resume"], nproc=2, timeout=300,
                               name="resume own loop", verbose=False, progress=False)
    assert sum("resumed at step 4" in line for line in resumed) == 2
    assert sum("save global_step6: committed True" in line for line in resumed) == 2


def test_an_exception_on_rank_0_while_preparing_ends_the_save_with_one_line_on_every_rank(tmp_path):
    try:
        log = own_loop(tmp_path / "broken", "--save", "zckpt", "--fail_preparing")
    except LaunchError as e:  # a hang would be a LaunchTimeout; any failure of the job fails the test
        pytest.fail(f"the job failed instead of agreeing: {str(e).splitlines()[0]}")
    said = [line.split("] ", 1)[1].split(": ", 1)[1] for line in log if "save global_step4" in line]
    assert len(said) == 2 and said[0] == said[1]  # the same line on both ranks
    assert "committed False" in said[0] and "rank 0: RuntimeError preparing" in said[0]
    assert "this tokenizer cannot be saved" in said[0]


def trainer(out, *flags) -> None:
    """Notebook 08's Trainer loop (its `%%writefile` cell) on 2 CPU ranks: a tiny Qwen2 in bf16, ZeRO-3 through
    TrainingArguments (no train_batch_size), 4 steps and checkpoint-4; then its resume and control from it."""
    from zckpt_nb.course.runs import run

    script = notebook_script(out.parent, "trainer_loop.py")
    run(f"torchrun --standalone --nproc_per_node 2 {script} {out} --steps 4 --save_steps 4 --dtype bf16 "
        + " ".join(flags), timeout=300, echo=False)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """Hugging Face Trainer with a ZeRO-3 config (no train_batch_size) on 2 CPU ranks: a tiny Qwen2 in bf16."""
    out = tmp_path_factory.mktemp("trainer") / "run"
    trainer(out)
    return out


def test_a_trainer_checkpoint_is_adopted_exported_exactly_and_resharded(trainer_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    ckpt = trainer_run / "checkpoint-4"
    assert {"trainer_state.json", "config.json", "latest"} <= {p.name for p in ckpt.iterdir()}
    assert not list((trainer_run / "final").glob("*.safetensors"))  # save_model without the 16-bit gather: no weights
    done = cli("adopt", ckpt / TAG)  # the tag folder itself, as Trainer nests it
    assert done.returncode == 0 and "qwen2" in done.stdout and "bf16" in done.stdout, done.stderr
    hf = tmp_path / "hf"
    assert cli("export", ckpt, hf).returncode == 0
    exported, reference = load_file(hf / "model.safetensors"), get_fp32_state_dict_from_zero_checkpoint(str(ckpt), TAG)
    assert max(float((exported[k] - reference[k].detach()).abs().max()) for k in reference) == 0.0
    card = (hf / "README.md").read_text()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    last = [e["loss"] for e in state["log_history"] if e.get("step") == 4 and "loss" in e][-1]
    assert f"| loss at the last step | {float(last):.4f} (trainer_state.json) |" in card
    assert "ok: universal copy of global_step4" in cli("reshard", ckpt).stdout
    assert cli("generate", hf, "--token_ids", 1, 2, "--max_new_tokens", 3).returncode == 0


def saved_model(run_dir, tag) -> dict:
    """What `Trainer.save_model` wrote into `run_dir/final`: its files, and when it wrote weights, their dtype and
    their largest difference from DeepSpeed's fp32 masters of the last checkpoint rounded to that dtype."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    final, ckpt = run_dir / "final", next(run_dir.glob("checkpoint-*"))
    found = {"files": sorted(p.name for p in final.iterdir()), "dtype": None, "difference": None}
    weights = {k: v for path in sorted(final.glob("*.safetensors")) for k, v in load_file(path).items()}
    if weights:
        masters = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)
        dtype = next(iter(weights.values())).dtype
        found["dtype"] = str(dtype).removeprefix("torch.")
        found["difference"] = max(float((w.float() - masters[k].detach().to(dtype).float()).abs().max())
                                  for k, w in weights.items())
    return found


def test_trainer_save_model_writes_weights_only_with_the_16bit_gather(trainer_run, tmp_path):
    without = saved_model(trainer_run, TAG)
    assert TAG in without["files"] and without["dtype"] is None  # a partitioned save, no whole weights
    gathered = tmp_path / "gathered"
    trainer(gathered, "--gather_16bit")
    with_gather = saved_model(gathered, TAG)
    assert "model.safetensors" in with_gather["files"] and TAG not in with_gather["files"]
    assert with_gather["dtype"] == "bfloat16" and with_gather["difference"] == 0.0  # the masters, rounded to bf16


def test_adopt_records_accelerates_files_beside_the_tag_hashed_never_unpickled(foreign, tmp_path):
    _, _, pristine = foreign
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    for name in ("random_states_0.pkl", "random_states_1.pkl", "scheduler.bin", "custom_checkpoint_0.pkl"):
        (ckpt / name).write_bytes(b"not a pickle: adopt and verify only hash it " + name.encode())
    (ckpt / "notes.txt").write_text("a file of the user's, not accelerate's")
    done = cli("adopt", ckpt)
    assert done.returncode == 0 and "4 files of accelerate's beside it" in done.stdout, done.stderr
    shared = {e["path"]: e.get("rank") for e in json.loads((ckpt / TAG / MANIFEST).read_text())["shared"]}
    assert shared == {"config.json": 0, "random_states_0.pkl": 0, "random_states_1.pkl": 1, "scheduler.bin": 0,
                      "custom_checkpoint_0.pkl": 0}
    (ckpt / "scheduler.bin").write_bytes(b"X" + (ckpt / "scheduler.bin").read_bytes()[1:])  # one byte changed
    refused = cli("verify", ckpt)
    assert refused.returncode == 1 and "scheduler.bin does not match its SHA-256" in refused.stderr

    partial = tmp_path / "partial"
    shutil.copytree(pristine, partial)
    (partial / "random_states_0.pkl").write_bytes(b"rank 0 only")
    done = cli("adopt", partial)
    assert done.returncode == 1 and "RNG states (random_states_R.pkl) are there for rank 0, while" in done.stderr
    assert not (partial / TAG / MANIFEST).exists()


def notebook_script(folder, name) -> Path:
    """Notebook 08's script `name` (its `%%writefile` cell), written into `folder`."""
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "08_your_own_model.ipynb"
    cells = json.loads(notebook.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("%%writefile")
                  and "".join(c["source"]).splitlines()[0].endswith(f"/{name}"))
    script = folder / name
    script.write_text(source.split("\n", 1)[1])
    return script


def test_a_real_accelerate_save_state_is_adopted_with_its_files_and_a_changed_byte_refused(tmp_path):
    from zckpt_nb.course.runs import run

    out, script = tmp_path / "acc", notebook_script(tmp_path, "accelerate_loop.py")
    run(f"torchrun --standalone --nproc_per_node 2 {script} {out} --steps 2 --save_at 2", timeout=300, echo=False)
    written = {p.name for p in out.iterdir() if p.is_file()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= written, written
    assert cli("adopt", out).returncode == 0
    shared = {e["path"]: e for e in json.loads((out / "pytorch_model" / MANIFEST).read_text())["shared"]}
    extras = sorted(name for name in written if ACCELERATE_FILE.fullmatch(name))
    assert extras and all(name in shared for name in extras)  # every accelerate file save_state wrote
    assert (shared["random_states_1.pkl"]["rank"], shared["random_states_1.pkl"]["bytes"]) == (
        1, (out / "random_states_1.pkl").stat().st_size)
    assert cli("verify", out).returncode == 0
    rng = out / "random_states_1.pkl"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 1
    rng.write_bytes(bytes(data))
    refused = cli("verify", out)
    assert refused.returncode == 1 and "random_states_1.pkl does not match its SHA-256" in refused.stderr
