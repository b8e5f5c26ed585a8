"""Notebook 07: one checkpoint resumed on several world sizes.
"""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.convert.collect import copy_checkpoint
from zckpt_nb.convert.reshard import bytes_by_kind
from zckpt_nb.format.layout import RANK_FILE, universal_dir
from zckpt_nb.format.units import counted
from zckpt_nb.lessons import claims
from zckpt_nb.lessons.together import all_done, together
from zckpt_nb.model import accumulation_steps
from zckpt_nb.run.launch import launch

EXERCISE_BATCH = 7  # exercise 1's global batch, which 2 and 3 ranks cannot split evenly
EXERCISE_NODES = 3  # exercise 2's node count


def resume_on(source: str | Path, tag: str, worlds: list[int], steps: int, out_root: str | Path,
              **launch_kw: Any) -> dict[int, Any]:
    """Notebook 07: resume a copy of checkpoint `tag` on each world size in `worlds`, all started at once
    (`together`: their figures are losses, not seconds); their `RunResult`s, or the first failure raised.

    The source's universal copy, when it has one, is copied too: each job then loads it instead of converting again."""
    folders = {world: copy_checkpoint(source, Path(out_root) / f"resumed_on_{world}", tag) for world in worlds}
    if universal_dir(source, tag).is_dir():
        for folder in folders.values():
            shutil.copytree(universal_dir(source, tag), universal_dir(folder, tag))
    return all_done(together({world: partial(launch, world, steps, folders[world], resume=True, **launch_kw)
                              for world in worlds}))


def sequences_per_rank(batch: int, n: int) -> str:
    """How many of `batch` sequences each of `n` ranks holds: one number when `n` divides it, else 'a to b'."""
    return f"{batch // n}" + (f" to {-(-batch // n)}" if batch % n else "")


def batch_answer(rows: list[dict[str, Any]], global_batch: int, default_batch: int, micro_batch: int,
                 dtype: str, source_n: int | None = None) -> str:
    """Exercise 1 for the global batch this run used: each world size's split (the saving run's `source_n` first)
    against the preset's default batch's, and the largest loss difference against the tolerance of the run's `dtype`
    (`claims.RESUME_TOLERANCE`)."""
    def split(batch: int, n: int) -> str:
        return (f"{sequences_per_rank(batch, n)} sequences per rank in "
                f"{counted(accumulation_steps(batch, n, micro_batch), 'micro-step')}")

    other = EXERCISE_BATCH if global_batch == default_batch else default_batch
    sizes = dict.fromkeys([*([source_n] if source_n else []), *(r["resumed on N"] for r in rows)])
    each = "; ".join(f"on {counted(n, 'rank')}{' (the saving run)' if n == source_n else ''}: "
                     f"{split(global_batch, n)}"
                     + ("" if other == global_batch else f" (with {other}: {split(other, n)})") for n in sizes)
    ran = (f"This run used the preset's global batch of {default_batch} (set `GLOBAL_BATCH = {EXERCISE_BATCH}` for "
           "a batch that 2 and 3 ranks cannot split evenly; its split is in brackets)"
           if global_batch == default_batch else
           f"This run used a global batch of {global_batch} (the preset's is {default_batch})")
    worst, tolerance = max(rows, key=lambda r: r["max |loss difference|"]), claims.RESUME_TOLERANCE[dtype]
    held = worst["max |loss difference|"] <= tolerance
    return (f"{ran}. A micro-step holds at most {micro_batch} sequences: {each}. The resumed runs' largest loss "
            f"difference is {worst['max |loss difference|']:.1e}, {'within' if held else 'above'} {dtype}'s "
            f"{tolerance:.0e}: " + ("splitting the batch another way changed nothing but the order of additions."
                                    if held else "the split changed the optimisation."))


