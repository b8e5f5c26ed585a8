"""A LoRA run (peft on the attention projections of a raw loop's tiny Llama, 2 CPU ranks, saved by DeepSpeed's
engine.save_checkpoint and adopted): `export` writes the adapter folder PeftModel loads, `export --merge` the merged
model from_pretrained loads, each with the trained model's logits (DeepSpeed's own fp32 reconstruction of the
checkpoint, put into peft's model); weights that do not match the model are refused in one line, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import cli, refused
from safetensors.torch import load_file

from zckpt_nb.convert.streaming import check_shapes
from zckpt_nb.errors import UsageError
from zckpt_nb.run.launch import launch_module

LOOP = "zckpt_nb.examples.own_loop"
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The loop with --lora, 3 steps, saved by DeepSpeed (adapter_config.json beside it) and adopted."""
    out = tmp_path_factory.mktemp("lora") / "run"
    launch_module(LOOP, [str(out), "--steps", "3", "--lora"], nproc=2, timeout=300, name="own loop --lora",
                  verbose=False, progress=False)
    assert cli("adopt", out).returncode == 0
    return out


@pytest.fixture(scope="module")
def trained(run):
    """DeepSpeed's fp32 state dict of the checkpoint (its own zero_to_fp32) and the model config."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    return get_fp32_state_dict_from_zero_checkpoint(str(run)), AutoConfig.from_pretrained(str(run))


def peft_reference(run, trained):
    """The trained peft model: the config, the run's adapter config and DeepSpeed's weights, loaded strictly."""
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    state, config = trained
    model = get_peft_model(AutoModelForCausalLM.from_config(config), PeftConfig.from_pretrained(str(run)))
    model.load_state_dict({k: v.clone() for k, v in state.items()})
    return model.eval()


def base_model(trained):
    """The plain Llama with the run's frozen base weights (peft's names undone)."""
    from transformers import AutoModelForCausalLM

    state, config = trained
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict({k.removeprefix(PREFIX).replace(".base_layer", ""): v.clone() for k, v in state.items()
                           if "lora_" not in k})
    return model.eval()


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_run_saved_peft_names_and_trained_the_adapter(run, trained):
    state, _ = trained
    assert (run / "adapter_config.json").is_file()
    lora_b = [v for k, v in state.items() if "lora_B" in k]
    assert len(lora_b) == 2 * 4 and all(k.startswith(PREFIX) for k in state)  # 2 layers x q, k, v, o
    assert all(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: the adapter changed the model


def test_export_writes_the_adapter_that_peft_loads_with_the_trained_logits(run, trained, tmp_path):
    from peft import PeftModel

    done = cli("export", run, tmp_path / "adapter")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    out = tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "config.json").exists()  # not a plain model: from_pretrained cannot mistake it for one
    saved, (state, _) = load_file(out / "adapter_model.safetensors"), trained
    assert len(saved) == 16 and all(torch.equal(v, state[k.replace(".weight", ".default.weight")])
                                    for k, v in saved.items())
    loaded = PeftModel.from_pretrained(base_model(trained), str(out)).eval()
    assert torch.equal(logits(loaded), logits(peft_reference(run, trained)))
    assert not torch.allclose(logits(loaded), logits(base_model(trained)))  # the adapter is not a no-op


def test_export_merge_writes_a_plain_model_with_the_trained_logits(run, trained, tmp_path):
    from transformers import AutoModelForCausalLM

    done = cli("export", run, tmp_path / "merged", "--merge")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    merged_by_peft = peft_reference(run, trained).merge_and_unload().eval()  # W + B @ A x scaling
    assert torch.equal(logits(loaded), logits(merged_by_peft))
    # the same function as the unmerged model, to float rounding (x W + x A B against x (W + A B))
    assert torch.allclose(logits(loaded), logits(peft_reference(run, trained)), atol=1e-5)


def test_a_lora_run_without_its_adapter_config_is_refused(run, tmp_path):
    """A LoRA run saved without its adapter_config.json (and adopted so): export asks for it in one line. (Deleting the
    file from an adopted folder is another fault: the manifest lists it, so verify names it missing.)"""
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("adapter_config.json", "zckpt_manifest.json"))
    assert cli("adopt", bare).returncode == 0
    refused(cli("export", bare, tmp_path / "out"), "--adapter_config", "adapter_config.json")
    assert not (tmp_path / "out").exists()
    missing = shutil.copytree(run, tmp_path / "missing", ignore=shutil.ignore_patterns("adapter_config.json"))
    refused(cli("export", missing, tmp_path / "out"), "adapter_config.json")
    assert not (tmp_path / "out").exists()


def test_an_adapter_config_that_does_not_match_the_weights_is_refused(run, tmp_path):
    config = json.loads((run / "adapter_config.json").read_text()) | {"target_modules": ["q_proj", "v_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    for extra in ([], ["--merge"]):  # 2 layers x k, o: lora_A, lora_B and base_layer unknown to this adapter
        line = refused(cli("export", run, tmp_path / "out", "--adapter_config", tmp_path / "adapter_config.json",
                           *extra), "do not match", "12 of the checkpoint's weights are not the model's",
                       "k_proj.lora_A.default.weight", "(--config, --adapter_config)")
        assert ("lacks 4 of its weights" in line) == bool(extra), line  # the merge also needs k_proj.weight ...
        assert not (tmp_path / "out").exists()


def test_plain_weights_under_other_names_are_refused_naming_them():
    """A wrapper's prefix (DDP's `module.`): every name unknown to the config's model, none exported."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(config).state_dict()
    with pytest.raises(UsageError) as e:
        check_shapes(config, {f"module.{k}": v for k, v in names.items()}, build=True)
    line = str(e.value)
    assert "\n" not in line and "21 of the checkpoint's weights are not the model's (module." in line, line
    assert "lacks 21 of its weights (lm_head.weight, model.embed_tokens.weight" in line, line


