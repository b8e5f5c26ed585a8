"""Look inside a partitioned ZeRO-3 checkpoint: which rank wrote which file, and how much of P it holds.

Everything here is read from the files on disk (memory-mapped, so a large checkpoint costs little RAM).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.verify import RANK_FILE, latest_name


@dataclass
class RankShard:
    """One rank's part of a checkpoint."""

    rank: int
    files: dict[str, int]  # file name -> bytes
    partition_numel: int  # fp32 parameter elements this rank owns, padding included
    optimizer_numel: int  # elements of Adam's moment tensors for that partition
    payload_bytes: int  # bytes of tensor data in the rank's files; the rest of `bytes` is pickle header

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


@dataclass
class CheckpointInfo:
    """A whole partitioned checkpoint: P, N and every rank's shard."""

    ckpt_dir: str
    tag: str
    world_size: int
    num_params: int  # P, without padding
    num_tensors: int
    ranks: list[RankShard]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _load(path: Path) -> dict[str, Any]:
    import torch

    # DeepSpeed pickles non-tensor objects (enums, configs): weights_only=False is required.
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def rank_files(tag_dir: Path) -> dict[int, dict[str, Path]]:
    """Map rank -> {'model': path, 'optim': path} for the files in one tag folder."""
    found: dict[int, dict[str, Path]] = {}
    for path in sorted(tag_dir.iterdir()):
        m = RANK_FILE.search(path.name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = path
    return found


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data anywhere inside a loaded checkpoint object (dicts, lists, tuples)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def read_shard(rank: int, paths: dict[str, Path]) -> RankShard:
    """Sizes and element counts of one rank's files."""
    loaded = {kind: _load(path) for kind, path in paths.items()}
    optim = loaded["optim"]["optimizer_state_dict"]
    moments = optim["optimizer_state_dict"]["state"].values()
    return RankShard(
        rank=rank,
        files={p.name: p.stat().st_size for p in paths.values()},
        partition_numel=sum(t.numel() for t in optim["fp32_flat_groups"]),
        optimizer_numel=sum(v.numel() for s in moments for v in s.values() if getattr(v, "dim", lambda: 0)() > 0),
        payload_bytes=sum(tensor_bytes(obj) for obj in loaded.values()),
    )


def inspect_checkpoint(ckpt_dir: str | Path, tag: str | None = None) -> CheckpointInfo:
    """Read every rank's shard of checkpoint `tag` (default: what `latest` names) in `ckpt_dir`."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag or latest_name(ckpt_dir)
    if tag is None or not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint {tag or '(latest)'} in {ckpt_dir}")
    files = rank_files(ckpt_dir / tag)
    if not files:
        raise FileNotFoundError(f"{ckpt_dir / tag} holds no zero_pp_rank_* files: not a ZeRO-3 checkpoint")
    shapes = _load(files[0]["model"])["param_shapes"]
    numels = [s.numel() for group in shapes for s in group.values()]
    return CheckpointInfo(str(ckpt_dir), tag, len(files), sum(numels), len(numels),
                          [read_shard(r, p) for r, p in sorted(files.items())])


def format_inspection(info: CheckpointInfo) -> str:
    """A human-readable table: per rank, every file with its size and the partition it holds."""
    n = info.world_size
    lines = [f"checkpoint {info.ckpt_dir} tag {info.tag}: P = {info.num_params:,} parameters "
             f"in {info.num_tensors} tensors, N = {n} ranks, P/N = {info.num_params / n:,.1f}"]
    for shard in info.ranks:
        lines.append(f"rank {shard.rank}: {shard.partition_numel:,} parameter elements "
                     f"({shard.partition_numel / info.num_params:.1%} of P, padding included), {shard.bytes:,} bytes")
        lines += [f"    {name:<48} {size:>14,} bytes" for name, size in shard.files.items()]
    return "\n".join(lines)


def inspection_json(info: CheckpointInfo) -> str:
    """The same as JSON, for scripts."""
    return json.dumps(info.to_dict(), indent=1)


def tree(root: str | Path) -> str:
    """Every file under `root` with its size, indented by depth (like `tree -s`)."""
    root = Path(root)
    lines = [f"{root}/"]
    for path in sorted(root.rglob("*")):
        depth = len(path.relative_to(root).parts)
        name = f"{'    ' * depth}{path.name}{'/' if path.is_dir() else ''}"
        lines.append(f"{name:<56} {path.stat().st_size:>12,} B" if path.is_file() else name)
    return "\n".join(lines)
