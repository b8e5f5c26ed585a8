"""How long a save stops training, per save mode: the stall against the time until the checkpoint is durable.

Each save mode gets one training launch with the same model, world size, steps and save schedule. Its run.json
holds, per save and rank, `stall_seconds` (the save call to the start of the next step) and `durable_seconds` (the
save call to the moment every rank knows the commit is on disk; None for DeepSpeed's plain save, which never
fsyncs). The asynchronous mode also records the snapshot it holds in memory until its files are written.
"""

from __future__ import annotations

import re
from pathlib import Path
from statistics import mean, median, stdev
from typing import Any

from zckpt_nb.errors import LaunchError, UsageError
from zckpt_nb.format.records import SaveMode
from zckpt_nb.plan.interval import Loss, loss_curve, lost_fraction, optimal_interval
from zckpt_nb.run.launch import RunResult, fresh_dir, launch

NEEDS_ACCELERATOR = ("ds_fast",)  # FastPersist's writer: pinned buffers and async I/O, refused on CPU ranks


NEVER = "never (no fsync)"  # the time to durable of a mode that does not fsync


NONE = "-"  # no step of that kind


def save_record(mode: str, rank: int, save: dict[str, Any]) -> dict[str, Any]:
    """One save of one rank, from run.json, with the mode that made it."""
    return {"mode": mode, "rank": rank, "tag": save["tag"], "committed": save["committed"],
            "stall_seconds": save["stall_seconds"] + save.get("commit_wait_seconds", 0.0),
            "later_wait_seconds": save.get("commit_wait_seconds", 0.0), "durable_seconds": save["durable_seconds"],
            "snapshot_bytes": save.get("snapshot_bytes", 0)}


def run_records(run_dir: str | Path, mode: str) -> list[dict[str, Any]]:
    """Every save of every rank of the run in `run_dir` (read from its run.json)."""
    run = RunResult.from_dir(Path(run_dir), [], 0.0)
    return [save_record(mode, r["rank"], s) for r in run.ranks for s in r["saves"]]


def measure_modes(model: str, nproc: int, modes: list[str], out_dir: str | Path, *, steps: int = 8,
                  save_every: int = 4, progress: bool = False, dtype: str = "auto") -> list[dict[str, Any]]:
    """One launch per save mode into OUT_DIR/stall_<mode>; one record per (mode, rank, save)."""
    unknown = [m for m in modes if m not in list(SaveMode)]
    if unknown or not modes:
        raise UsageError(f"unknown or no save modes {unknown}; choose from {', '.join(SaveMode)}")
    return [r for mode in modes for r in run_records(launch_mode(model, nproc, mode, out_dir, steps=steps,
                                                                 save_every=save_every, progress=progress,
                                                                 dtype=dtype), mode)]


def launch_mode(model: str, nproc: int, mode: str, out_dir: str | Path, *, steps: int, save_every: int,
                progress: bool = False, timeout: float | None = None, dtype: str = "auto") -> Path:
    """One training launch with `--save_mode mode` into a fresh OUT_DIR/stall_<mode>; that folder."""
    return launch(nproc, steps, fresh_dir(Path(out_dir) / f"stall_{mode}"), save_every=save_every, model=model,
                  save_mode=mode, verbose=False, progress=progress, timeout=timeout, dtype=dtype).output_dir


def measure_all(model: str, nproc: int, modes: list[str], tries: list[str], out_dir: str | Path, *, steps: int = 8,
                save_every: int = 4, dtype: str = "auto") -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    """`measure_modes` for `modes`; then each of `tries` once, bounded: it joins the records if it ran, else its
    error line is kept. Returns (records, {tried mode: None or why it could not run})."""
    records = measure_modes(model, nproc, modes, out_dir, steps=steps, save_every=save_every, dtype=dtype)
    tried = {m: attempt(model, nproc, m, out_dir, steps=steps, save_every=save_every, dtype=dtype) for m in tries}
    records += [r for m, why in tried.items() if why is None for r in run_records(Path(out_dir) / f"stall_{m}", m)]
    return records, tried


def attempt(model: str, nproc: int, mode: str, out_dir: str | Path, *, steps: int = 4, save_every: int = 2,
            timeout: float = 300.0, dtype: str = "auto") -> str | None:
    """Run one save mode's launch (bounded by `timeout`); None if it ran, else the line that says why it failed."""
    try:
        launch_mode(model, nproc, mode, out_dir, steps=steps, save_every=save_every, timeout=timeout, dtype=dtype)
    except LaunchError as e:
        return failure_line(str(e))
    return None


