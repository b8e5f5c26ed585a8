"""Model presets (GPT-2 style causal LMs built from a `transformers` config, no download), the ZeRO-3 DeepSpeed
config they train with, and building the model under ZeRO-3."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from zckpt_nb.errors import UsageError

CONFIG_DIR = Path(__file__).with_name("configs")


@dataclass(frozen=True)
class Preset:
    """Shape of one GPT-2 style model and its batch (`global_batch` whatever the world size)."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    micro_batch: int
    seq_len: int
    lr: float
    global_batch: int


PRESETS: dict[str, Preset] = {
    # ~0.4M parameters: trains on 2 CPU ranks in seconds. Width 112 is not a multiple of 3: N = 3 shows ZeRO-3's padding
    "tiny": Preset(1024, 64, 112, 2, 4, micro_batch=8, seq_len=64, lr=3e-3, global_batch=16),
    # ~3.5M parameters: a CPU run of a few minutes.
    "small": Preset(2048, 128, 256, 4, 4, micro_batch=8, seq_len=128, lr=1e-3, global_batch=16),
    # ~56M parameters: the ">= 50M" preset for measuring save costs on CPU; comfortable on a GPU.
    "medium": Preset(8192, 256, 768, 7, 12, micro_batch=4, seq_len=128, lr=3e-4, global_batch=8),
    # ~160M parameters: GPU only in practice.
    "large": Preset(8192, 512, 1024, 12, 16, micro_batch=8, seq_len=256, lr=3e-4, global_batch=16),
    # ~296M parameters, 1.18 GB of fp32 weights: consolidation memory at scale (docs/consolidation_costs.md).
    "xl": Preset(8192, 256, 1536, 10, 16, micro_batch=2, seq_len=128, lr=1e-4, global_batch=4),
}


def get_preset(name: str) -> Preset:
    """Return the preset called `name`, or raise a ValueError that lists the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def gpt2_config(name: str) -> Any:
    """Build the `transformers.GPT2Config` for preset `name`."""
    from transformers import GPT2Config

    p = get_preset(name)
    # No dropout (as nanoGPT pretrains): its masks would depend on which rank holds which sample, so a run resumed
    # on another world size could not continue the same optimisation.
    return GPT2Config(vocab_size=p.vocab_size, n_positions=p.n_positions, n_embd=p.n_embd, n_layer=p.n_layer,
                      n_head=p.n_head, bos_token_id=0, eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0)


def ln_vocab(name: str) -> float:
    """The loss of a uniform guess over the preset's vocabulary: what step 0 should show."""
    return math.log(get_preset(name).vocab_size)


def ds_config(name: str, *, steps: int, world_size: int = 1, global_batch: int | None = None, bf16: bool = False,
              gather_16bit_on_save: bool = False, comms_logger: bool = False, persistence_threshold: int = 0,
              load_universal: bool = False, node_local_storage: bool = False) -> dict[str, Any]:
    """The DeepSpeed ZeRO-3 config for preset `name` (one JSON-able dict, nothing hidden)."""
    p = get_preset(name)
    gas = accumulation_steps(global_batch or p.global_batch, world_size, p.micro_batch)
    return {
        # DeepSpeed's bookkeeping (it checks micro x accumulation x ranks); the worker feeds each rank its share
        # of the global batch (`data.rank_share`), weighted so the gradient is the global batch's mean.
        "train_micro_batch_size_per_gpu": math.ceil(math.ceil((global_batch or p.global_batch) / world_size) / gas),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        # torch_adam: DeepSpeed's FusedAdam needs CUDA; torch's AdamW runs on CPU ranks and GPUs alike
        # and gives bit-identical results on resume.
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": p.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                       "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": p.lr,
                       "warmup_num_steps": max(1, steps // 10), "total_num_steps": max(2, steps)},
        },
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            # Tensors of at most this many elements stay whole on every rank ("persistent"); with 0 each rank holds
            # exactly its P/N share (DeepSpeed's default, 1e5, keeps all of `tiny` but its embedding whole)
            "stage3_param_persistence_threshold": persistence_threshold,
            "stage3_gather_16bit_weights_on_model_save": gather_16bit_on_save,
            "overlap_comm": False,
        },
        "comms_logger": {"enabled": comms_logger, "verbose": False, "prof_all": True, "debug": False},
        # a checkpoint saved by another number of ranks loads from its universal copy (zckpt_nb.convert.reshard);
        # with node-local storage each node's ranks save into that node's own folder (zckpt_nb.saving.nodes)
        "checkpoint": {"load_universal": load_universal, "use_node_local_storage": node_local_storage},
    }


