"""Adopt a DeepSpeed ZeRO-3 checkpoint this package did not write: check that it is whole, then commit it.

A checkpoint DeepSpeed wrote alone (a raw engine, Hugging Face `Trainer`, accelerate) has no manifest. `adopt` checks
the files themselves (every rank's two files, each unpickled weights-only, one world size, ZeRO stage 3), then hashes,
fsyncs and commits them, recording under `adopted` what they say of themselves; accelerate's files beside the tag are
listed under `shared`, hashed and never unpickled. An incomplete checkpoint is refused and nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import excludes_frozen, frozen_numel, shard_paths
from zckpt_nb.convert.safeload import load
from zckpt_nb.convert.verify import unlisted, verify_tag
from zckpt_nb.convert.zero_shards import ZERO_3
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.disk import read_json
from zckpt_nb.format.layout import MANIFEST, RANK_FILE, is_plain_name, latest_name, tag_dirs
from zckpt_nb.format.manifest import FileEntry, Manifest, commit, file_entry, shared_entries
from zckpt_nb.format.units import counted

# What accelerate's save_state writes beside DeepSpeed's tag folder (names from accelerate.utils.constants)
ACCELERATE_FILE = re.compile(r"random_states_(\d+)\.pkl|(?:scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin|scaler\.pt"
                             r"|custom_checkpoint_\d+\.pkl")


def locate(path: str | Path, tag: str | None) -> tuple[Path, str]:
    """(checkpoint folder, tag) from a folder holding `latest` and tags, or from a tag folder itself."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    if tag is None and any(RANK_FILE.search(p.name) for p in path.iterdir()):
        return path.parent, path.name  # e.g. Trainer's checkpoint-N/global_stepN
    tag = tag or latest_name(path)
    if tag is None:
        tags = [d.name for d in tag_dirs(path)]
        if len(tags) != 1:
            raise CheckpointError(f"{path} has no 'latest' file; pass --tag (tag folders here: "
                                  f"{', '.join(tags) or 'none'})")
        tag = tags[0]
    if not is_plain_name(tag) or (path / tag).is_symlink() or not (path / tag).is_dir():
        raise CheckpointError(f"{tag!r} is not a tag folder inside {path} (a name, not a path or a symbolic link); "
                              "pass --tag with a folder of it")
    return path, tag


def read_facts(tag_dir: Path, files: dict[int, dict[str, Path]]) -> dict[str, Any]:
    """What rank 0's files record: world size, step, DeepSpeed's version, dtype, ZeRO stage, parameter count."""
    if "model" not in files.get(0, {}):
        raise CheckpointError(f"{tag_dir} is incomplete: rank 0's model states "
                              "(zero_pp_rank_0_mp_rank_00_model_states.pt) are missing")
    states = load(files[0]["model"], mmap=True)
    config = states.get("ds_config") or {}
    optim = files[0].get("optim")
    dtype = "bf16" if (optim and optim.name.startswith("bf16_")) or config.get("bf16", {}).get("enabled") else \
        "fp16" if config.get("fp16", {}).get("enabled") else "fp32"
    trained = sum(s.numel() for group in states.get("param_shapes", []) for s in group.values())
    frozen = frozen_numel(states)
    return {"deepspeed_version": states.get("ds_version"), "world_size": int(states["dp_world_size"]),
            "step": int(states.get("global_steps", 0)), "dtype": dtype, "num_params": trained + frozen,
            "frozen_params": frozen, "frozen_excluded": excludes_frozen(states)}


def accelerate_entries(ckpt_dir: Path, world: int) -> list[FileEntry]:
    """An entry (hashed, never unpickled) for each of accelerate's files beside the tag, RNG states by rank."""
    found = {}
    for path in sorted(ckpt_dir.iterdir()):
        match = ACCELERATE_FILE.fullmatch(path.name)
        if match and (path.is_symlink() or not path.is_file()):
            raise CheckpointError(f"{path} is not a plain file (a link or a folder): adopt records only accelerate's "
                                  "files themselves; replace it by the file, then adopt")
        if match:
            found[path] = int(match[1]) if match[1] else 0
    ranks = sorted(rank for path, rank in found.items() if path.name.startswith("random_states_"))
    if ranks and ranks != list(range(world)):
        raise CheckpointError(f"{ckpt_dir} is incomplete, so it was not adopted: accelerate's RNG states "
                              f"(random_states_R.pkl) are there for rank {', '.join(map(str, ranks))}, while the "
                              f"checkpoint's {world} ranks are 0 to {world - 1} (a save that did not finish on "
                              "every rank, or processes that disagreed on their rank)")
    return [file_entry(path, ckpt_dir, rank=rank) for path, rank in found.items()]