def test_an_adapter_export_of_a_run_that_also_trained_base_weights_is_refused(tmp_path):
    """The optimizer held lm_head.weight (unfrozen by hand): the adapter would lose it, so only --merge may export."""
    from deepspeed.utils.zero_to_fp32 import GatheredTensor
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from zckpt_nb.convert.peft_export import write_adapter

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):  # as the export builds it: names and shapes, no weights
        model = get_peft_model(AutoModelForCausalLM.from_config(config),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trained = {n for n, p in model.named_parameters() if p.requires_grad} | {f"{PREFIX}lm_head.weight"}

    def lazy(name, shape):  # what DeepSpeed's lazy state dict gives: trained weights in its fp32 groups, one rank
        flat = torch.zeros(shape.numel())
        return GatheredTensor([[flat]], [0, flat.numel()], 0, flat.numel(), shape) if name in trained else \
            torch.zeros(shape)

    with pytest.raises(UsageError) as e:
        write_adapter(model, {n: lazy(n, t.shape) for n, t in model.state_dict().items()}, tmp_path)
    assert str(e.value) == (f"the run also trained {PREFIX}lm_head.weight, which the adapter does not hold: export "
                            "the merged model (--merge)")
    assert not any(tmp_path.iterdir())


def test_zckpt_save_of_a_lora_run_keeps_its_adapter_config_and_exports_without_options(tmp_path):
    """`zckpt_nb.save` of a peft model writes adapter_config.json beside config.json, lists it in the manifest (so
    verify checks it), and export finds it there: no --adapter_config needed."""
    from peft import PeftModel

    out = tmp_path / "run"
    launch_module(LOOP, [str(out), "--steps", "1", "--lora", "--save", "zckpt"], nproc=2, timeout=300,
                  name="own loop --lora --save zckpt", verbose=False, progress=False)
    manifest = json.loads((out / "global_step1" / "zckpt_manifest.json").read_text())
    assert "adapter_config.json" in json.dumps(manifest), manifest
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    done = cli("export", out, tmp_path / "adapter")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert isinstance(PeftModel.from_pretrained(base_model_of(out), str(tmp_path / "adapter")), PeftModel)


def base_model_of(run):
    """A plain model of the run's config (random weights: enough to check the adapter loads onto it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(run)))
