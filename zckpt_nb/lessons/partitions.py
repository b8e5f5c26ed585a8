"""Notebook 01: each rank's shard against the cost model and the principle's table, in sentences from the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import CheckpointInfo, seed_files_vs_tree
from zckpt_nb.format.sizes import exact_ratio
from zckpt_nb.lessons.together import all_done, together
from zckpt_nb.plan.costs import predict
from zckpt_nb.run.launch import fresh_dir, launch

MIB = 2**20


def shard_rows(infos: list[CheckpointInfo], model: str, threshold: int, dtype: str) -> list[dict[str, Any]]:
    """Per world size and rank: P/N, the slice and padding read from the files, and the shard bytes against the
    cost model's (7 columns)."""
    rows = []
    for info in infos:
        pred = predict(model, info.world_size, dtype=dtype, persistence_threshold=threshold)
        for s in info.ranks:
            expected = pred.partitioned["per_rank_file_bytes"]
            rows.append({"N": info.world_size, "rank": s.rank, "P/N": exact_ratio(info.num_params, info.world_size),
                         "elements in its slice": s.partition_numel,
                         "padding (elements)": info.world_size * s.partition_numel - info.num_params,
                         "shard files (B)": s.bytes, "predicted (B)": expected,
                         "difference (%)": f"{(s.bytes / expected - 1) * 100:+.2f}"})
    return rows


def prediction_sentence(infos: list[CheckpointInfo], model: str, threshold: int, dtype: str) -> str:
    """Whether the cost model predicted every rank's slice exactly, and how far off its file bytes were."""
    misses, worst = [], 0.0
    for info in infos:
        pred = predict(model, info.world_size, dtype=dtype, persistence_threshold=threshold)
        misses += [f"rank {s.rank} at N = {info.world_size}" for s in info.ranks
                   if s.partition_numel != pred.slice_numel]
        worst = max([worst] + [abs(s.bytes / pred.partitioned["per_rank_file_bytes"] - 1) for s in info.ranks])
    slices = ("The cost model predicted every rank's slice, padding included, to the element" if not misses else
              f"The cost model's slice differs from the files for {', '.join(misses)}")
    return f"{slices}; its shard bytes were at most {worst:.2%} off the files."


def principle_rows(infos: list[CheckpointInfo], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The principle's partitioned-save row and its file list, each against what the runs measured (3 columns)."""
    runs = sorted(rows, key=lambda r: (r["threshold"], r["N"]))
    held = "; ".join(f"N = {r['N']}, threshold {r['threshold']:,}: {r['held per rank']:,} held, P/N = "
                     f"{exact_ratio(r['P'], r['N'])}" for r in runs)
    above = [r for r in runs if r["persistent per rank"]]
    comm = "; ".join(f"N = {r['N']}: {r['save collective bytes per rank']:,} B ({r['save collective ops']})"
                     for r in runs)
    logged = sorted(r["save collective bytes per rank"] for r in runs)
    files = {f["the principle lists"]: f for f in seed_files_vs_tree(infos[-1].ckpt_dir)}
    model, optim = files["mp_rank_00_model_states.pt"], files["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    n = infos[-1].world_size
    return [
        {"the principle says": "memory required by a partitioned save: P/N per rank", "measured": held,
         "so": "true up to padding (a few elements per tensor)" if not above else
         f"wrong for {len(above)} run(s): persistent tensors are held whole beyond the slice"},
        {"the principle says": "communication of a partitioned save: none", "measured": comm,
         "so": "true: nothing logged" if not logged[-1] else
         f"imprecise: {logged[0]:,} to {logged[-1]:,} B per rank, at most "
         f"{logged[-1] / (4 * runs[0]['P']):.2%} of the fp32 weights' bytes"},
        {"the principle says": "mp_rank_00_model_states.pt, one per rank",
         "measured": f"{model['in the tree under that name']} under that name, "
                     f"{model['other files ending with that name']} like {model['e.g.']} (N = {n})",
         "so": "imprecise: under ZeRO-3 each rank's file name carries its rank"},
        {"the principle says": "zero_pp_rank_0_mp_rank_00_optim_states.pt (optimizer state, partitioned)",
         "measured": f"{sum('optim' in f for s in infos[-1].ranks for f in s.files)} optimizer-states files for "
                     f"N = {n}, {optim['in the tree under that name'] + optim['other files ending with that name']} "
                     "of them with that name",
         "so": "true for rank 0; every other rank writes its own, with its rank in the name"},
    ]


def padding_answer(infos: list[CheckpointInfo]) -> str:
    """Exercise: each rank's slice and the padding at every measured N, read from the files."""
    return " ".join(f"At N = {i.world_size} each rank's slice holds {i.ranks[0].partition_numel:,} elements, so "
                    f"N x slice - P = {i.world_size * i.ranks[0].partition_numel - i.num_params:,} padding elements "
                    f"(P/N = {exact_ratio(i.num_params, i.world_size)})." for i in infos)


def threshold_answer(rows: list[dict[str, Any]]) -> str:
    """Exercise: elements held per rank against P/N, and shard bytes, for each threshold measured."""
    return " ".join(f"With threshold {r['threshold']:,} at N = {r['N']}, each rank held {r['held per rank']:,} "
                    f"parameter elements ({r['held per rank'] / (r['P'] / r['N']):.2f}x P/N; "
                    f"{r['persistent per rank']:,} of them persistent, kept whole) and wrote "
                    f"{r['shard bytes per rank'] / MIB:.2f} MiB of shard files."
                    for r in sorted(rows, key=lambda r: (r["threshold"], r["N"])))


def dtype_answer(info: CheckpointInfo, dtype: str) -> str:
    """Exercise: what the training dtype changes in the files: their names, and bytes per owned element."""
    s = info.ranks[-1]
    optim = sum(b for name, b in s.files.items() if "optim" in name)
    names = ", ".join(sorted(s.files))
    return (f"In {dtype}, rank {s.rank} of N = {info.world_size} wrote {names}. Its optimizer-states file holds "
            f"{optim / s.partition_numel:.2f} bytes per element of its slice: the fp32 master copy and Adam's two fp32 "
            "moments (12 bytes), whatever the training dtype, plus the file's header.")


def launch_together(jobs: dict[str, tuple[int, int]], root: str | Path, steps: int, **options: Any) -> dict[str, Any]:
    """Notebook 01: one partitioned-save job per entry (folder name -> (ranks, persistence threshold)), all started at
    once in `root`/name (`together`); their `RunResult`s by name, or the first failure raised."""
    def job(name: str, ranks: int, threshold: int) -> Callable[[], Any]:
        return lambda: launch(ranks, steps, fresh_dir(Path(root) / name), save_checkpoint=True, verbose=False,
                              progress=False, persistence_threshold=threshold, **options)

    return all_done(together({name: job(name, *spec) for name, spec in jobs.items()}))