def check_rank_files(tag_dir: Path, files: dict[int, dict[str, Path]], world: int) -> None:
    """Both files of every rank of `world` and no more, each unpickled weights-only, each optimizer file ZeRO-3."""
    gaps = [f"rank {r}'s {kind} states" for r in range(world) for kind in ("model", "optim")
            if kind not in files.get(r, {})]
    gaps += [f"a file of rank {r}, beyond its {world} ranks" for r in sorted(files) if r >= world]
    if gaps:
        raise CheckpointError(f"{tag_dir} is incomplete, so it was not adopted: {', '.join(gaps)} missing "
                              f"(rank 0's model states record {world} ranks)")
    for _rank, kinds in sorted(files.items()):
        for kind, path in sorted(kinds.items()):
            state = load(path, mmap=True)  # CheckpointError naming the file: truncated, corrupt, outside the allowlist
            recorded = state.get("dp_world_size") if kind == "model" else \
                state.get("optimizer_state_dict", {}).get("partition_count")
            if kind == "optim" and state.get("optimizer_state_dict", {}).get("zero_stage") != ZERO_3:
                stage = int(state.get("optimizer_state_dict", {}).get("zero_stage", -1))
                raise CheckpointError(f"{path} is a ZeRO stage {stage} file; this package reads ZeRO-3 checkpoints")
            if recorded is not None and int(recorded) != world:
                raise CheckpointError(f"{path} records {recorded} ranks, rank 0's model states {world}: the files "
                                      "come from different saves")


def adopt(path: str | Path, tag: str | None = None) -> Manifest:
    """Check a ZeRO-3 checkpoint this package did not write and commit it (a committed tag is only verified)."""
    ckpt_dir, tag = locate(path, tag)
    tag_dir = ckpt_dir / tag
    if (tag_dir / MANIFEST).is_file():
        return verify_tag(ckpt_dir, tag)
    files = shard_paths(tag_dir)
    if not files:
        raise CheckpointError(f"{tag_dir} holds no ZeRO rank file (zero_pp_rank_R_mp_rank_00_*_states.pt): it is "
                              "not a DeepSpeed ZeRO checkpoint")
    extra = unlisted(tag_dir, [p.name for kinds in files.values() for p in kinds.values()])
    if extra:  # DeepSpeed's readers would load them with the rank files
        raise CheckpointError(f"{tag_dir / extra[0]} is not a rank file, and DeepSpeed's readers would load it with "
                              f"them: move it out of {tag_dir}, then adopt")
    facts = read_facts(tag_dir, files)
    check_rank_files(tag_dir, files, facts["world_size"])
    extras = accelerate_entries(ckpt_dir, facts["world_size"])
    entries = [file_entry(path, tag_dir, rank=rank) for rank, kinds in sorted(files.items())
               for path in sorted(kinds.values())]
    config = read_json(ckpt_dir / "config.json") if (ckpt_dir / "config.json").is_file() else None
    kind = config.get("model_type") if isinstance(config, dict) else None
    identity = {"num_params": facts["num_params"], **({"model_type": kind} if isinstance(kind, str) else {})}
    commit(tag_dir, Manifest(tag, facts["step"], entries, world_size=facts["world_size"], identity=identity,
                             shared=shared_entries(ckpt_dir) + extras, adopted=facts))  # hashed, fsynced, manifest last
    return verify_tag(ckpt_dir, tag)


def describe_adoption(manifest: Manifest) -> str:
    """One line on what the adopted checkpoint's files recorded."""
    facts = manifest.adopted
    if not facts:
        return f"{manifest.tag} was already committed by zckpt_nb; nothing to adopt"
    kind = (manifest.identity or {}).get("model_type", "a model")
    frozen = facts.get("frozen_params", 0)
    held = " (frozen weights not saved: exclude_frozen_parameters=True)" if facts.get("frozen_excluded") else \
        f" ({frozen:,} of them frozen)" if frozen else ""
    extras = [e.path for e in manifest.shared if ACCELERATE_FILE.fullmatch(e.path)]
    beside = f", with {counted(len(extras), 'file')} of accelerate's beside it ({', '.join(extras)})" if extras else ""
    return (f"adopted {manifest.tag}: {kind}, {facts['num_params']:,} parameters{held}, {facts['dtype']}, step "
            f"{facts['step']}, saved by {counted(facts['world_size'], 'rank')} with DeepSpeed "
            f"{facts['deepspeed_version']}{beside}; verify, inspect, export and reshard now read it")
