"""The checkpoint folder's layout: tag names, rank files, `latest`, the files beside the tags, the universal copy.

A checkpoint folder is a plain DeepSpeed one (`DIR/latest`,
`DIR/global_step{N}/zero_pp_rank_{r}_mp_rank_00_{model,optim}_states.pt`, DeepSpeed's `zero_to_fp32.py`), plus what
this package adds: `zckpt_manifest.json` in each committed tag folder, the tokenizer and `config.json` beside the
tags, and `DIR/universal/<tag>/` for a copy that loads on any number of ranks. Every other module names these files
through this one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "zckpt_manifest.json"
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(model|optim)_states\.pt$")
_STEP = re.compile(r"(\d+)$")

# Beside the tags, written once (atomically) by the first save; resume and export read them. DeepSpeed's
# zero_to_fp32.py and zero_to_torch.py are not listed: DeepSpeed rewrites them in place on every save, so a later
# save failing mid-copy would make every older checkpoint fail its check (run_zero_to_fp32 compares the copy
# with DeepSpeed's own file instead).
ADAPTER_CONFIG = "adapter_config.json"  # peft's config of a LoRA run (`LoraConfig.save_pretrained` writes it)
SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", ADAPTER_CONFIG)
ARCHITECTURE = ("model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head")  # config.json's shape
UNIVERSAL = "universal"  # DIR/universal/<tag>: never a tag folder of DIR itself, so rotation and resume skip it
WEIGHTS = "pytorch_model.bin"  # the file name routes 1-3 write, as DeepSpeed and transformers name it
DCP_KIND = "dcp"  # the manifest kind of a PyTorch DCP checkpoint converted from ZeRO-3 (convert.dcp)
EXPORT_KIND = "export"  # the manifest kind of a Hugging Face folder written by `export`


def tag_step(tag: str) -> int:
    """The step a tag like `global_step40` stands for (-1 when it ends in no number)."""
    m = _STEP.search(tag)
    return int(m.group(1)) if m else -1


def tag_for(step: int) -> str:
    """The tag of the checkpoint saved at `step`, as DeepSpeed names it by default."""
    return f"global_step{step}"


def tag_dirs(ckpt_dir: str | Path) -> list[Path]:
    """Folders of `ckpt_dir` that hold (or held) a checkpoint: a manifest or any rank file."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and (
        (d / MANIFEST).exists() or any(RANK_FILE.search(p.name) for p in d.iterdir()))),
        key=lambda d: (tag_step(d.name), d.name))


def committed_tags(ckpt_dir: str | Path) -> list[str]:
    """Tags with a manifest, oldest first (files not yet hashed: `verify` does that)."""
    return [d.name for d in tag_dirs(ckpt_dir) if (d / MANIFEST).is_file()]


def incomplete_tags(ckpt_dir: str | Path) -> list[str]:
    """Tags whose save never committed (a crash or a failure mid-save), oldest first."""
    return [d.name for d in tag_dirs(ckpt_dir) if not (d / MANIFEST).is_file()]


def is_plain_name(name: Any) -> bool:
    """A file or folder name alone: no folder part, not absolute, not '.' or '..', no NUL, at most 255 bytes."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and len(name.encode()) <= 255
            and Path(name).name == name)


def latest_name(ckpt_dir: str | Path) -> str | None:
    """What `latest` names (None without one), read up to 256 bytes."""
    path = Path(ckpt_dir) / "latest"
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return f.read(256).decode(errors="replace").strip()


def universal_dir(ckpt_dir: str | Path, tag: str) -> Path:
    """Where the universal copy of `tag` lives."""
    return Path(ckpt_dir) / UNIVERSAL / tag


def node_rank() -> int:
    """This rank's node (torchrun's GROUP_RANK)."""
    return int(os.environ.get("GROUP_RANK", 0))


def writes_folder(node_local: bool) -> bool:
    """Does this rank write the folder's shared files, manifest and `latest` (DeepSpeed's rule)?"""
    return int(os.environ.get("LOCAL_RANK" if node_local else "RANK", 0)) == 0


def sizes_of(paths: Iterable[str | Path]) -> dict[Path, int]:
    """Each file's size in bytes, leaving out any removed since it was listed (a failed save's files)."""
    found = {}
    for path in paths:
        try:
            found[Path(path)] = os.stat(path).st_size
        except FileNotFoundError:
            continue
    return found


def rank_files(output_dir: str | Path, tag: str, rank: int, committed: bool = False) -> list[dict[str, Any]]:
    """The files rank `rank` wrote for `tag` with their sizes; `committed` adds the manifest."""
    root = Path(output_dir)
    try:
        paths = sorted((root / tag).glob(f"*zero_pp_rank_{rank}_*"))
    except FileNotFoundError:  # a failed save's folder, removed by another rank while this one looked
        paths = []
    if rank == 0:
        shared = ("latest", "zero_to_fp32.py", "zero_to_torch.py", *SHARED_FILES)
        paths += [root / name for name in shared if (root / name).is_file()]
        paths += [root / tag / MANIFEST] if committed and (root / tag / MANIFEST).is_file() else []
    return [{"path": str(p.relative_to(root)), "bytes": size} for p, size in sizes_of(paths).items()]
