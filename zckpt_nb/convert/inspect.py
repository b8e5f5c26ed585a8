"""Look inside a partitioned ZeRO-3 checkpoint (memory-mapped): which rank wrote which file, how much of P it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.verify import verify_tag
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.layout import MANIFEST, RANK_FILE, is_plain_name, latest_name
from zckpt_nb.format.records import Record
from zckpt_nb.format.sizes import exact_ratio, tensors_in


@dataclass
class RankShard:
    """One rank's part of a checkpoint."""

    rank: int
    files: dict[str, int]  # file name -> bytes
    partition_numel: int  # fp32 parameter elements this rank owns, padding included
    payload_bytes: int  # bytes of tensor data in the rank's files; the rest of `bytes` is pickle header

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


@dataclass
class CheckpointInfo(Record):
    """A whole partitioned checkpoint: P, N and every rank's shard."""

    ckpt_dir: str
    tag: str
    world_size: int
    num_params: int  # P of the trained parameters (what the partitions hold), without padding
    num_tensors: int
    ranks: list[RankShard]
    status: str = "committed by zckpt_nb"  # or adopted, or not committed (no manifest: its files unverified)
    frozen_params: int = 0  # elements of frozen parameters, whole in each rank's model states
    frozen_excluded: bool = False  # saved with exclude_frozen_parameters=True: the frozen weights are not in it


def excludes_frozen(states: dict[str, Any]) -> bool:
    """Saved with `exclude_frozen_parameters=True` (its `frozen_param_shapes` is None)."""
    return "frozen_param_shapes" in states and states["frozen_param_shapes"] is None


def frozen_numel(states: dict[str, Any]) -> int:
    """Elements of the frozen parameters a ZeRO-3 model-states file records (none when it excluded them)."""
    return sum(s.numel() for s in (states.get("frozen_param_shapes") or {}).values())


def shard_paths(tag_dir: Path, names: list[str] | None = None) -> dict[int, dict[str, Path]]:
    """Rank -> {'model': path, 'optim': path} for the rank files `names` (default: the folder's)."""
    found: dict[int, dict[str, Path]] = {}
    for name in sorted(p.name for p in tag_dir.iterdir()) if names is None else names:
        m = RANK_FILE.search(name)
        if m and m.group(2) in found.setdefault(int(m.group(1)), {}):
            raise CheckpointError(f"{tag_dir} holds two {m.group(2)} files of rank {m.group(1)} "
                                  f"({found[int(m.group(1))][m.group(2)].name}, {name}); remove the one that does not "
                                  "belong to this checkpoint")
        if m:
            found[int(m.group(1))][m.group(2)] = tag_dir / name
    return {rank: kinds for rank, kinds in found.items() if kinds}


def read_shard(rank: int, paths: dict[str, Path]) -> RankShard:
    """Sizes and element counts of one rank's files."""
    loaded = {kind: load(path, mmap=True) for kind, path in paths.items()}
    optim = loaded["optim"]["optimizer_state_dict"] if "optim" in loaded else {"fp32_flat_groups": []}
    return RankShard(
        rank=rank,
        files={p.name: p.stat().st_size for p in paths.values()},
        partition_numel=sum(t.numel() for t in optim["fp32_flat_groups"]),
        payload_bytes=sum(t.numel() * t.element_size() for t in tensors_in(loaded)),
    )


def inspect_checkpoint(ckpt_dir: str | Path, tag: str | None = None) -> CheckpointInfo:
    """Every rank's shard of checkpoint `tag`, verified first where it has a manifest, read weights-only."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag or latest_name(ckpt_dir)
    if tag is not None and not is_plain_name(tag):
        raise CheckpointError(f"checkpoint tag {tag[:60]!r} is not a folder name inside {ckpt_dir}; pass --tag")
    if tag is None or not (ckpt_dir / tag).is_dir():
        raise FileNotFoundError(f"no checkpoint {tag or '(latest)'} in {ckpt_dir}")
    status, names = "not committed: it has no manifest, so its files are unverified; `python -m zckpt_nb adopt` " \
        "commits it", None
    if (ckpt_dir / tag / MANIFEST).is_file():
        manifest = verify_tag(ckpt_dir, tag)
        adopted, names = manifest.adopted, [e.path for e in manifest.files]
        status = f"adopted (written by DeepSpeed {adopted['deepspeed_version']})" if adopted else \
            "committed by zckpt_nb"
    files = shard_paths(ckpt_dir / tag, names)
    if 0 not in files or "model" not in files[0]:
        raise FileNotFoundError(f"{ckpt_dir / tag} holds no model states of rank 0: not a ZeRO checkpoint")
    states = load(files[0]["model"], mmap=True)
    numels = [s.numel() for group in states["param_shapes"] for s in group.values()]
    frozen = frozen_numel(states)
    return CheckpointInfo(str(ckpt_dir), tag, len(files), sum(numels), len(numels),
                          [read_shard(r, p) for r, p in sorted(files.items())], status, frozen, excludes_frozen(states))


def format_inspection(info: CheckpointInfo) -> str:
    """A human-readable table: per rank, every file with its size and the partition it holds."""
    n = info.world_size
    lines = [f"checkpoint {info.ckpt_dir} tag {info.tag} ({info.status}): P = {info.num_params:,} parameters "
             f"in {info.num_tensors} tensors, N = {n} ranks, P/N = {exact_ratio(info.num_params, n)}"]
    if info.frozen_params or info.frozen_excluded:
        lines[0] += "; frozen weights not saved (exclude_frozen_parameters=True)" if info.frozen_excluded else \
            f"; plus {info.frozen_params:,} frozen parameters, whole in every rank's model states"
    for shard in info.ranks:
        lines.append(f"rank {shard.rank}: {shard.partition_numel:,} parameter elements "
                     f"({shard.partition_numel / info.num_params:.1%} of P, padding included), {shard.bytes:,} bytes")
        lines += [f"    {name:<48} {size:>14,} bytes" for name, size in shard.files.items()]
    return "\n".join(lines)
