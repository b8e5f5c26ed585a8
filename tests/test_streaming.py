"""Streaming export: a model whose fp32 weights are several shards is written holding about one shard in memory."""

import json
import subprocess
import sys

import pytest

from zckpt_nb import consolidate
from zckpt_nb.launch import launch

SHARD = 2_000_000  # --max_shard_size 2MB (transformers counts MB in powers of ten)
MEASURE = """
import json, sys
from zckpt_nb.export import measure_export
cost = measure_export(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(json.dumps(cost.to_dict()))
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The `small` preset (3.7 M parameters, about 14 MiB in fp32), 2 steps on 2 CPU ranks, saved."""
    out = tmp_path_factory.mktemp("small")
    return launch(2, 2, out, save_checkpoint=True, model="small", verbose=False, progress=False, timeout=600)


def test_streaming_export_allocates_about_one_shard_not_the_model(small_run, tmp_path):
    out = tmp_path / "hf"
    # a fresh process: nothing allocated before, the export's own peak only
    done = subprocess.run([sys.executable, "-c", MEASURE, str(small_run.output_dir), str(out), str(SHARD)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cost = json.loads(done.stdout.strip().splitlines()[-1])
    fp32_bytes = small_run.num_params * 4
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    largest = max(p.stat().st_size for p in shards)
    assert fp32_bytes >= 4 * SHARD and len(shards) >= 4  # (a tensor above 2 MB, the embedding, has its own shard)
    # live heap at its peak: one shard's tensors plus safetensors' serialised copy of them, never the whole model
    assert cost["heap_extra_peak_bytes"] is not None, "needs glibc's mallinfo2 to count heap bytes"
    assert cost["heap_extra_peak_bytes"] <= 2 * largest + 2**20 < fp32_bytes / 2, (cost, fp32_bytes)
    # the ranks' fp32 partitions are read through mmap: RSS may add their file pages, never a second copy
    assert cost["extra_peak_bytes"] <= fp32_bytes + 2 * largest + 16 * 2**20, (cost, fp32_bytes)


def test_streaming_export_equals_deepspeeds_full_state_dict(small_run, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from zckpt_nb.export import export

    out = export(small_run.output_dir, tmp_path / "hf", max_shard_size=str(SHARD))
    full = get_fp32_state_dict_from_zero_checkpoint(str(small_run.output_dir))  # everything in memory at once
    assert full.pop("lm_head.weight") is full["transformer.wte.weight"]  # the tied head: stored once, as the embedding
    result = consolidate.compare(consolidate.load_weights(out), full)
    assert result["exact"] and result["extra"] == [] and result["tensors"] == len(full)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight is model.transformer.wte.weight
