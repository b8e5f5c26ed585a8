"""Four routes to one full model, on a real 2-rank ZeRO-3 run: equal to the engine's weights, costs measured."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import cli
from weights import compare_weights, load_weights, reference_state_dict

from zckpt_nb.data import corpus_text
from zckpt_nb.format.layout import MANIFEST
from zckpt_nb.measure import meters
from zckpt_nb.run.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_tools import measure_export, measure_offline  # noqa: E402  (benchmarks/bench_tools.py)

STEPS = 150  # enough for greedy text that reads like the corpus
ROUTES = {"save_16bit": True, "save_gathered": True}


@pytest.fixture(scope="module")
def routes_run(tmp_path_factory):
    """Train tiny on 2 CPU ranks, save partitioned, then routes 1 and 2."""
    out = tmp_path_factory.mktemp("routes")
    return launch(2, STEPS, out, save_checkpoint=True, **ROUTES, verbose=False, progress=False, timeout=600)


@pytest.fixture(scope="module")
def reference(routes_run):
    return reference_state_dict(routes_run.output_dir)


@pytest.fixture(scope="module")
def offline(routes_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("offline") / "fp32"
    return out, measure_offline(routes_run.output_dir, out)


@pytest.fixture(scope="module")
def hf(routes_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    return out, measure_export(routes_run.output_dir, out)


# --- fast checks of the measuring and comparing pieces (no distributed job) ---

def test_peak_rss_sees_a_large_allocation_during_the_block():
    def hold() -> None:  # 200 MB for 0.3 s: several of the heap sampler's 50 ms periods, even on a loaded machine
        big = torch.ones(50_000_000)
        time.sleep(0.3)
        big.sum()

    cost = meters.measure("probe", hold, written=list)
    assert cost.extra_peak_bytes >= 150 * 2**20 and cost.peak_memory_bytes >= cost.extra_peak_bytes
    assert cost.heap_extra_peak_bytes >= 190 * 2**20  # the 200 MB tensor, seen by malloc's own count
    assert cost.comm_bytes == 0 and cost.bytes_written == 0  # no process group: nothing could be communicated


def dirty_bytes() -> int:
    """The kernel's count of page-cache bytes written but not yet on disk."""
    line = next(x for x in open("/proc/meminfo") if x.startswith("Dirty:"))
    return int(line.split()[1]) * 1024


def test_flush_writes_leaves_no_earlier_write_for_the_next_timed_route(tmp_path):
    (tmp_path / "buffered").write_bytes(b"x" * 2**26)  # 64 MiB through the page cache, no fsync
    before = dirty_bytes()
    meters.flush_writes()
    assert before >= 2**25 and dirty_bytes() < before - 2**25


def test_comm_delta_keeps_only_what_happened_between_snapshots():
    before = {"all_gather_into_tensor": {100: 3}, "barrier": {0: 1}}
    after = {"all_gather_into_tensor": {100: 4, 300: 1}, "barrier": {0: 1}, "broadcast": {64: 1}}
    assert meters.comm_delta(before, after) == {
        "all_gather_into_tensor": {"count": 2, "bytes": 400, "max_bytes": 300},
        "broadcast": {"count": 1, "bytes": 64, "max_bytes": 64}}
    assert meters.comm_delta(None, after) is None


def test_compare_catches_one_changed_element_and_a_missing_tensor():
    ref = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    same = {k: v.clone() for k, v in ref.items()}
    assert compare_weights(same, ref)["exact"]
    same["a"][1, 2] += 1e-6
    result = compare_weights(same, ref)
    assert not result["exact"] and result["max_abs_diff"] > 0
    assert compare_weights({"a": ref["a"]}, ref)["missing"] == ["b"]


# --- the routes agree with the engine's own weights ---

def test_reference_holds_every_parameter_of_the_engine(routes_run, reference):
    assert sum(t.numel() for t in reference.values()) == routes_run.num_params
    assert all(t.dtype == torch.float32 for t in reference.values())


