"""How long a save stops training, per save mode: the stall against the time until the checkpoint is durable.

Each save mode gets one training launch with the same model, world size, steps and save schedule. Its run.json
holds, per save and rank, `stall_seconds` (the save call to the start of the next step) and `durable_seconds` (the
save call to the moment every rank knows the commit is on disk; None for DeepSpeed's plain save, which never
fsyncs). The asynchronous mode also records the snapshot it holds in memory until its files are written.
"""

from __future__ import annotations

import re
from pathlib import Path
from statistics import median
from typing import Any

from zckpt_nb.errors import LaunchError, UsageError
from zckpt_nb.run.launch import RunResult, fresh_dir, launch

SAVE_MODES = ("plain", "commit", "async", "ds_python", "ds_decoupled", "ds_fast")  # ds_*: `zckpt_nb.saving.engines`


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
                  save_every: int = 4, progress: bool = False) -> list[dict[str, Any]]:
    """One launch per save mode into OUT_DIR/stall_<mode>; one record per (mode, rank, save)."""
    unknown = [m for m in modes if m not in SAVE_MODES]
    if unknown or not modes:
        raise UsageError(f"unknown or no save modes {unknown}; choose from {', '.join(SAVE_MODES)}")
    return [r for mode in modes for r in run_records(launch_mode(model, nproc, mode, out_dir, steps=steps,
                                                                 save_every=save_every, progress=progress), mode)]


def launch_mode(model: str, nproc: int, mode: str, out_dir: str | Path, *, steps: int, save_every: int,
                progress: bool = False, timeout: float | None = None) -> Path:
    """One training launch with `--save_mode mode` into a fresh OUT_DIR/stall_<mode>; that folder."""
    return launch(nproc, steps, fresh_dir(Path(out_dir) / f"stall_{mode}"), save_every=save_every, model=model,
                  save_mode=mode, verbose=False, progress=progress, timeout=timeout).output_dir


def measure_all(model: str, nproc: int, modes: list[str], tries: list[str], out_dir: str | Path, *, steps: int = 8,
                save_every: int = 4) -> tuple[list[dict[str, Any]], dict[str, str | None]]:
    """`measure_modes` for `modes`; then each of `tries` once, bounded: it joins the records if it ran, else its
    error line is kept. Returns (records, {tried mode: None or why it could not run})."""
    records = measure_modes(model, nproc, modes, out_dir, steps=steps, save_every=save_every)
    tried = {m: attempt(model, nproc, m, out_dir, steps=steps, save_every=save_every) for m in tries}
    records += [r for m, why in tried.items() if why is None for r in run_records(Path(out_dir) / f"stall_{m}", m)]
    return records, tried


def attempt(model: str, nproc: int, mode: str, out_dir: str | Path, *, steps: int = 4, save_every: int = 2,
            timeout: float = 300.0) -> str | None:
    """Run one save mode's launch (bounded by `timeout`); None if it ran, else the line that says why it failed."""
    try:
        launch_mode(model, nproc, mode, out_dir, steps=steps, save_every=save_every, timeout=timeout)
    except LaunchError as e:
        return failure_line(str(e))
    return None


def failure_line(message: str) -> str:
    """The last exception line the ranks printed (`SomeError: ...`), else the launcher's first line."""
    found = [line.split("] ", 1)[-1].strip() for line in message.splitlines()
             if re.search(r"\b\w*(Error|Exception)\b: ", line)]
    return found[-1] if found else message.splitlines()[0]


def summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the median stall and time to durable over its saves and ranks, and its largest snapshot."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        group = [r for r in records if r["mode"] == mode]
        durable = [r["durable_seconds"] for r in group if r["durable_seconds"] is not None]
        rows.append({"mode": mode, "saves x ranks": len(group),
                     "median stall s": round(median(r["stall_seconds"] for r in group), 4),
                     "of which a later step waited s": round(median(r["later_wait_seconds"] for r in group), 4),
                     "median durable s": round(median(durable), 4) if durable else NEVER,
                     "largest snapshot MiB": round(max(r["snapshot_bytes"] for r in group) / 2**20, 2)})
    return rows


def stall_sentence(rows: list[dict[str, Any]]) -> str:
    """What the medians say: which mode stops training least, and when each mode's checkpoint is durable."""
    least = min(rows, key=lambda r: r["median stall s"])
    parts = [f"{r['mode']} stops training {r['median stall s']:.3f} s per save and "
             + ("never makes it durable (no fsync)" if r["median durable s"] == NEVER
                else f"is durable after {r['median durable s']:.3f} s") for r in rows]
    memory = [f"{r['mode']} holds a {r['largest snapshot MiB']} MiB snapshot per rank until its files are written"
              for r in rows if r["largest snapshot MiB"]]
    return (f"Medians over every save and rank: {'; '.join(parts)}. Least stall: {least['mode']}."
            + "".join(f" The price: {m}." for m in memory))


def decoupled_sentence(records: list[dict[str, Any]]) -> str:
    """Where DeepSpeed's decoupled engine's stall goes: the save call, then a later step waiting for its writer."""
    mine = [r for r in records if r["mode"] == "ds_decoupled"]
    if not mine:
        return "DeepSpeed's decoupled engine was not among the modes run."
    call = median(r["stall_seconds"] - r["later_wait_seconds"] for r in mine)
    wait, total = median(r["later_wait_seconds"] for r in mine), median(r["stall_seconds"] for r in mine)
    plain = [r["stall_seconds"] for r in records if r["mode"] == "plain"]
    return (f"DeepSpeed's decoupled engine returned from the save call after a median {call:.3f} s, then a later "
            f"step waited {wait:.3f} s for its writer process: training stopped {total:.3f} s per save"
            + (f", {total / median(plain):.2f}x DeepSpeed's plain save" if plain else "")
            + ", and nothing it wrote was fsynced.")


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


def step_rows(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the median training step (the save's stall taken out) with and without a save being written."""
    rows = []
    for mode, run in runs.items():
        steps = [st for rank in run["ranks"] for st in step_seconds(rank)]
        busy, idle = [t for t, w in steps if w], [t for t, w in steps if not w]
        rows.append({"mode": mode, "steps x ranks": len(steps),
                     "median step s, no save being written": round(median(idle), 4) if idle else NONE,
                     "median step s, a save being written": round(median(busy), 4) if busy else NONE})
    return rows


def overlap_sentence(rows: list[dict[str, Any]], tolerance: float = 0.1) -> str:
    """Whether writing a save in the background slowed the training steps it overlapped (beyond `tolerance`)."""
    row = next((r for r in rows if r["mode"] == "async"), None)
    if row is None or NONE in (row["median step s, a save being written"], row["median step s, no save being written"]):
        return "No training step overlapped a background write, so their interference was not measured."
    busy, idle = row["median step s, a save being written"], row["median step s, no save being written"]
    verdict = (f"slower by more than {tolerance:.0%}, as expected where the background write and hashing share "
               "the CPU cores with training; part of the stall saved comes back as slower steps"
               if busy > (1 + tolerance) * idle else
               f"within {tolerance:.0%}, so this run shows no slowdown from the overlapping write")
    return (f"While an asynchronous save was being written, a training step took a median {busy:.3f} s against "
            f"{idle:.3f} s otherwise in the same run ({busy / idle:.2f}x): {verdict}.")
