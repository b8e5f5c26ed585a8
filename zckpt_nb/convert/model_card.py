"""The model card (`README.md`) of an export: Hub front matter, then the run's facts, each looked up in the
checkpoint, its manifest (whose SHA-256 pins every file) and the training log, and how to load the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.format.disk import read_json
from zckpt_nb.format.layout import MANIFEST
from zckpt_nb.format.manifest import Manifest, sha256_file

CARD = "README.md"


def read_log(path: Path) -> dict[str, Any]:
    """A training log beside the checkpoint (bounded, as any file read here), or nothing."""
    found = read_json(path) if path.is_file() else {}
    return found if isinstance(found, dict) else {}


def run_facts(ckpt_dir: Path, manifest: Manifest, config: Any, tensors: dict[str, Any],
              tokenizer: Any) -> dict[str, Any]:
    """What the card states, each looked up in the checkpoint, manifest, training log or exported objects."""
    import transformers

    run, trainer = read_log(ckpt_dir / "run.json"), read_log(ckpt_dir / "trainer_state.json")
    step, adopted = manifest.step, manifest.adopted
    loss, loss_source = None, "no training log beside the checkpoint"  # the loss of the step that ended at `step`
    if run:
        losses = dict(zip(run.get("steps", []), run.get("losses", [])))
        loss, loss_source = losses.get(step - 1), "run.json"  # run.json counts steps from 0, the tag the steps done
    elif trainer:  # Trainer's log
        logged = [e for e in trainer.get("log_history", []) if isinstance(e, dict) and "loss" in e]
        at = [e["loss"] for e in logged if e.get("step") == step]
        loss, loss_source = (at[-1] if at else None), "trainer_state.json"
    entries = None if tokenizer is None else len(tokenizer)
    return {
        "preset": None if adopted else (manifest.identity or {}).get("model", run.get("model")),
        "model_type": config.model_type,
        # the output head is the embedding (written once), as the config says and the weights written show
        "tied": bool(getattr(config, "tie_word_embeddings", False)) and not any(
            name.endswith("lm_head.weight") for name in tensors),
        "parameters": sum(t.shape.numel() for t in tensors.values()),  # as written: a tied head once
        "steps": step, "loss": loss, "loss_source": loss_source, "world_size": manifest.world_size, "tag": manifest.tag,
        "manifest_sha256": sha256_file(ckpt_dir / manifest.tag / MANIFEST),
        "vocab_size": config.vocab_size, "tokenizer_entries": entries,
        "unused_ids_decode_to": entries and tokenizer.decode(list(range(entries, config.vocab_size))),
        "context": config.max_position_embeddings, "seed": None if adopted else run.get("seed"),
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "transformers": transformers.__version__,
    }


def vocabulary(facts: dict[str, Any]) -> str:
    """The card's paragraph on the model's vocabulary against the tokenizer's entries."""
    vocab, entries, decoded = facts["vocab_size"], facts["tokenizer_entries"], facts["unused_ids_decode_to"]
    if entries is None:
        return (f"No tokenizer was saved with the checkpoint, so this folder has none: the model reads token ids 0 to "
                f"{vocab - 1}. Add the tokenizer it was trained with to use it on text.")
    if entries == vocab:
        return f"The tokenizer has {entries} entries, one per row of the model's vocabulary."
    return (f"The tokenizer has {entries} entries; the model's vocabulary has {vocab} rows. No token maps to ids "
            f"{entries} to {vocab - 1}: they were never a training target, and decoding them gives "
            f"{'no text' if decoded == '' else repr(decoded)}.")


def usage(facts: dict[str, Any], model_dir_name: str) -> str:
    """How to load it: with its tokenizer, or with token ids when it has none; a peft adapter onto its base model."""
    if facts["adapter"]:
        return f"""A peft adapter: load it onto the base model it was trained on.

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("BASE_MODEL")  # the weights the adapter was trained on
model = PeftModel.from_pretrained(base, "{model_dir_name}")
```

`python -m zckpt_nb export CKPT OUT --merge` writes the model with the adapter merged instead."""
    if facts["tokenizer_entries"] is None:
        return f"""```python
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{model_dir_name}")
print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=10, do_sample=False))
```

From a shell: `python -m zckpt_nb generate {model_dir_name} --token_ids 1 2 3`."""
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

model = AutoModelForCausalLM.from_pretrained("{model_dir_name}")
tokenizer = AutoTokenizer.from_pretrained("{model_dir_name}")
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generator("The keeper", max_new_tokens=30, do_sample=False, no_repeat_ngram_size=3))
```

The tokenizer is named `PreTrainedTokenizerFast`, which transformers 4 loads too.
From a shell: `python -m zckpt_nb generate {model_dir_name} --prompt "The keeper"`."""


def fact_rows(facts: dict[str, Any]) -> str:
    """The card's table: one row per fact the checkpoint records."""
    unknown = "not recorded"
    loss = f"{facts['loss']:.4f} ({facts['loss_source']})" if facts["loss"] is not None else \
        f"{unknown} ({facts['loss_source']})"
    sha = f"`{facts['manifest_sha256']}`"
    head = "the head is tied to the embedding" if facts["tied"] else "the output head has weights of its own"
    head = "the adapter's; the base model's are not in this folder" if facts["adapter"] else head
    rows = [("architecture", f"`{facts['model_type']}`"), ("preset", facts["preset"]),
            ("parameters", f"{facts['parameters']:,} ({head})"), ("training steps", facts["steps"]),
            ("loss at the last step", loss), ("world size (ranks that trained and saved it)", facts["world_size"]),
            ("source checkpoint tag", facts["tag"]), ("SHA-256 of the tag's `zckpt_manifest.json`", sha),
            ("weights", f"{facts['dtype']}, safetensors{', peft adapter' if facts['adapter'] else ''}"),
            ("context", f"{facts['context']} tokens"),
            ("seed", facts["seed"])]
    return "\n".join(f"| {name} | {value} |" for name, value in rows if value is not None)


def write_card(dest: Path, facts: dict[str, Any], model_dir_name: str) -> None:
    """Write the card into the export folder `dest`: Hub front matter, the checkpoint's facts, how to load it."""
    from importlib.metadata import metadata

    license_id = str(metadata("zckpt_nb").get("License-Expression") or "other").lower()  # as the Hub spells it
    (dest / CARD).write_text(f"""---
library_name: {'peft' if facts['adapter'] else 'transformers'}
pipeline_tag: text-generation
license: {license_id}
tags:
- {facts['model_type']}
- deepspeed-zero3
---

# {model_dir_name}

| fact | value |
|---|---|
{fact_rows(facts)}

{vocabulary(facts)}

## Use

{usage(facts, model_dir_name)}

Prompt plus new tokens must fit in {facts['context']} tokens. Written by transformers {facts['transformers']}. No
DeepSpeed is needed.
""", encoding="utf-8")