def route_weights(name, routes_run, offline, hf):
    paths = {"gathered16": routes_run.output_dir / "gathered16", "per_param": routes_run.output_dir / "per_param",
             "offline": offline[0], "hf": hf[0]}
    return load_weights(paths[name])


@pytest.mark.parametrize("route", ["gathered16", "per_param", "offline", "hf"])
def test_every_tensor_of_every_route_equals_the_engine_weights_exactly(route, routes_run, reference, offline, hf):
    weights = route_weights(route, routes_run, offline, hf)
    result = compare_weights(weights, reference)
    assert result["missing"] == [] and result["bad_shape"] == []
    assert result["exact"], f"{route}: max abs difference {result['max_abs_diff']}"
    # route 1 is "16-bit" only when training is: CPU fp32 runs keep fp32, so it must be exact too
    assert result["dtypes"] == ["torch.float32"]
    # the only extra name allowed is GPT-2's tied head, and it must be the embedding
    assert set(result["extra"]) <= {"lm_head.weight"}
    if "lm_head.weight" in weights:
        assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])


# --- what each route cost, from the files and DeepSpeed's comms logger ---

def padded_param_bytes(reference, world):
    """Bytes ZeRO-3 all-gathers for every parameter once: each is padded to a multiple of N elements."""
    return sum(-(-t.numel() // world) * world * t.element_size() for t in reference.values())


def test_save_costs_has_a_record_per_mode_and_rank(routes_run):
    records = routes_run.save_costs
    assert {(c["mode"], c["rank"]) for c in records} == {(m, r) for m in ("partitioned", "gathered16", "per_param")
                                                         for r in (0, 1)}
    keys = {"mode", "rank", "seconds", "peak_memory_bytes", "extra_peak_bytes", "bytes_written", "comm_bytes",
            "comm_ops"}
    assert all(keys <= set(vars(c)) and c.seconds > 0 and c.peak_memory_bytes > 0 for c in records)


def test_bytes_written_are_the_files_each_rank_wrote(routes_run):
    out = routes_run.output_dir
    by = {(c["mode"], c["rank"]): c for c in routes_run.save_costs}
    for rank in (0, 1):
        files = [f for f in routes_run.ranks[rank]["files"] if not f["path"].endswith(MANIFEST)]
        # the save's measured bytes are the rank's files; run.json also lists the manifest rank 0 commits after them
        assert by["partitioned", rank]["bytes_written"] == sum(f["bytes"] for f in files)
    assert any(f["path"].endswith(MANIFEST) for f in routes_run.ranks[0]["files"])
    for mode in ("gathered16", "per_param"):
        assert by[mode, 0]["bytes_written"] == (out / mode / "pytorch_model.bin").stat().st_size > 0
        assert by[mode, 1]["bytes_written"] == 0  # rank 0 writes the consolidated file; rank 1 only sends


def test_collective_bytes_match_the_seed_table(routes_run, reference):
    by = {(c["mode"], c["rank"]): c for c in routes_run.save_costs}
    full = padded_param_bytes(reference, 2)
    for rank in (0, 1):
        # partitioned: no gather at all, only a few bytes of agreement (tag check) and barriers
        assert by["partitioned", rank]["comm_bytes"] < 1024
        assert "all_gather_into_tensor" not in by["partitioned", rank]["comm_ops"]
        # per-parameter: one all-gather per tensor; DeepSpeed logs each rank's input, so over N ranks that is P
        per_param = by["per_param", rank]["comm_ops"]
        assert set(per_param) == {"all_gather_into_tensor"} and per_param["all_gather_into_tensor"]["count"] == len(
            reference)
    assert sum(by["per_param", r]["comm_bytes"] for r in (0, 1)) == full
    # save_16bit_model gathers module by module (the tied embedding twice) and broadcasts each back from rank 0
    g16 = by["gathered16", 0]["comm_ops"]
    assert g16["all_gather_into_tensor"]["bytes"] * 2 > full and g16["broadcast"]["bytes"] > full
    assert by["gathered16", 0]["comm_bytes"] > 2 * by["per_param", 0]["comm_bytes"]


def test_offline_and_hf_read_every_shard_and_communicate_nothing(routes_run, offline, hf):
    shards = sorted((routes_run.output_dir / routes_run.latest_tag).glob("zero_pp_rank_*"))
    assert len(shards) == 4  # model and optimizer states of both ranks
    for out, cost in (offline, hf):
        assert cost.rank == 0 and cost.comm_bytes == 0 and cost.comm_ops == {}
        assert cost.bytes_read == sum(p.stat().st_size for p in shards)
        assert cost.bytes_written == sum(p.stat().st_size for p in meters.files_under(out)) > 0


# --- the HF export, reloaded without DeepSpeed ---

RELOAD = """import json, sys
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
reference = torch.load(sys.argv[2], map_location="cpu", weights_only=True)
with torch.no_grad():
    out = model(input_ids=reference["input_ids"]).logits
print(json.dumps({"class": type(model).__name__, "logits_shape": list(out.shape),
                  "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                  "max_abs_logit_diff": float((out - reference["logits"]).abs().max()),
                  "deepspeed_imported": "deepspeed" in sys.modules}))
"""


def reference_logits(reference, path):
    """Logits of a GPT-2 built by transformers from `reference` on two sequences of the corpus, saved to `path`."""
    from transformers import AutoModelForCausalLM

    from zckpt_nb.data import encode_corpus, load_or_train_tokenizer
    from zckpt_nb.model import get_preset, gpt2_config

    model = AutoModelForCausalLM.from_config(gpt2_config("tiny")).eval()
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the tied head is the embedding
    tokens = encode_corpus(load_or_train_tokenizer("", get_preset("tiny").vocab_size))
    input_ids = tokens[:128].reshape(2, 64)
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "logits": model(input_ids=input_ids).logits}, path)
    return path


