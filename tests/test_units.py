"""Fast checks of the pieces that need no distributed job."""

import math
import os

import pytest

from zckpt_nb import data
from zckpt_nb.cli import build_parser
from zckpt_nb.convert.verify import verify_tag
from zckpt_nb.errors import CheckpointError, UsageError
from zckpt_nb.format.manifest import Manifest, commit, file_entry
from zckpt_nb.model import PRESETS, accumulation_steps, ds_config, get_preset, ln_vocab, param_count
from zckpt_nb.run.launch import Progress, check_train_args, label, launch
from zckpt_nb.run.options import TrainOptions

pytestmark = pytest.mark.fast  # make test-fast


def test_presets_count_parameters_without_building_weights():
    sizes = {name: param_count(name) for name in PRESETS}
    assert sizes["tiny"] < 1_000_000 < sizes["small"] < sizes["medium"] < sizes["large"] < sizes["xl"]
    assert sizes["xl"] * 4 >= 2**30, "issue 12 needs one preset of at least 1 GiB of fp32 weights"
    assert sizes["medium"] >= 50_000_000, "issue 3/5 need one preset of at least 50M parameters"


def test_ds_config_is_zero3_with_every_parameter_partitioned():
    cfg = ds_config("tiny", steps=10)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert ds_config("tiny", steps=10, bf16=True)["bf16"]["enabled"] is True


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        get_preset("huge")


def test_tokenizer_is_deterministic_and_roundtrips_corpus_text():
    a, b = data.train_tokenizer(1024), data.train_tokenizer(1024)
    assert a.get_vocab() == b.get_vocab()
    text = "The keeper wrote one line in a thick book."
    assert a.decode(a(text)["input_ids"]) == text


def test_batches_depend_only_on_seed_and_step_and_ranks_split_them():
    tokens = data.encode_corpus(data.train_tokenizer(1024))
    kw = {"seed": 0, "global_batch": 5, "seq_len": 16}
    same = data.global_batch_for_step(tokens, step=3, **kw), data.global_batch_for_step(tokens, step=3, **kw)
    assert (same[0] == same[1]).all() and same[0].shape == (5, 16)
    assert not (same[0] == data.global_batch_for_step(tokens, step=4, **kw)).all()
    for world in (1, 2, 3, 7):  # every sample exactly once, contiguous, shares differ by at most one
        shares = [data.rank_share(5, world, r) for r in range(world)]
        assert [i for s in shares for i in s] == list(range(5))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    parts = data.micro_steps(range(3, 8), 2)
    assert parts == [range(3, 6), range(6, 8)] and data.micro_steps(range(0), 2) == [range(0), range(0)]


def test_accumulation_keeps_each_micro_step_within_the_preset():
    assert [accumulation_steps(16, n, 8) for n in (1, 2, 3, 4, 32)] == [2, 1, 1, 1, 1]
    assert ds_config("tiny", steps=10, world_size=1)["gradient_accumulation_steps"] == 2


def test_ln_vocab():
    assert ln_vocab("tiny") == pytest.approx(math.log(1024))


def test_torchrun_prefixes_become_rank_labels():
    assert label("[default1]:[rank1]: Traceback") == ("rank 1", " Traceback")
    assert label("[default0]:step 3/10 loss 1.0") == ("rank 0", "step 3/10 loss 1.0")
    assert label("W1121 something") == ("launcher", "W1121 something")


def test_progress_bar_follows_rank0_steps(capsys):
    p = Progress("job", show_lines=True, show_bar=True)
    for k in range(1, 21):
        p.line("rank 0", f"step {k}/20 loss 1.0")
    p.line("rank 1", "step 99/20 loss 1.0")  # only rank 0 drives the bar
    assert p.bar.n == 20
    p.close()
    printed = capsys.readouterr().out
    assert "[rank 0] step 20/20" in printed and "[rank 0] step 3/20" not in printed  # every step is in the bar