def failure_line(message: str) -> str:
    """The last exception line the ranks printed (`SomeError: ...`), else the launcher's first line."""
    found = [line.split("] ", 1)[-1].strip() for line in message.splitlines()
             if re.search(r"\b\w*(Error|Exception)\b: ", line)]
    return found[-1] if found else message.splitlines()[0]


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of `values` (0 for a single value): how far their mean may drift by chance."""
    return stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def per_rank_totals(group: list[dict[str, Any]]) -> list[float]:
    """Each rank's seconds of training stopped by all its saves (later waits, and the wait at the run's end, too)."""
    return [sum(r["stall_seconds"] for r in group if r["rank"] == rank) for rank in sorted({r["rank"] for r in group})]


def per_save_means(group: list[dict[str, Any]]) -> list[float]:
    """Each save's stall averaged over its ranks: the ranks of one save wait for one another, so their stalls are one
    sample of the mode's stall, not one per rank."""
    tags = dict.fromkeys(r["tag"] for r in group)
    return [mean(r["stall_seconds"] for r in group if r["tag"] == tag) for tag in tags]


def summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the mean stall per save (every wait it caused counted) and its standard error over the saves (each
    save's mean over its ranks, `per_save_means`), the slowest rank's total stall, the median time to durable and
    the largest snapshot."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        group = [r for r in records if r["mode"] == mode]
        durable = [r["durable_seconds"] for r in group if r["durable_seconds"] is not None]
        saves = per_save_means(group)
        rows.append({"mode": mode, "saves": len(saves), "mean stall s": round(mean(saves), 4),
                     "standard error s": round(standard_error(saves), 4),
                     "of which later steps waited s": round(mean(r["later_wait_seconds"] for r in group), 4),
                     "total stall, slowest rank s": round(max(per_rank_totals(group)), 4),
                     "median durable s": round(median(durable), 4) if durable else NEVER,
                     "largest snapshot MiB": round(max(r["snapshot_bytes"] for r in group) / 2**20, 2)})
    return rows


def ties_with(best: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether two modes' mean stalls differ by less than twice the standard error of their difference (chance)."""
    bound = 2 * (best["standard error s"] ** 2 + row["standard error s"] ** 2) ** 0.5
    return abs(row["mean stall s"] - best["mean stall s"]) <= bound


def stall_sentence(rows: list[dict[str, Any]]) -> str:
    """What the means say: which modes stop training least (differences within chance named ties), and when each
    mode's checkpoint is durable."""
    least = min(rows, key=lambda r: r["mean stall s"])
    tied = [r["mode"] for r in rows if r is not least and ties_with(least, r)]
    parts = [f"{r['mode']} stops training {r['mean stall s']:.3f} s per save (± {r['standard error s']:.3f} s) "
             "and " + ("never makes it durable (no fsync)" if r["median durable s"] == NEVER
                       else f"is durable after {r['median durable s']:.3f} s") for r in rows]
    verdict = (f"Least stall: {least['mode']}, beyond chance." if not tied else
               f"Least stall: a tie between {least['mode']} and {', '.join(tied)}: their means differ by less than "
               "twice the standard error of the difference, which is noise on this machine, not a difference "
               "between the modes.")
    # the snapshot: `memory_sentence`
    return (f"Means over every save and rank, each standard error over the saves (a save's ranks wait for one "
            f"another, so each save counts once, at its ranks' mean): {'; '.join(parts)}. {verdict}"
            + async_note(rows))


def async_note(rows: list[dict[str, Any]]) -> str:
    """Why the asynchronous save stops training longer than plain, where this run measured it so (else '')."""
    by = {r["mode"]: r for r in rows}
    if "async" not in by or "plain" not in by or by["async"]["mean stall s"] <= by["plain"]["mean stall s"] \
            or ties_with(by["plain"], by["async"]):
        return ""
    ratio = by["async"]["mean stall s"] / by["plain"]["mean stall s"]
    return (f" Here async stopped training {ratio:.1f}x as long as plain. Its save call first agrees with the other "
            "ranks (the commit protocol's preflight, a collective), then runs DeepSpeed's save_checkpoint into host "
            f"memory ({by['async']['largest snapshot MiB']:.2f} MiB), barriers included. Plain's save call is "
            "DeepSpeed's save_checkpoint alone, its bytes handed to the operating system's page cache (memory, not "
            "yet the disk). The background write pays where writing takes longer than that agreement and copy: a "
            "larger model, or a disk slower than memory.")


def decoupled_sentence(records: list[dict[str, Any]]) -> str:
    """Where DeepSpeed's decoupled engine's stall goes, counted whole: each save call, each later step's wait for its
    writer, and the wait for the writer at the run's end; against the plain save's total."""
    mine = [r for r in records if r["mode"] == "ds_decoupled"]
    if not mine:
        plain = [r for r in records if r["mode"] == "plain"]
        beat = (f" The figure to beat: plain stopped training {max(per_rank_totals(plain)):.3f} s in all on its "
                f"slowest rank over {len(per_save_means(plain))} saves; count the decoupled engine's save calls, the "
                "later steps' waits for its writer and the wait at the run's end." if plain else "")
        return ("DeepSpeed's decoupled engine was not among the modes run (add `ds_decoupled` to `SAVE_MODES`)."
                + beat)
    last = {r["rank"]: r for r in mine}  # each rank's last save carries the wait at the run's end
    call = sum(r["stall_seconds"] - r["later_wait_seconds"] for r in mine) / len(last)
    end = median(r["later_wait_seconds"] for r in last.values())
    total = max(per_rank_totals(mine))
    plain = [r for r in records if r["mode"] == "plain"]
    versus = ""
    if plain:
        ratio = total / max(per_rank_totals(plain))
        rows = {r["mode"]: r for r in summary(mine + plain)}
        verdict = ("a tie with plain per save (their means differ by less than twice the standard error of the "
                   "difference)" if ties_with(rows["plain"], rows["ds_decoupled"]) else
                   f"{'less' if ratio < 1 else 'more'} than plain, beyond chance")
        versus = (f", {ratio:.2f}x the {max(per_rank_totals(plain)):.3f} s DeepSpeed's plain save stopped it: "
                  f"{verdict}")
    return (f"DeepSpeed's decoupled engine stopped training {total:.3f} s in all on its slowest rank over "
            f"{len(mine) // len(last)} saves: {call:.3f} s inside the save calls, the rest waiting for its writer "
            f"process in later steps, {end:.3f} s of it at the run's end{versus}; nothing it wrote was fsynced.")


def load_runs(out_dir: str | Path, modes: list[str]) -> dict[str, dict[str, Any]]:
    """The run.json of each mode's launch by `measure_modes`, by mode."""
    return {mode: RunResult.from_dir(Path(out_dir) / f"stall_{mode}", [], 0.0).data for mode in modes}


def memory_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and rank: the snapshot held after the save call, the rank's checkpoint files, the call's heap peak."""
    rows = []
    for mode, run in runs.items():
        for rank in run["ranks"]:
            calls = [c for c in run["save_costs"] if c["mode"] == "partitioned" and c["rank"] == rank["rank"]]
            files = sum(f["bytes"] for f in rank["files"] if "zero_pp_rank" in f["path"])
            rows.append({"mode": mode, "rank": rank["rank"],
                         "snapshot MiB": round(max(s.get("snapshot_bytes", 0) for s in rank["saves"]) / 2**20, 2),
                         "checkpoint files MiB": round(files / 2**20, 2),
                         "save call's extra heap peak MiB": round(
                             max(c.get("heap_extra_peak_bytes") or 0 for c in calls) / 2**20, 2)})
    return rows


def memory_sentence(rows: list[dict[str, Any]]) -> str:
    """What the asynchronous mode's snapshot costs in host memory, against the files it stands for."""
    held = [r for r in rows if r["snapshot MiB"]]
    if not held:
        return "No save held a snapshot (no asynchronous save ran), so no save cost memory beyond its call."
    worst = max(held, key=lambda r: r["snapshot MiB"])
    return (f"The asynchronous save's price: rank {worst['rank']} held a {worst['snapshot MiB']} MiB snapshot, "
            f"{worst['snapshot MiB'] / worst['checkpoint files MiB']:.2f}x its checkpoint files "
            f"({worst['checkpoint files MiB']} MiB), from the save call until its background write finished.")


def step_seconds(rank: dict[str, Any]) -> list[tuple[float, bool]]:
    """Each full training step of one rank: (seconds without any save's stall, whether a save was being written)."""
    saves, starts = rank["saves"], rank["step_starts"]
    steps = []
    for begin, end in zip(starts, starts[1:]):
        stalled = sum(s["stall_seconds"] for s in saves if begin <= s["started_at"] < end) + sum(
            s["commit_wait_seconds"] for s in saves if begin <= s.get("commit_wait_at", -1) < end)
        writing = any(s["durable_seconds"] and s["started_at"] + s["stall_seconds"] < end
                      and begin < s["started_at"] + s["durable_seconds"] for s in saves)
        steps.append((end - begin - stalled, writing))
    return steps


def after_first_save(rank: dict[str, Any]) -> list[tuple[float, bool]]:
    """`step_seconds` from the step that holds the first save on: the steps before it are the run's warm-up (the
    first is 3-4x a later one here), and no save can overlap them, so they would weigh on one side only."""
    first = min((s["started_at"] for s in rank["saves"]), default=float("inf"))
    starts = rank["step_starts"]
    return [st for st, end in zip(step_seconds(rank), starts[1:]) if end > first]


def step_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the training steps (the save's stall taken out) with and without a save being written, from the
    first save on (`after_first_save`): how many, their median, and how far the steps without one spread."""
    rows = []
    for mode, run in runs.items():
        steps = [st for rank in run["ranks"] for st in after_first_save(rank)]
        busy, idle = [t for t, w in steps if w], [t for t, w in steps if not w]
        rows.append({"mode": mode, "steps x ranks, no save being written": len(idle),
                     "median step s, no save being written": round(median(idle), 4) if idle else NONE,
                     "slowest / fastest step, no save being written": round(max(idle) / min(idle), 2)
                     if len(idle) > 1 else NONE,
                     "steps x ranks, a save being written": len(busy),
                     "median step s, a save being written": round(median(busy), 4) if busy else NONE})
    return rows


def overlap_verdict(rows: list[dict[str, Any]]) -> tuple[float, float, str] | None:
    """The async run's median step with a save being written over its median without, the noise it is held against
    (how far the steps with no save being written spread, slowest over fastest: the plain run's, where it ran, else
    the async run's own) and 'slower', 'faster' or 'tie'; None when no step overlapped a write."""
    row = next((r for r in rows if r["mode"] == "async"), None)
    keys = ("median step s, a save being written", "median step s, no save being written")
    if row is None or NONE in (row[keys[0]], row[keys[1]]):
        return None
    spread = "slowest / fastest step, no save being written"
    noise = next((r[spread] for r in rows if r["mode"] == "plain" and r[spread] != NONE), row[spread])
    noise = 1.0 if noise == NONE else noise
    ratio = row[keys[0]] / row[keys[1]]
    return ratio, noise, "slower" if ratio > noise else "faster" if ratio < 1 / noise else "tie"


def overlap_sentence(rows: list[dict[str, Any]]) -> str:
    """Whether writing a save in the background slowed the training steps it overlapped, beyond the spread of steps
    that overlapped none (`overlap_verdict`), and what that means for section 5's model, fed the stall alone."""
    found = overlap_verdict(rows)
    if found is None:
        return "No training step overlapped a background write, so their interference was not measured."
    ratio, noise, word = found
    row = next(r for r in rows if r["mode"] == "async")
    where = "the plain run" if any(r["mode"] == "plain" for r in rows) else "this run"
    verdict = {"slower": "beyond that noise: slower, as expected where the background write and hashing share the CPU "
                         "cores with training. Part of the stall saved comes back as slower steps, which section 5's "
                         "model, fed the stall alone, does not count",
               "faster": "beyond that noise the other way: faster, which the write itself cannot cause, so this "
                         "run cannot tell whether the write slows training",
               "tie": f"within that noise. This is a weak test: with this few steps it can only detect a slowdown "
                      f"larger than {noise:.2f}x (each step {noise - 1:.0%} longer), and this run shows none that "
                      "large. Section 5's model assumes the stall alone is what a save costs training"}[word]
    return (f"While an asynchronous save was being written, a training step took a median "
            f"{row['median step s, a save being written']:.3f} s ({row['steps x ranks, a save being written']} "
            f"steps x ranks) against {row['median step s, no save being written']:.3f} s otherwise in the same run "
            f"({row['steps x ranks, no save being written']} steps x ranks): {ratio:.2f}x. Steps with no save being "
            f"written spread {noise:.2f}x from fastest to slowest in {where}; {ratio:.2f}x is {verdict}.")


def save_costs(records: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per mode that makes its checkpoint durable: (mean seconds training stopped per save, median seconds from the
    end of that stall until durable). The mean, not the median: the calculator needs what saves cost on average."""
    costs = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        group = [r for r in records if r["mode"] == mode]
        durable = [r["durable_seconds"] - r["stall_seconds"] for r in group if r["durable_seconds"] is not None]
        if durable:
            costs[mode] = (sum(r["stall_seconds"] for r in group) / len(group), max(0.0, median(durable)))
    return costs


def interval_curves(records: list[dict[str, Any]], mtbf: float, restart: float) -> dict[str, list[Loss]]:
    """Per durable mode: the fraction of time lost against the save interval, from its measured stall and lag."""
    return {mode: loss_curve(c, mtbf, lag=lag, restart=restart) for mode, (c, lag) in save_costs(records).items()}


def interval_rows(records: list[dict[str, Any]], mtbf: float, restart: float) -> list[dict[str, Any]]:
    """Per durable mode: its measured stall and lag, Young's optimum interval and what is lost there, by cause."""
    rows = []
    for mode, (c, lag) in save_costs(records).items():
        best = lost_fraction(optimal_interval(c, mtbf), c, mtbf, lag=lag, restart=restart)
        rows.append({"mode": mode, "mean stall per save s": round(c, 4), "durable lag s": round(lag, 4),
                     "optimum interval s": round(best.interval, 1), "lost at optimum %": round(100 * best.total, 3),
                     "to saves %": round(100 * best.saves, 3), "to rework %": round(100 * best.rework, 3),
                     "to restarts %": round(100 * best.restart, 3)})
    return rows


def tied_modes(best: dict[str, Any], rows: list[dict[str, Any]], stalls: list[dict[str, Any]]) -> list[str]:
    """The modes of `interval_rows` other than `best` whose mean stall ties with best's (`ties_with`, on section 2's
    `summary` rows `stalls`)."""
    by_mode = {r["mode"]: r for r in stalls}
    return [r["mode"] for r in rows if r is not best and {r["mode"], best["mode"]} <= by_mode.keys()
            and ties_with(by_mode[best["mode"]], by_mode[r["mode"]])]


def interval_sentence(rows: list[dict[str, Any]], gpu_mtbf_hours: float, gpus: int, mtbf: float,
                      stalls: list[dict[str, Any]] | None = None) -> str:
    """Young's optimum for each durable mode in words, and which loses the least time; with section 2's `summary`
    rows (`stalls`), a mode whose mean stall ties with the best one's (`ties_with`) is named a tie."""
    if not rows:
        return "No mode run here makes its checkpoint durable, so there is no interval to compute."
    best = min(rows, key=lambda r: r["lost at optimum %"])
    each = "; ".join(f"{r['mode']} (a {r['mean stall per save s']:.3f} s stall) every {r['optimum interval s']:,.0f} "
                     f"s, losing {r['lost at optimum %']:.3f}% of the time" for r in rows)
    causes = {k.split()[1]: best[k] for k in ("to saves %", "to rework %", "to restarts %")}
    cause = max(causes, key=causes.get)
    tied = tied_modes(best, rows, stalls or [])
    least = (f"{best['mode']}" if not tied else f"{best['mode']}, a tie with {', '.join(tied)} (their mean stalls "
             "differ by less than twice the standard error of the difference)")
    runner_up = min((r for r in rows if r is not best), key=lambda r: r["lost at optimum %"], default=None)
    if runner_up:
        least += (f", by {runner_up['lost at optimum %'] - best['lost at optimum %']:.3f} percentage points over "
                  f"{runner_up['mode']}")
    return (f"With one failure every {mtbf / 3600:,.1f} h ({gpu_mtbf_hours:,} h per GPU over {gpus:,} GPUs), "
            f"Young's optimum sqrt(2 x stall x MTBF) says: save with {each}. The least time is lost with "
            f"{least}, and the largest share of it goes to {cause} ({causes[cause]:.3f}% of the time).")


def interval_answer(records: list[dict[str, Any]], gpu_mtbf_hours: float, gpus: int, default_gpus: int,
                    factor: int = 4) -> str:
    """The exercise's answer for the GPUs this run was given: each durable mode's optimum interval at the
    notebook's `default_gpus` against `gpus`; with the default itself, against `factor` times it (what to try)."""
    other = gpus if gpus != default_gpus else factor * gpus
    moves = []
    for mode, (c, _) in save_costs(records).items():
        now, then = (optimal_interval(c, gpu_mtbf_hours * 3600 / g) for g in (default_gpus, other))
        moves.append(f"{mode} from {now:,.1f} s to {then:,.1f} s ({then / now:.2f}x)")
    if not moves:
        return "No mode run here makes its checkpoint durable, so there is no interval to move."
    ran = (f"This run used the default {gpus:,} GPUs, so here is what the exercise's `CLUSTER_GPUS = {other}` gives "
           "from the same stalls. " if other != gpus else
           f"This run used {gpus:,} GPUs, {gpus / default_gpus:g}x the default {default_gpus:,}. ")
    return (f"{ran}From {default_gpus:,} to {other:,} GPUs the job's MTBF becomes {default_gpus / other:g}x as long "
            f"and the optimum interval, from the stalls measured in section 2, moves {'; '.join(moves)}: "
            f"sqrt({default_gpus / other:g}) = {(default_gpus / other) ** 0.5:.2f}x, since the interval grows with "
            "the square root of the MTBF.")