def reload_in_fresh_process(model_dir, reference) -> dict:
    """The export loaded by transformers alone in a new Python process: its logits against the reference's."""
    done = subprocess.run([sys.executable, "-c", RELOAD, str(model_dir), str(reference)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def corpus_overlap(text: str) -> dict:
    """How much of `text` comes from the shipped corpus: the share of its words found there, and its word trigrams."""
    def split(t: str) -> list[str]:  # words only: punctuation and line breaks do not count
        return re.findall(r"[A-Za-z']+", t)

    corpus_words, words = split(corpus_text()), split(text)
    joined, vocabulary = f" {' '.join(corpus_words)} ", set(corpus_words)
    trigrams = [" ".join(words[i:i + 3]) for i in range(len(words) - 2)]
    return {"words in corpus": sum(w in vocabulary for w in words) / max(1, len(words)),
            "trigrams in corpus": [t for t in trigrams if f" {t} " in joined]}


def test_hf_export_reloads_without_deepspeed_and_gives_the_checkpoints_logits(hf, reference, tmp_path):
    report = reload_in_fresh_process(hf[0], reference_logits(reference, tmp_path / "logits.pt"))
    assert report["deepspeed_imported"] is False
    assert report["class"] == "GPT2LMHeadModel" and report["tied"] is True
    assert report["logits_shape"][0] == 2 and report["max_abs_logit_diff"] <= 1e-5
    assert {p.name for p in hf[0].iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                                 "tokenizer.json", "tokenizer_config.json"}


def test_generate_cli_writes_text_from_the_corpus(hf):
    done = cli("generate", str(hf[0]), "--prompt", "The keeper", "--max_new_tokens", "40")
    assert done.returncode == 0, done.stderr
    text = done.stdout.strip()
    assert text.startswith("The keeper") and len(text) > len("The keeper") + 20
    overlap = corpus_overlap(text)
    assert overlap["words in corpus"] >= 0.9 and len(overlap["trigrams in corpus"]) >= 3  # its words and phrases


def test_corpus_overlap_is_low_for_text_from_elsewhere():
    overlap = corpus_overlap("Quantum chromodynamics predicts asymptotic freedom of gluons at high energies")
    assert overlap["words in corpus"] < 0.5 and overlap["trigrams in corpus"] == []


def test_export_cli_shards_above_max_shard_size(routes_run, reference, tmp_path):
    out = tmp_path / "sharded"
    done = cli("export", str(routes_run.output_dir), str(out), "--max_shard_size", "200KB")
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    names_in = {p.name: [k for k, v in index["weight_map"].items() if v == p.name] for p in shards}
    for p in shards:  # within the limit (plus the JSON header), unless one tensor alone is larger
        assert p.stat().st_size <= 200_000 + 2**14 or len(names_in[p.name]) == 1
    assert compare_weights(load_weights(out), reference)["exact"]


# --- bad input: one line, exit 2, nothing written ---

def bad_checkpoint(kind, src, tmp_path):
    """A folder that is not a usable checkpoint, made from the good one."""
    if kind == "not_a_checkpoint":
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "notes.txt").write_text("hello")
        return tmp_path / "plain"
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("gathered16", "per_param"))
    tag = (dst / "latest").read_text().strip()
    if kind == "missing_rank_file":
        (dst / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    if kind == "no_tokenizer":
        (dst / "tokenizer.json").unlink()
    if kind == "truncated_shard":
        path = dst / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        path.write_bytes(path.read_bytes()[:5000])
    return dst


@pytest.mark.parametrize("kind, extra, message", [
    ("not_a_checkpoint", [], "not a ZeRO checkpoint"),
    ("good", ["--tag", "global_step999"], "tag global_step999 does not exist"),
    ("missing_rank_file", [], "is missing (rank 1's file)"),  # the manifest names it before anything is read
    ("truncated_shard", [], "truncated or rewritten"),  # the manifest check (issue 5) names it first
    ("no_tokenizer", [], "tokenizer.json is missing"),  # the manifest lists it
    ("good", ["--max_shard_size", "lots"], "is not a size"),
])
def test_export_refuses_bad_input_and_writes_nothing(routes_run, tmp_path, kind, extra, message):
    ckpt = bad_checkpoint(kind, routes_run.output_dir, tmp_path) if kind != "good" else routes_run.output_dir
    out = tmp_path / "exports" / "model"
    done = cli("export", str(ckpt), str(out), *extra)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "exports").exists(), "no output folder, no temporary folder left behind"