def test_more_gpu_ranks_than_gpus_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("zckpt_nb.run.launch.gpu_count", lambda: 1)  # pretend: this machine has one GPU
    with pytest.raises(UsageError, match="more GPU ranks than the 1 GPU"):
        check_train_args(2, TrainOptions(output_dir=str(tmp_path), steps=10))


@pytest.fixture
def fake_ckpt(tmp_path):
    """A committed 2-rank tag of random bytes (files of different sizes) with its manifest; the rank files in order."""
    tag_dir = tmp_path / "global_step1"
    tag_dir.mkdir()
    paths = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    for i, path in enumerate(paths):
        path.write_bytes(os.urandom(2**16 * (i + 1)))
    files = [file_entry(p, tag_dir, rank=int(p.name.split("_")[3])) for p in paths]
    commit(tag_dir, Manifest("global_step1", 1, files, world_size=2, identity={}))
    return paths


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)


def test_parallel_verification_reports_the_first_corrupted_file_in_manifest_order(fake_ckpt):
    root = fake_ckpt[0].parent.parent
    assert verify_tag(root, "global_step1").world_size == 2
    flip_last_byte(fake_ckpt[3])
    with pytest.raises(CheckpointError, match="rank_1_mp_rank_00_optim_states.pt does not match its SHA-256"):
        verify_tag(root, "global_step1")
    verify_tag(root, "global_step1", ranks=[0])  # a rank hashes only its own files
    flip_last_byte(fake_ckpt[1])
    with pytest.raises(CheckpointError, match="rank_0_mp_rank_00_optim_states.pt does not match"):
        verify_tag(root, "global_step1")
    with open(fake_ckpt[2], "ab") as f:  # a wrong size anywhere is reported before any hash
        f.write(b"x")
    with pytest.raises(CheckpointError, match="rank_1_mp_rank_00_model_states.pt has .* bytes"):
        verify_tag(root, "global_step1")


def test_train_cli_and_worker_read_the_same_options():
    """The `train` CLI, launch() and the worker share one definition: what the CLI parses is what the worker gets."""
    args = build_parser().parse_args(["train", "--output_dir", "x", "--gather_16bit", "off", "--save_16bit",
                                      "--deterministic", "off", "--persistence_threshold", "7", "--nproc", "3",
                                      "--collective_timeout", "12.5"])
    opts = TrainOptions.from_namespace(args)
    assert (opts.gather_16bit, opts.save_16bit, opts.deterministic, opts.persistence_threshold) == ("off", True,
                                                                                                   "off", 7)
    assert TrainOptions.parse(opts.argv()) == opts  # the worker's argparse reads back exactly these options
    assert "--seed" not in opts.argv()  # defaults are not spelled out


def test_launch_refuses_an_unknown_option_or_a_bad_choice_before_anything_starts(tmp_path):
    with pytest.raises(UsageError, match="unknown training option.*save_modes"):
        launch(2, 5, tmp_path / "a", save_modes="async")
    with pytest.raises(UsageError, match="save_mode='fast' is not one of commit, async"):
        launch(2, 5, tmp_path / "b", save_mode="fast")
    with pytest.raises(UsageError, match="global_batch=None: expected a value of type int"):
        launch(2, 5, tmp_path / "c", global_batch=None)
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_file_removed_after_it_was_listed_is_left_out_of_the_sizes(tmp_path):
    """A failed save's files are deleted by the rank that cleans up while another rank may still count them."""
    from zckpt_nb.format.layout import rank_files, sizes_of

    (tmp_path / "global_step8").mkdir()
    kept = tmp_path / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    kept.write_bytes(b"12345")
    assert sizes_of([kept, tmp_path / "global_step8" / "zero_pp_rank_1_mp_rank_00_model_states.pt"]) == {kept: 5}
    assert rank_files(tmp_path, "global_step8", 1) == [{"path": str(kept.relative_to(tmp_path)), "bytes": 5}]