def nodes_answer(rows: list[dict[str, Any]], default_nodes: int) -> str:
    """Exercise 2 for the nodes this run simulated: what each node's own folder held (`nodes.folder_rows`), and,
    for another count than the notebook's `default_nodes`, what the default's folders hold (one rank per node)."""
    other = EXERCISE_NODES if len(rows) == default_nodes else default_nodes
    ran = (f"the default; set `NODES = {EXERCISE_NODES}` to add one" if len(rows) == default_nodes else
           f"the default is {default_nodes}")
    per_rank = rows[0]["files its manifest lists"] // len(rows)  # one rank per simulated node
    versus = ("" if other == len(rows) else
              f" With {'the default ' if other == default_nodes else ''}{other} nodes: {other} folders, each "
              f"manifest listing {per_rank * other} files, {per_rank * (other - 1)} of them on other nodes: each "
              f"node adds its rank's {per_rank} files to every manifest.")
    return (f"This run simulated {len(rows)} nodes ({ran}), so {len(rows)} folders, one per node: " + "; ".join(
        f"{r['folder']} holds the files of rank{'s' if ',' in r['ranks whose files it holds'] else ''} "
        f"{r['ranks whose files it holds']}, and its manifest lists "
        f"{r['files its manifest lists']} files, {r['of them on other nodes']} of them on other nodes" for r in rows)
        + ": every manifest lists the whole checkpoint, and each node's own files are the ones not elsewhere."
        + versus)


def resumption_sentence(manifest: Any, trap_world: int, refused: bool) -> str:
    """What sections 3 and 4 measured against the principle's 'a partitioned checkpoint is optimal for training
    resumption': so on the world size that saved it only; on any other, after a conversion (its figures are printed
    beside the sentence by `describe_conversion`, so they are not repeated). `refused`: whether DeepSpeed's
    loader stopped on `trap_world` ranks."""
    n = manifest.source_world_size
    ranks = counted(trap_world, "rank")
    return (f"The principle calls a partitioned checkpoint optimal for training resumption. That holds on the {n} "
            f"ranks that saved it only: there each rank loads its own files as they are. "
            + (f"DeepSpeed's loader refused it on {ranks} (section 3). " if refused else "")
            + "On any other number of ranks it must first be converted into the universal copy, whose seconds and "
            "bytes the line above gives (what those bytes are: below the figure).")


def universal_sentence(copy: Any, source: Any, elements: int, folders: int,
                       num_params: int) -> str:
    """What the universal copy holds, from its manifest and the source's: elements against P, and its bytes by kind
    against the source's (`convert.reshard.bytes_by_kind`)."""
    kinds, total = bytes_by_kind(copy), copy.conversion["bytes"]
    rank0_optim = next(e.bytes for e in source.files if (m := RANK_FILE.search(Path(e.path).name))
                       and m.groups() == ("0", "optim"))  # bf16_zero_pp_rank_0_... in bf16
    per_param = sum(kinds.get(k, 0) for k in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"))
    states = sum(v for k, v in kinds.items() if k.startswith("model states"))
    count = ("exactly P, with no padding (each rank cuts its own on loading)" if elements == num_params else
             f"not P = {num_params:,}: the copy is incomplete")
    return (f"The {folders} parameter folders hold {elements:,} elements: {count}. The copy's {total:,} bytes are "
            f"{total / copy.conversion['source_bytes']:.2f}x the source's: {per_param:,} in the per-parameter "
            f"files (fp32 weights and Adam's two moments of all P, each file with its own pickle header); "
            f"{kinds.get('optimizer_state.pt', 0):,} in `zero/optimizer_state.pt`, "
            f"{kinds.get('optimizer_state.pt', 0) / rank0_optim:.2f}x rank 0's optimizer file, which DeepSpeed's "
            f"converter copies whole for the optimizer's step and parameter groups; and {states:,} in the source's "
            "model-states files, from which DeepSpeed reads rank 0's client state.")


def resume_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`claims.reshard_rows` to display: the conversion's columns only where a job converted by itself (a copy it was
    given was converted, and its cost shown, once), the loss difference in one format."""
    made = any(r["loaded from"] == "a universal copy it made" for r in rows)
    drop = () if made else ("conversion (s)", "conversion peak RSS (MiB)")
    return [{("max |loss difference| (nats per token)" if k == "max |loss difference|" else k):
             f"{v:.1e}" if k == "max |loss difference|" else v for k, v in r.items() if k not in drop} for r in rows]


def loss_differences(base: Any, runs: dict[int, Any], floor: float = 1e-9) -> dict[str, tuple[list[int], list[float]]]:
    """Per resumed run, |its loss - the uninterrupted run's| at each step both logged, raised to `floor` so that an
    exact match still shows on a log scale."""
    by_step = dict(zip(base.steps, base.losses))
    return {f"resumed on {counted(n, 'rank')}": ([s for s in run.steps if s in by_step],
                                        [max(abs(loss - by_step[s]), floor) for s, loss in zip(run.steps, run.losses)
                                         if s in by_step])
            for n, run in runs.items()}
