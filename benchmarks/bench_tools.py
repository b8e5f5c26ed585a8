"""What only the benchmarks (and the tests that check them) use: a fresh output folder, the offline routes measured
in this process, a DCP conversion's memory bound, and each rank's last exception line of a finished job."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.export import export
from zckpt_nb.convert.zero_shards import ShardReader
from zckpt_nb.format.layout import RANK_FILE, latest_name, universal_dir
from zckpt_nb.format.records import Route, SaveCost
from zckpt_nb.measure.meters import files_under, flush_writes, measure
from zckpt_nb.run.logs import EXCEPTION_LINE, rank_lines


def fresh_dir(path: str | Path) -> Path:
    """Empty (or create) `path` so a re-run starts from nothing; returns it resolved."""
    path = Path(path).resolve()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def measure_offline_route(route: str, convert: Callable[[], Any], ckpt_dir: str | Path, tag: str | None,
                          out_dir: str | Path) -> SaveCost:
    """Run a one-process route from checkpoint `tag` into `out_dir` and measure its own work only."""
    import deepspeed.utils.zero_to_fp32  # noqa: F401  (imported and earlier writes flushed first: not timed)
    import transformers

    transformers.GPT2LMHeadModel  # noqa: B018  (transformers imports its models lazily, on first access)
    flush_writes()
    tag_dir = Path(ckpt_dir) / str(tag or latest_name(ckpt_dir))
    return measure(route, convert, written=lambda: files_under(out_dir),
                   read=sorted(p for p in tag_dir.glob("*") if RANK_FILE.search(p.name)))


def measure_offline(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None) -> SaveCost:
    """Run route 3 (DeepSpeed's `zero_to_fp32` in this process, writing `out_dir/pytorch_model.bin`) and measure it."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    return measure_offline_route(Route.OFFLINE, lambda: convert_zero_checkpoint_to_fp32_state_dict(
        str(ckpt_dir), str(out_dir), tag=tag), ckpt_dir, tag, out_dir)


def measure_export(ckpt_dir: str | Path, out_dir: str | Path, *, tag: str | None = None,
                   max_shard_size: str | int = "5GB", overwrite: bool = False) -> SaveCost:
    """Run the Hugging Face `export` and measure it."""
    return measure_offline_route(Route.HF, lambda: export(ckpt_dir, out_dir, tag=tag, max_shard_size=max_shard_size,
                                                           overwrite=overwrite), ckpt_dir, tag, out_dir)


def largest_state_bytes(ckpt_dir: str | Path, tag: str) -> int:
    """The largest parameter's fp32 state in bytes, from the tag's rank files or else its universal copy."""
    folder = Path(ckpt_dir) / tag
    return ShardReader(folder if any(folder.glob("*_model_states.pt")) else universal_dir(ckpt_dir, tag)).unit


def rank_errors(output_dir: str | Path) -> dict[str, str]:
    """The last exception line each rank printed (from DIR/launch.log): what a failed job said, rank by rank."""
    found = {who: [line.strip() for line in lines] for who, lines in rank_lines(output_dir, last=10**6).items()}
    return {who: next((line for line in reversed(lines) if EXCEPTION_LINE.match(line)), "(no exception)")
            for who, lines in found.items()}
