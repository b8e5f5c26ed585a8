"""Test helpers: the weights a route wrote, read back, and compared with a reference joined by plain torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.format.layout import WEIGHTS


def reference_state_dict(output_dir: str | Path) -> dict[str, Any]:
    """Join the fp32 partitions of the newest checkpoint's rank files into full tensors, with plain torch.

    ZeRO-3 splits each flattened parameter into N equal slices (the last padded), slice r on rank r, one after another
    in each rank's flat fp32 groups in `param_shapes` order; written by hand on purpose: using DeepSpeed's own
    consolidation here would make the check circular.
    """
    import torch

    tag_dir = Path(output_dir) / (Path(output_dir) / "latest").read_text().strip()
    paths = sorted(tag_dir.glob("*_optim_states.pt"), key=lambda p: int(p.name.split("_")[3]))
    flats = [torch.cat([t.reshape(-1) for t in torch.load(p, map_location="cpu", weights_only=False)
                        ["optimizer_state_dict"]["fp32_flat_groups"]]) for p in paths]
    states = torch.load(next(tag_dir.glob("*rank_0_*_model_states.pt")), map_location="cpu", weights_only=False)
    state, offset = {}, 0
    for name, shape in ((n, s) for group in states["param_shapes"] for n, s in group.items()):
        per_rank = -(-shape.numel() // len(flats))
        whole = torch.cat([flat[offset:offset + per_rank] for flat in flats])
        state[name], offset = whole[:shape.numel()].view(shape).clone(), offset + per_rank
    return state


def load_weights(path: str | Path) -> dict[str, Any]:
    """A state dict from any route's output: a `.bin`/`.safetensors` file, or a folder (sharded or not)."""
    import json

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index_name).is_file():
            shards = sorted(set(json.loads((path / index_name).read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in load_weights(path / shard).items()}
    for name in ("model.safetensors", WEIGHTS):
        if (path / name).is_file():
            return load_weights(path / name)
    raise FileNotFoundError(f"no model weights (model.safetensors, {WEIGHTS} or an index) in {path}")


def compare_weights(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """How `candidate` differs from `reference`: missing names, extra names, and the largest abs difference.

    `exact` is True only when every reference tensor is present with the same shape, dtype-cast and bit-equal.
    """
    import torch

    candidate = {n: t.detach() for n, t in candidate.items()}
    reference = {n: t.detach() for n, t in reference.items()}  # either side may come from a live model
    missing = sorted(set(reference) - set(candidate))
    shared = [n for n in reference if n in candidate]
    bad_shape = sorted(n for n in shared if tuple(candidate[n].shape) != tuple(reference[n].shape))
    diffs = {n: float((candidate[n].float() - reference[n].float()).abs().max()) for n in shared if n not in bad_shape}
    exact = not missing and not bad_shape and all(torch.equal(candidate[n].float(), reference[n].float())
                                                  for n in diffs)
    return {"tensors": len(diffs), "missing": missing, "extra": sorted(set(candidate) - set(reference)),
            "bad_shape": bad_shape, "max_abs_diff": max(diffs.values(), default=0.0),
            "dtypes": sorted({str(candidate[n].dtype) for n in shared}), "exact": exact}
