"""Notebook 01: each rank's shard against the cost model and the principle's table, in sentences from the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from zckpt_nb.convert.inspect import CheckpointInfo, format_inspection, seed_files_vs_tree
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
            expected = pred.rank_file_bytes
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
        worst = max([worst] + [abs(s.bytes / pred.rank_file_bytes - 1) for s in info.ranks])
    slices = ("The cost model predicted every rank's slice, padding included, to the element" if not misses else
              f"The cost model's slice differs from the files for {', '.join(misses)}")
    return f"{slices}; its shard bytes were at most {worst:.2%} off the files."


def count(n: int, noun: str) -> str:
    """`n` things in words: "no file", "1 file", "2 files"."""
    return f"no {noun}" if not n else f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def principle_rows(infos: list[CheckpointInfo], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The principle's partitioned-save row and its file list, each against what the runs measured (3 columns)."""
    runs = sorted(rows, key=lambda r: (r["threshold"], r["N"]))
    held = "; ".join(f"N = {r['N']}, threshold {r['threshold']:,}: {r['held per rank']:,} held, P/N = "
                     f"{exact_ratio(r['P'], r['N'])}" for r in runs)
    above = [r for r in runs if r["persistent per rank"]]
    comm = "; ".join(f"N = {r['N']}: {r['save collective bytes per rank']:,} B ({r['save collective ops']})"
                     for r in runs)
    files = {f["the principle lists"]: f for f in seed_files_vs_tree(infos[-1].ckpt_dir)}
    model, optim = files["mp_rank_00_model_states.pt"], files["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    n = infos[-1].world_size
    return [
        {"the principle says": "memory required by a partitioned save: P/N per rank", "measured": held,
         "so": "true up to padding (a few elements per tensor)" if not above else
         "wrong where tensors persist (" + "; ".join(f"N = {r['N']}, threshold {r['threshold']:,}" for r in above)
         + "): each rank holds them whole beyond its slice"},
        {"the principle says": "communication of a partitioned save: none", "measured": comm,
         "so": comm_verdict(runs)},
        {"the principle says": "mp_rank_00_model_states.pt, one per rank",
         "measured": f"{count(model['in the tree under that name'], 'file')} with that exact name; "
                     f"{count(model['other files ending with that name'], 'file')} with the rank in front of it, "
                     f"e.g. {model['e.g.']} (N = {n})",
         "so": "imprecise: under ZeRO-3 each rank's file name carries its rank"},
        {"the principle says": "zero_pp_rank_0_mp_rank_00_optim_states.pt (optimizer state, partitioned)",
         "measured": f"{sum('optim' in f for s in infos[-1].ranks for f in s.files)} optimizer-states files for "
                     f"N = {n}, {optim['in the tree under that name'] + optim['other files ending with that name']} "
                     "of them with that name",
         "so": "true for rank 0; every other rank writes its own, with its rank in the name"},
    ]


def comm_verdict(rows: list[dict[str, Any]]) -> str:
    """The principle's "no communication" for a partitioned save, made precise by what every run logged.

    DeepSpeed's `save_checkpoint` checks that every rank saves under the same tag (`_checkpoint_tag_validation`: the
    tag's 20-byte SHA-1, all-reduced once by MAX and once by MIN), so even a save with nothing to gather talks.
    """
    if not any(r["save collective bytes per rank"] for r in rows):
        return "true: nothing logged"
    small = min(r["save collective bytes per rank"] for r in rows)
    gathers = [r for r in rows if "all_gather" in r["save collective ops"]]
    more = "" if not gathers else (
        "; with persistent tensors it also all-gathers them again after the save: " + ", ".join(
            f"{r['save collective bytes per rank']:,} B per rank at threshold {r['threshold']:,} "
            f"({r['save collective bytes per rank'] / (4 * r['P']):.1%} of the fp32 weights)" for r in gathers))
    return (f"imprecise: no weight moves when every tensor is partitioned, but the save is not free of "
            f"communication: at least {small:,} B per rank in two all-reduces (`_checkpoint_tag_validation`: every "
            f"rank must save under the same tag) and barriers every rank must reach{more}")


def rank_files(info: CheckpointInfo) -> str:
    """Each rank's files and the slice they hold (`format_inspection`), said of a checkpoint the worker wrote."""
    return format_inspection(replace(info, status="written by the package's worker"))


def padding_answer(infos: list[CheckpointInfo], model: str, default_n: int = 2) -> str:
    """Exercise 1: the slice and padding at the largest N run, against the default's largest N (`default_n`)."""
    info = max(infos, key=lambda i: i.world_size)
    n, s = info.world_size, info.ranks[0].partition_numel
    pad = n * s - info.num_params
    base = predict(model, default_n)
    said = (f"At N = {n} each rank's slice held {s:,} elements (P/N = {exact_ratio(info.num_params, n)}), so "
            f"N x slice - P = {pad:,} padding elements in all, read from the files.")
    if n == default_n:
        three = predict(model, 3)
        return (f"{said} That is the default's largest N. At N = 3 the cost model (exact to the element in section "
                f"5) gives {three.slice_numel:,} elements per slice and {three.padding_numel:,} padding elements in "
                "all: set `WORLD_SIZES = [2, 3]` and run again to measure it.")
    return (f"{said} At the default's N = {default_n} the cost model (exact to the element in section 5) gives "
            f"{base.slice_numel:,} elements and {base.padding_numel:,} padding: N = {n} "
            + (f"added {pad - base.padding_numel:,} padding elements ({pad / info.num_params:.3%} of P), a few per "
               "tensor whose size N does not divide." if pad > base.padding_numel else
               "divides every tensor too, so it added no padding."))


EXERCISE_THRESHOLD = 10_000  # notebook 01's exercise 2


def threshold_answer(rows: list[dict[str, Any]], measured: list[dict[str, Any]], model: str, dtype: str,
                     default: int = 0) -> str:
    """Exercise 2: elements held and shard bytes of the main runs (`rows`), each against the same N at the default
    threshold: measured where a run of `measured` had it, else the cost model's (exact in sections 5 and 6)."""
    if all(r["threshold"] == default for r in rows):
        held = ", ".join(f"{r['held per rank']:,} at N = {r['N']}" for r in rows)
        then = []
        for r in rows:
            pred = predict(model, r["N"], dtype=dtype, persistence_threshold=EXERCISE_THRESHOLD)
            then.append(f"at N = {r['N']} {pred.held_numel:,} elements per rank (this run: {r['held per rank']:,}) "
                        f"and {pred.rank_file_bytes / MIB:.2f} MiB of shard files (this run: "
                        f"{r['shard bytes per rank'] / MIB:.2f} MiB)")
        return (f"These runs used the default threshold {default:,}: each rank held exactly its slice ({held}). With "
                f"`PERSISTENCE_THRESHOLD = {EXERCISE_THRESHOLD:_}` the cost model (section 6 checks it against the "
                f"files) gives {'; '.join(then)}. Set it and run again to measure it.")
    out = []
    for r in sorted(rows, key=lambda r: r["N"]):
        same = [m for m in measured if m["N"] == r["N"] and m["threshold"] == default]
        pred = predict(model, r["N"], dtype=dtype, persistence_threshold=default)
        held, files, how = ((same[0]["held per rank"], same[0]["shard bytes per rank"], "measured") if same else
                            (pred.held_numel, pred.rank_file_bytes, "the cost model"))
        mib = [f"{b / MIB:.2f} MiB" for b in (files, r["shard bytes per rank"])]
        out.append(f"At N = {r['N']} with threshold {r['threshold']:,}, each rank held {r['held per rank']:,} "
                   f"parameter elements ({r['held per rank'] / (r['P'] / r['N']):.2f}x P/N, "
                   f"{r['persistent per rank']:,} of them in persistent tensors) against {held:,} at threshold "
                   f"{default:,} ({how}), and its shard files "
                   + (f"stayed at {mib[0]}." if mib[0] == mib[1] else f"went from {mib[0]} to {mib[1]}."))
    return " ".join(out)


def dtype_answer(info: CheckpointInfo, dtype: str, model: str, threshold: int, device: str = "cpu") -> str:
    """Exercise 3: the files' names and bytes per owned element in this run's dtype on its ranks' `device`, against
    the other dtype (its names from DeepSpeed's rule, its bytes from the cost model, which the files match in
    section 5)."""
    s, other = info.ranks[-1], "fp32" if dtype == "bf16" else "bf16"
    optim = next(name for name in s.files if "optim" in name)
    others = optim[len("bf16_"):] if optim.startswith("bf16_") else f"bf16_{optim}"
    per = s.files[optim] / s.partition_numel
    pred = predict(model, info.world_size, dtype=other, persistence_threshold=threshold)
    model_file = next(b for name, b in s.files.items() if "model_states" in name)
    per_other = (pred.rank_file_bytes - model_file) / pred.slice_numel
    ranks = "CPU" if device == "cpu" else "GPU"
    ran = (f"This run trained in {dtype} on {ranks} ranks (`DTYPE = \"auto\"` gives fp32 on CPU ranks, bf16 on GPU "
           "ranks)")
    return (f"{ran}: rank {s.rank} of N = {info.world_size} wrote {', '.join(sorted(s.files))}; its "
            f"optimizer-states file holds {per:.2f} bytes per element of its slice. In {other} it would write "
            f"`{others}` instead, with about {per_other:.2f} bytes per element (the cost model): the fp32 master "
            "copy and Adam's two fp32 moments, 12 bytes, plus the file's header, whatever the training dtype. "
            + ("Set `DTYPE = \"bf16\"` and run again to see it measured." if dtype != "bf16" else
               "Only the optimizer file's name changed." if f"{per:.2f}" == f"{per_other:.2f}" else
               "Its bytes per element differ from the prediction too."))


def launch_together(jobs: dict[str, tuple[int, int]], root: str | Path, steps: int, **options: Any) -> dict[str, Any]:
    """Notebook 01: one partitioned-save job per entry (folder name -> (ranks, persistence threshold)), all started at
    once in `root`/name (`together`); their `RunResult`s by name, or the first failure raised."""
    def job(name: str, ranks: int, threshold: int) -> Callable[[], Any]:
        return lambda: launch(ranks, steps, fresh_dir(Path(root) / name), save_checkpoint=True, verbose=False,
                              progress=False, persistence_threshold=threshold, **options)

    return all_done(together({name: job(name, *spec) for name, spec in jobs.items()}))
