"""Load checkpoint files without letting them run code: hashes first, then `torch.load(weights_only=True)`.

DeepSpeed loads its files with `weights_only=False`; here every file is first checked against the manifest, then
unpickled by torch's restricted unpickler, allowing only the non-tensor types DeepSpeed and our client state write
(`allowed_globals`), so DeepSpeed's own load of the same bytes builds nothing else (docs/security.md).
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

from zckpt_nb.convert.verify import verify_tag
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.manifest import Manifest

_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")  # torch's words for a type outside the allowlist
_REASON = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")  # its words for any other refusal
TRUST = "ZCKPT_TRUST"  # classes you trust a checkpoint to hold beyond the allowlist: module.Class, comma-separated


def allowed_globals() -> list[Any]:
    """The non-tensor types in DeepSpeed 0.19.8's ZeRO-3 files, and the classes $ZCKPT_TRUST names."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    # optimizer states: the ZeRO stage and the loss scaler (fp16's dynamic one too); model states: numpy's RNG state
    # in our client state (an array of uint32, rebuilt by numpy's _reconstruct)
    found = [ZeroStageEnum, LossScaler, DynamicLossScaler, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
             np._core.multiarray._reconstruct]
    for name in filter(None, (part.strip() for part in os.environ.get(TRUST, "").split(","))):
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{TRUST} names {name!r}, which cannot be imported ({type(e).__name__}); name each "
                                  "class as module.Class, for example argparse.Namespace") from None
    return found


def load(path: Any, map_location: Any = "cpu", mmap: bool = False, name: str | None = None) -> Any:
    """`torch.load(path, weights_only=True)` under `allowed_globals`; CheckpointError naming the file otherwise."""
    import torch

    name = name or str(path)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e)) or _REASON.search(str(e))
        what = found.group(1)[:160] if found else type(e).__name__
        module, _, attr = what.rpartition(".")
        trustable = isinstance(getattr(sys.modules.get(module), attr, None), type)  # an imported class, no function
        fix = f"if you trust where it came from, allow the class: {TRUST}={what}" if trustable else \
            "restore the file from a trusted copy"
        raise CheckpointError(f"{name} holds a type outside the allowlist of what DeepSpeed writes ({what}); "
                              f"refusing to unpickle it (it could run code): {fix}") from None
    except (OSError, RuntimeError, EOFError) as e:  # truncated, not a zip, not a torch file
        raise CheckpointError(f"cannot read {name}: {type(e).__name__}: {str(e).strip()[:200]}") from None


def check_files(ckpt_dir: str | Path, tag: str) -> Manifest:
    """Verify `tag`, then unpickle each of its files weights-only (DeepSpeed's own load comes after); the manifest."""
    manifest = verify_tag(ckpt_dir, tag)
    for entry in manifest.files:  # exactly the files just verified (verify_tag refuses any unlisted file)
        load(Path(ckpt_dir) / tag / entry.path, mmap=True)
    return manifest
