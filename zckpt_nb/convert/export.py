"""Export a partitioned ZeRO-3 checkpoint as a Hugging Face model folder, and use it without DeepSpeed.

The folder holds `config.json`, `generation_config.json`, the weights as safetensors streamed from the rank files with
a tied weight stored once (`convert.streaming`; a peft run: `convert.peft_export`), the tokenizer and a model card;
`from_pretrained` and `pipeline` load it without DeepSpeed. This module imports neither DeepSpeed nor torch at import
time, so `generate` stays DeepSpeed-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zckpt_nb.convert.model_card import run_facts, write_card
from zckpt_nb.convert.peft_export import is_peft, write_peft
from zckpt_nb.convert.safeload import check_files
from zckpt_nb.convert.streaming import lazy_state_dict, write_weights
from zckpt_nb.convert.verify import check_output, newest_committed
from zckpt_nb.errors import CheckpointError, UsageError, first_line
from zckpt_nb.format.disk import check_writable, read_json, staged, umask
from zckpt_nb.format.layout import ADAPTER_CONFIG, EXPORT_KIND, committed_tags, latest_name, tag_dirs
from zckpt_nb.format.manifest import Manifest, commit, entries_under
from zckpt_nb.model import gpt2_config

PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # a tokenizer_class that transformers 4.x and 5 both load
LOADING_KEYS = ("is_local", "local_files_only")  # how transformers 5 loaded the checkpoint's tokenizer, not settings


def check_checkpoint(ckpt_dir: Path, tag: str | None, config: str | Path | None = None) -> Manifest:
    """The manifest of the committed, intact ZeRO-3 checkpoint `tag`, every file checked; else UsageError."""
    if not ckpt_dir.is_dir():
        raise UsageError(f"checkpoint dir {ckpt_dir} does not exist or is not a folder")
    newest = newest_committed(ckpt_dir, "exporting") if committed_tags(ckpt_dir) else None
    tag = tag or newest or latest_name(ckpt_dir)
    tags = [d.name for d in tag_dirs(ckpt_dir)]
    if tag is None:
        raise UsageError(f"{ckpt_dir} is not a ZeRO checkpoint (no 'latest' file and no --tag); "
                         f"tags found: {', '.join(tags) or 'none'}")
    if not (ckpt_dir / tag).is_dir():
        raise UsageError(f"tag {tag} does not exist in {ckpt_dir}; tags found: {', '.join(tags) or 'none'}")
    try:  # the manifest, every file's size and SHA-256, then every rank file unpickled weights-only
        manifest = check_files(ckpt_dir, tag)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if came_from := manifest.from_dcp:  # world size 0: DeepSpeed's universal copy only, which export does not read
        raise UsageError(f"{ckpt_dir / tag} was converted back from the DCP checkpoint {came_from} (from-dcp) and "
                         "holds no rank files, only a universal copy: resume it (train --resume, or zckpt_nb.resume "
                         "with DeepSpeed's load_universal), save, and export that save")
    model_config(ckpt_dir, config)  # raises UsageError when there is nothing to rebuild the model from
    return manifest


def model_config(ckpt_dir: Path, config: str | Path | None = None) -> Any:
    """The model's config: `config`, else `config.json` beside the checkpoint, else `run.json`'s preset."""
    from transformers import AutoConfig

    source = Path(config) if config else ckpt_dir
    if (source / "config.json").is_file() or source.is_file():
        try:
            return AutoConfig.from_pretrained(str(source))
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the model's config from {source}: {first_line(e)}") from None
    if config is None and (ckpt_dir / "run.json").is_file():
        run = read_json(ckpt_dir / "run.json")
        try:
            return gpt2_config(run.get("model") if isinstance(run, dict) else None)
        except ValueError as e:
            raise UsageError(f"{ckpt_dir / 'run.json'} names no preset to rebuild the model from ({e}); pass "
                             "--config PATH") from None
    raise UsageError(f"{source} has no config.json to rebuild the model from; pass --config PATH (the model's "
                     "config.json, or its folder) or put the model's config.json beside 'latest'")


def write_export(ckpt_dir: Path, manifest: Manifest, dest: Path, max_shard_size: int, name: str,
                 config_source: str | Path | None = None, adapter_source: str | Path | None = None,
                 merge: bool = False) -> None:
    """Write the weights (or a peft run's adapter), the tokenizer if there is one, and the model card."""
    tag, config = manifest.tag, model_config(ckpt_dir, config_source)
    lazy = lazy_state_dict(ckpt_dir, tag)
    peft = bool(adapter_source) or merge or is_peft(lazy)
    # this package's worker built the model from the preset the manifest names: its names are that model's
    built_here = config_source is None and bool((manifest.identity or {}).get("model"))
    tensors = write_peft(ckpt_dir, lazy, config, dest, max_shard_size, adapter_source, merge) if peft else \
        write_weights(ckpt_dir, tag, lazy, config, dest, max_shard_size, check=not built_here)
    tokenizer = None
    if (ckpt_dir / "tokenizer.json").is_file():  # saved so that transformers 4 and 5 both load it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(ckpt_dir))
        tokenizer.model_max_length = config.max_position_embeddings  # trained with no limit; the model has one
        tokenizer.save_pretrained(str(dest))
        # transformers 5 writes its class name, TokenizersBackend, which 4.x does not know; both versions load
        # PreTrainedTokenizerFast from tokenizer.json alone (5 maps that name to TokenizersBackend)
        path = dest / "tokenizer_config.json"
        saved = {k: v for k, v in json.loads(path.read_text()).items() if k not in LOADING_KEYS}
        saved["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    facts = run_facts(ckpt_dir, manifest, config, tensors, tokenizer) | {"adapter": peft and not merge}
    write_card(dest, facts, name)
    # the modes of any save under this umask (0755/0644 under 022): safetensors creates its files 0600, private
    mask = umask()
    for path in [dest, *dest.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    commit(dest, Manifest(tag, facts["steps"], entries_under(dest), kind=EXPORT_KIND))  # what --overwrite replaces


def export(ckpt_dir: str | Path, out_dir: str | Path, *, tag: str | None = None, max_shard_size: str | int = "5GB",
           overwrite: bool = False, config: str | Path | None = None, adapter_config: str | Path | None = None,
           merge: bool = False) -> Path:
    """Export checkpoint `tag` of `ckpt_dir` as a Hugging Face folder `out_dir` (a peft run: adapter or merged)."""
    from transformers.utils.hub import convert_file_size_to_int

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir).absolute()
    manifest = check_checkpoint(ckpt_dir, tag, config)
    # out_dir: new, empty, or (--overwrite) an earlier export, outside the checkpoint
    if ckpt_dir.resolve() == out_dir.resolve() or out_dir.resolve() in ckpt_dir.resolve().parents:
        raise UsageError(f"output folder {out_dir} contains the checkpoint {ckpt_dir}; choose another folder")
    if out_dir.is_dir() and not out_dir.is_symlink() and any(out_dir.iterdir()) and not overwrite:
        raise UsageError(f"output folder {out_dir} is not empty; pass --overwrite to replace an earlier export")
    check_output(out_dir, EXPORT_KIND)
    check_writable(out_dir)
    try:  # "5GB", "200KB", "1MiB" or an int
        shard_bytes = convert_file_size_to_int(int(max_shard_size) if str(max_shard_size).isdigit() else max_shard_size)
    except ValueError:
        shard_bytes = 0
    if shard_bytes <= 0:
        raise UsageError(f"--max_shard_size {max_shard_size!r} is not a size; use e.g. 5GB, 200MB or 500KB")
    with staged(out_dir) as tmp:
        write_export(ckpt_dir, manifest, tmp, shard_bytes, out_dir.name, config, adapter_config, merge)
    return out_dir


def generate(model_dir: str | Path, prompt: str | None = None, max_new_tokens: int = 40,
             token_ids: list[int] | None = None) -> str:
    """Greedy continuation of `prompt` (or of `token_ids`, as ids) by the exported model, no trigram repeated."""
    from transformers import AutoConfig, AutoTokenizer, pipeline

    model_dir = Path(model_dir)
    if (model_dir / ADAPTER_CONFIG).is_file() and not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is a peft adapter, not a whole model: load it onto its base model with "
                         "PeftModel.from_pretrained(base, dir), or export the checkpoint again with --merge")
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a Hugging Face model folder (no config.json); "
                         "create one with: python -m zckpt_nb export CKPT_DIR OUT_DIR")
    if max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be at least 1 (got {max_new_tokens})")
    context = AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings  # GPT-2's n_positions
    if token_ids is not None:  # greedy continuation as token ids: no tokenizer needed
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        check_fits(len(token_ids), max_new_tokens, context)
        hf_logging.disable_progress_bar()  # one line of ids is the whole output
        model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()  # transformers alone; no dropout
        vocab = model.config.vocab_size
        if not token_ids or min(token_ids) < 0 or max(token_ids) >= vocab:
            raise UsageError(f"--token_ids must be ids from 0 to {vocab - 1} (the model's vocabulary), at least one")
        with torch.no_grad():
            out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 no_repeat_ngram_size=3, pad_token_id=model.config.eos_token_id or 0)
        return " ".join(map(str, out[0].tolist()))
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise UsageError(f"{model_dir} has no tokenizer, so a text prompt cannot be encoded; pass --token_ids "
                         "(the prompt as token ids), or add the tokenizer the model was trained with")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))  # checked before any weight is loaded
    check_fits(len(tokenizer(prompt, verbose=False)["input_ids"]), max_new_tokens, context)
    pipe = pipeline("text-generation", model=str(model_dir), tokenizer=tokenizer)
    return pipe(prompt, max_new_tokens=max_new_tokens, do_sample=False, no_repeat_ngram_size=3)[0]["generated_text"]


def check_fits(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Raise UsageError unless prompt and continuation fit the model's context (past it GPT-2 has no position)."""
    room = context - max_new_tokens
    if max_new_tokens >= context:
        raise UsageError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                         f"{context} tokens; ask for fewer than {context}")
    if prompt_tokens > room:
        raise UsageError(f"the prompt is {prompt_tokens} tokens; with --max_new_tokens {max_new_tokens} it may be at "
                         f"most {room} (the model's context is {context} tokens): shorten it or lower --max_new_tokens")
