"""Export a peft run (LoRA, or any adapter peft can merge): its adapter folder, or merged, a plain model folder.

The peft model is rebuilt on the meta device from `config.json` and the run's adapter config, its names and shapes
checked against the checkpoint's (peft's `base_model.model.` names), and peft writes the files: the adapter alone
(only its weights read from the rank files), or every weight read whole, merged (`merge_and_unload`) and saved.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.streaming import check_names, stored_names
from zckpt_nb.errors import CheckpointError, UsageError, first_line
from zckpt_nb.format.disk import read_json
from zckpt_nb.format.layout import ADAPTER_CONFIG
from zckpt_nb.format.units import listed

PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's names


def is_peft(names: Iterable[str]) -> bool:
    """Are these a PeftModel's parameter names?"""
    return any(name.startswith(PEFT_PREFIX) for name in names)


def adapter_config(ckpt_dir: Path, source: str | Path | None) -> Any:
    """The run's peft config: `source` (an adapter_config.json or its folder), else the one beside the checkpoint."""
    path = Path(source) if source else ckpt_dir / ADAPTER_CONFIG
    path = path / ADAPTER_CONFIG if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"the checkpoint's weights are a peft model's ({PEFT_PREFIX}...) and {path} does not exist: "
                         "pass --adapter_config FILE (the run's adapter_config.json, as LoraConfig.save_pretrained "
                         "writes it) or put it beside 'latest'")
    from peft import PeftConfig

    try:
        return PeftConfig.from_peft_type(**read_json(path))
    except (CheckpointError, TypeError, ValueError, KeyError) as e:
        raise UsageError(f"cannot read the adapter config {path}: {first_line(e)}") from None


def materialize(model: Any, lazy: dict[str, Any], names: set[str]) -> None:
    """Read the tensors `names` whole from DeepSpeed's lazy state dict into `model` in place of its meta tensors."""
    kept = stored_names(lazy)  # a tied weight once
    model.load_state_dict({n: kept[n].contiguous() for n in names if n in kept}, strict=False, assign=True)


def write_adapter(model: Any, lazy: dict[str, Any], dest: Path) -> dict[str, Any]:
    """Write the adapter as `PeftModel.save_pretrained` does (refused where the run trained more); its tensors."""
    from deepspeed.utils.zero_to_fp32 import GatheredTensor

    adapter = {name for name, p in model.named_parameters() if p.requires_grad}
    trained = {name for name, t in lazy.items() if isinstance(t, GatheredTensor)}  # what the optimizer held
    check_names(model, lazy, adapter, "pass the configs the run used (--config, --adapter_config)")
    if outside := sorted(trained - adapter):
        raise UsageError(f"the run also trained {listed(outside, 1)}, which the adapter does not hold: export the "
                         "merged model (--merge)")
    materialize(model, lazy, adapter)
    model.save_pretrained(str(dest), save_embedding_layers=False)  # the base's embeddings are not the adapter's
    return {name: p for name, p in model.named_parameters() if name in adapter}


def write_merged(model: Any, lazy: dict[str, Any], dest: Path, max_shard_size: int) -> dict[str, Any]:
    """Write the model with the adapter merged (`merge_and_unload`, `save_pretrained`); its tensors."""
    from transformers.utils import logging as hf_logging

    needed = {name for name, _ in model.named_parameters()}
    check_names(model, lazy, needed, "export the adapter alone (without --merge) if the run saved no base weights "
                "(exclude_frozen_parameters=True); otherwise pass the configs the run used (--config, "
                "--adapter_config)")
    materialize(model, lazy, needed)
    model.get_base_model().tie_weights()  # a tied head was read once, under the embedding's name
    merged = model.merge_and_unload()
    hf_logging.disable_progress_bar()  # the export reports in one line of its own
    merged.save_pretrained(str(dest), max_shard_size=max_shard_size)
    return dict(merged.named_parameters())


def write_peft(ckpt_dir: Path, lazy: dict[str, Any], config: Any, dest: Path, max_shard_size: int,
               adapter_source: str | Path | None, merge: bool) -> dict[str, Any]:
    """Write the peft checkpoint's adapter, or with `merge` its merged model, into `dest`; its tensors."""
    if not is_peft(lazy):
        raise UsageError(f"{ckpt_dir}'s weights are a plain model's, not a peft model's ({PEFT_PREFIX}...): export it "
                         "without --adapter_config and --merge")
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = adapter_config(ckpt_dir, adapter_source)
    try:  # the peft model the adapter makes of the config's causal LM, on the meta device
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's and transformers' deprecation notes: nothing the user can act on
            model = get_peft_model(AutoModelForCausalLM.from_config(config), adapter)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"cannot apply the adapter config to the config's model: {first_line(e)}; pass the configs "
                         "the run used (--config, --adapter_config)") from None
    return write_merged(model, lazy, dest, max_shard_size) if merge else write_adapter(model, lazy, dest)
