"""The model card (`README.md`) of an export: the run's facts, read from the checkpoint, `run.json` and the manifest.

The YAML front matter is what the Hugging Face Hub reads (library, pipeline, license); the body says where the
weights came from (tag, the SHA-256 of its `zckpt_manifest.json`, which pins every shard's SHA-256 in turn) and how
to load them. Nothing in it is fixed text about the outcome: every figure is looked up when the card is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import MANIFEST, tag_step
from zckpt_nb.format.manifest import sha256_file

CARD = "README.md"


def license_id() -> str:
    """The package's license as the Hub spells it (`mit`), from the installed metadata."""
    from importlib.metadata import metadata

    return str(metadata("zckpt_nb").get("License-Expression") or "other").lower()


def loss_at(run: dict[str, Any], step: int) -> float | None:
    """The training loss of the step that ended at `step` (the one saved as its tag), if `run.json` recorded it."""
    losses = dict(zip(run.get("steps", []), run.get("losses", [])))
    return losses.get(step - 1)  # run.json counts steps from 0; the tag counts the steps done


def run_facts(ckpt_dir: Path, tag: str, config: Any, tensors: dict[str, Any], tokenizer: Any,
              world_size: int) -> dict[str, Any]:
    """What the card states, each looked up in the checkpoint, its manifest, `run.json` or the exported objects."""
    import transformers

    manifest_path = ckpt_dir / tag / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    run = json.loads((ckpt_dir / "run.json").read_text()) if (ckpt_dir / "run.json").is_file() else {}
    step = manifest.get("step", tag_step(tag))
    return {
        "preset": manifest.get("identity", {}).get("model", run.get("model")),
        "parameters": sum(t.shape.numel() for t in tensors.values()),  # as written: the tied head once
        "steps": step, "loss": loss_at(run, step), "world_size": world_size, "tag": tag,
        "manifest_sha256": sha256_file(manifest_path) if manifest else None,
        "vocab_size": config.vocab_size, "tokenizer_entries": len(tokenizer),
        "unused_ids_decode_to": tokenizer.decode(list(range(len(tokenizer), config.vocab_size))),
        "context": config.max_position_embeddings, "seed": run.get("seed"),
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "transformers": transformers.__version__,
    }


def vocabulary_note(facts: dict[str, Any]) -> str:
    """One sentence on the model's vocabulary against the tokenizer's entries."""
    vocab, entries, decoded = facts["vocab_size"], facts["tokenizer_entries"], facts["unused_ids_decode_to"]
    if entries == vocab:
        return f"The tokenizer has {entries} entries, one per row of the model's vocabulary."
    return (f"The tokenizer has {entries} entries; the model's vocabulary has {vocab} rows (the preset's size, "
            f"fixed before the tokenizer is trained on the corpus). No token maps to ids {entries} to {vocab - 1}: "
            f"they were never a training target, and decoding them gives "
            f"{'no text' if decoded == '' else repr(decoded)}.")


def card_text(facts: dict[str, Any], model_dir_name: str) -> str:
    """The card: Hub front matter, the run's facts, how to load it."""
    unknown = "not recorded"
    loss = f"{facts['loss']:.4f}" if facts["loss"] is not None else f"{unknown} in run.json"
    sha = f"`{facts['manifest_sha256']}`" if facts["manifest_sha256"] else "none (saved without the commit protocol)"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
license: {license_id()}
tags:
- gpt2
- deepspeed-zero3
---

# {model_dir_name}

A GPT-2-style model trained with DeepSpeed ZeRO-3 by `zckpt_nb` and exported from its partitioned checkpoint
with `python -m zckpt_nb export`. It learnt one small English corpus (`zckpt_nb/data/corpus.txt`) and writes text
in its style only: a teaching model, not a general one.

| fact | value |
|---|---|
| preset | {facts['preset'] or unknown} |
| parameters | {facts['parameters']:,} (the head is tied to the embedding) |
| training steps | {facts['steps']} |
| loss at the last step | {loss} |
| world size (ranks that trained and saved it) | {facts['world_size']} |
| source checkpoint tag | {facts['tag']} |
| SHA-256 of the tag's `zckpt_manifest.json` | {sha} |
| weights | {facts['dtype']}, safetensors |
| context | {facts['context']} tokens |
| seed | {facts['seed'] if facts['seed'] is not None else unknown} |

{vocabulary_note(facts)}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

model = AutoModelForCausalLM.from_pretrained("{model_dir_name}")
tokenizer = AutoTokenizer.from_pretrained("{model_dir_name}")
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
print(generator("The keeper", max_new_tokens=30, do_sample=False, no_repeat_ngram_size=3))
```

Prompt plus new tokens must fit in {facts['context']} tokens. Written by transformers {facts['transformers']}; the
tokenizer is named `PreTrainedTokenizerFast`, which transformers 4 loads too. No DeepSpeed is needed.
From a shell: `python -m zckpt_nb generate {model_dir_name} --prompt "The keeper"`.
"""


def write_card(dest: Path, facts: dict[str, Any], model_dir_name: str) -> Path:
    """Write the card into the export folder `dest`."""
    path = dest / CARD
    path.write_text(card_text(facts, model_dir_name), encoding="utf-8")
    return path