def test_export_replaces_only_a_previous_export_and_only_with_overwrite(routes_run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    for flags, message in (([], "not empty; pass --overwrite"), (["--overwrite"], "keep.txt, which zckpt_nb did not")):
        done = cli("export", str(routes_run.output_dir), str(mine), *flags)
        assert done.returncode == 2 and message in done.stderr
        assert [p.name for p in mine.iterdir()] == ["keep.txt"]
    model = tmp_path / "model"
    assert cli("export", str(routes_run.output_dir), str(model)).returncode == 0
    (model / "stale.txt").write_text("not the export's")
    for flags in ([], ["--overwrite"]):  # a file the export did not write: kept, and named
        done = cli("export", str(routes_run.output_dir), str(model), *flags)
        assert done.returncode == 2 and (model / "stale.txt").is_file()
    assert "stale.txt" in done.stderr
    (model / "stale.txt").unlink()
    (model / "model.safetensors").write_bytes(b"edited")  # the export's own files, changed: still its output
    assert cli("export", str(routes_run.output_dir), str(model), "--overwrite").returncode == 0
    assert (model / "model.safetensors").stat().st_size > 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model"]  # no temporary folder left behind


# --- an export that loads everywhere: portable tokenizer, its context, shared modes, a model card ---

def test_export_tokenizer_is_portable_and_limited_to_the_model_context(hf):
    from transformers import AutoConfig, AutoTokenizer

    saved = json.loads((hf[0] / "tokenizer_config.json").read_text())
    context = AutoConfig.from_pretrained(hf[0]).n_positions
    # transformers 4.x does not know TokenizersBackend (benchmarks/load_with_transformers4.py loads this name)
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert saved["model_max_length"] == context == 64 and "is_local" not in saved
    assert AutoTokenizer.from_pretrained(hf[0]).model_max_length == context


def long_prompt(tokenizer, tokens):
    """Corpus text of exactly `tokens` tokens."""
    from zckpt_nb.data import corpus_text

    ids = tokenizer(corpus_text()[:4000])["input_ids"][:tokens]
    prompt = tokenizer.decode(ids)
    assert len(tokenizer(prompt)["input_ids"]) == tokens
    return prompt


def test_generate_refuses_a_prompt_that_does_not_fit_the_context(hf):
    from transformers import AutoTokenizer

    from zckpt_nb.convert.export import generate
    from zckpt_nb.errors import UsageError

    tokenizer = AutoTokenizer.from_pretrained(hf[0])
    done = cli("generate", str(hf[0]), "--prompt", long_prompt(tokenizer, 60), "--max_new_tokens", "10")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [  # one line: the count, the room left, the context
        "zckpt_nb generate: error: the prompt is 60 tokens; with --max_new_tokens 10 it may be at most 54 (the "
        "model's context is 64 tokens): shorten it or lower --max_new_tokens"]
    with pytest.raises(UsageError, match="leaves no room for a prompt"):
        generate(hf[0], "The keeper", max_new_tokens=64)
    fits = long_prompt(tokenizer, 54)  # the longest prompt that fits generates without an IndexError
    assert generate(hf[0], fits, max_new_tokens=10).startswith(fits)


def test_export_folder_and_files_get_the_modes_of_the_process_umask(routes_run, tmp_path):
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        out = tmp_path / f"umask{umask:03o}"
        done = subprocess.run([sys.executable, "-m", "zckpt_nb", "export", str(routes_run.output_dir), str(out)],
                              capture_output=True, text=True, timeout=300, umask=umask)
        assert done.returncode == 0, done.stderr
        assert out.stat().st_mode & 0o777 == folder_mode
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {file_mode}, modes


def test_model_card_states_the_run_facts_and_the_hub_front_matter(routes_run, hf):
    from transformers import AutoConfig, AutoTokenizer

    from zckpt_nb.format.manifest import sha256_file

    card = (hf[0] / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert {"library_name: transformers", "pipeline_tag: text-generation", "license: mit"} <= set(front.splitlines())
    tag = routes_run.latest_tag
    rows = dict(line.strip("|").split(" | ", 1) for line in body.splitlines() if line.startswith("| "))
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["source checkpoint tag"] == tag
    sha = sha256_file(routes_run.output_dir / tag / MANIFEST)
    assert rows["SHA-256 of the tag's `zckpt_manifest.json`"] == f"`{sha}`"
    assert rows["preset"] == "tiny" and rows["world size (ranks that trained and saved it)"] == "2"
    assert rows["training steps"] == str(STEPS)
    assert rows["loss at the last step"] == f"{routes_run.losses[-1]:.4f} (run.json)"
    assert rows["parameters"] == f"{routes_run.num_params:,} (the head is tied to the embedding)"
    assert rows["architecture"] == "`gpt2`" and "- gpt2" in front.splitlines()
    entries, vocab = len(AutoTokenizer.from_pretrained(hf[0])), AutoConfig.from_pretrained(hf[0]).vocab_size
    assert entries < vocab and f"The tokenizer has {entries} entries; the model's vocabulary has {vocab} rows" in card
    assert f'from_pretrained("{hf[0].name}")' in card


def test_generate_refuses_a_folder_that_is_not_a_model(tmp_path):
    done = cli("generate", str(tmp_path), "--prompt", "The keeper")
    assert done.returncode == 2 and "not a Hugging Face model folder" in done.stderr