def accumulation_steps(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Micro-steps per optimizer step so that no rank runs more than `micro_batch` sequences at once."""
    return max(1, math.ceil(math.ceil(global_batch / world_size) / micro_batch))


def build_model(name: str, config: dict[str, Any]) -> tuple[Any, Any]:
    """Build preset `name` partitioned across ranks; (model, the HfDeepSpeedConfig to keep alive)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    # Alive before from_config, transformers 5 builds inside deepspeed.zero.Init and initialises each module
    # gathered whole on rank 0 (a bare deepspeed.zero.Init skips that init: notebook 02's mistake 1)
    hf_ds_config = HfDeepSpeedConfig(config)
    model = AutoModelForCausalLM.from_config(gpt2_config(name))
    return model, hf_ds_config


def held_elements(model: Any) -> dict[str, int]:
    """Parameter elements this rank holds: its own slices, and the persistent tensors it keeps whole."""
    params = list(model.parameters())
    persistent = [p for p in params if getattr(p, "ds_persist", False)]
    return {"owned": sum(p.ds_tensor.numel() for p in params), "persistent_tensors": len(persistent),
            "persistent": sum(p.ds_numel for p in persistent)}


def count_params(model: Any) -> int:
    """Number of distinct parameter elements (tied weights once), whether or not ZeRO-3 partitioned them."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def tied_names(model: Any) -> dict[str, str]:
    """Tied parameters as DeepSpeed records them (`shared_params`): each later name of a tensor -> its first name."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            ties[name] = first[id(param)]
    return ties


def param_count(name: str) -> int:
    """P for preset `name`, counted on the meta device: no memory, no DeepSpeed, no training."""
    return count_params(meta_model(name))


def shipped_configs() -> list[str]:
    """Names of the configs shipped in `zckpt_nb/configs/` (usable wherever a config path is)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_file(source: str) -> Path:
    """The config.json `source` names: a file, a folder holding one, or a shipped config's name."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    elif not path.exists() and (CONFIG_DIR / f"{source}.json").is_file():
        path = CONFIG_DIR / f"{source}.json"
    if not path.is_file():
        raise UsageError(f"no config.json at {source}: give a transformers config.json, a folder holding one, "
                         f"or a shipped config ({', '.join(shipped_configs())})")
    return path


@cache
def model_config(name: str) -> Any:
    """The transformers config of a preset, else of a causal-LM `config.json` (a path, a folder or a shipped name),
    refused in one line unless it is a causal LM transformers ships."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if name in PRESETS:
        return gpt2_config(name)
    path = config_file(name)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not JSON ({e}): give a transformers config.json") from None
    kind = data.pop("model_type", None) if isinstance(data, dict) else None
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{path} is not the config of a causal LM transformers ships (model_type {kind!r}): give a "
                         "config.json with model_type gpt2, llama, mistral, qwen2, ...")
    return AutoConfig.for_model(kind, **data)


@cache
def meta_model(name: str) -> Any:
    """Preset or config `name` built on the meta device: shapes only, no memory, no DeepSpeed."""
    return on_meta(model_config(name))


def on_meta(config: Any) -> Any:
    """The causal LM a transformers `config` describes, built on the meta device (shapes only, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
