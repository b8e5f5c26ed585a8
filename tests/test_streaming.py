"""Streaming export: a model whose fp32 weights are several shards is written in a few MiB of memory."""

import os
import sys
from pathlib import Path

import pytest
from weights import compare_weights, load_weights

from zckpt_nb.convert import streaming
from zckpt_nb.course.trace import rss_parts
from zckpt_nb.run.launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline_routes as offline  # noqa: E402  (benchmarks/offline_routes.py: the offline routes traced)

SHARD = 2_000_000  # --max_shard_size 2MB (transformers counts MB in powers of ten)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The `small` preset (3.7 M parameters, about 14 MiB in fp32), 2 steps on 2 CPU ranks, saved."""
    out = tmp_path_factory.mktemp("small")
    return launch(2, 2, out, save_checkpoint=True, model="small", verbose=False, progress=False, timeout=600)


def test_streaming_export_peak_rss_is_the_interpreter_plus_at_most_one_and_a_quarter_shards(tmp_path):
    """Issue 12's bound, on `medium` (214 MiB of fp32 weights) exported in 50 MB shards, as a user runs it."""
    run = launch(2, 1, tmp_path / "ckpt", save_checkpoint=True, model="medium", verbose=False, progress=False,
                 timeout=900)
    base = offline.baseline(repeats=1)
    command = offline.commands(run.output_dir, tmp_path, "50MB")["export"]
    record = offline.run_route("export", command, "50MB", timeout=600)
    assert run.num_params * 4 >= 4 * record["largest_shard"] > 0
    # without streaming the peak holds the model (DeepSpeed's converter: about 2x it) or at least one whole shard
    assert record["peak"] <= offline.memory_goal(base["peak"], record["largest_shard"]), (record["peak"], base)
    # the rank files' pages were read through mmap and released as written: they never pile up in RSS
    assert max(record["trace"]["file"]) < base["peak"] / 2


def test_dropping_pages_releases_mapped_file_pages_and_never_touches_anonymous_memory(tmp_path):
    import mmap

    import torch

    anonymous = torch.arange(4 * 2**20, dtype=torch.float32)  # 16 MiB on the heap
    streaming.drop_pages(anonymous.data_ptr(), anonymous.data_ptr() + anonymous.nbytes, streaming.MappedFiles())
    assert torch.equal(anonymous, torch.arange(4 * 2**20, dtype=torch.float32))
    path = tmp_path / "f.bin"
    anonymous.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=anonymous.numel(), dtype=torch.float32)
    assert torch.equal(mapped, anonymous)  # every page touched: now resident
    before = rss_parts(os.getpid())[1]
    streaming.drop_pages(mapped.data_ptr(), mapped.data_ptr() + mapped.nbytes, streaming.MappedFiles())
    assert rss_parts(os.getpid())[1] < before - 8 * 2**20
    assert torch.equal(mapped, anonymous) and mmap.PAGESIZE == streaming.PAGE  # read again from the file, unchanged


def test_streaming_export_equals_deepspeeds_full_state_dict(small_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from zckpt_nb.convert.export import export

    out = export(small_run.output_dir, tmp_path / "hf", max_shard_size=str(SHARD))
    full = get_fp32_state_dict_from_zero_checkpoint(str(small_run.output_dir))  # everything in memory at once
    assert full.pop("lm_head.weight") is full["transformer.wte.weight"]  # the tied head: stored once, as the embedding
    result = compare_weights(load_weights(out), full)
    assert result["exact"] and result["extra"] == [] and result["tensors"] == len(full)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight is model.transformer.wte.weight
