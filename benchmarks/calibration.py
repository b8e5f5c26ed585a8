"""The plan's time model against measured saves: each measuring machine's constants fitted, leave one out.

    .venv/bin/python benchmarks/calibration.py [--extra_dir DIR_WITH_compare.json] [--csv build/bench/calibration.csv]

Each rank-0 save of the shipped records (`benchmarks/data/measured_cpu_compare.json`, from
`benchmarks/calibration_records.py`) is predicted twice: from the plan's bandwidth terms alone (`plan.planning`, at
bandwidths probed on this machine), and with its measuring machine's constants fitted by least squares on that
machine's other saves. Prints the fitted constants, the worst-predicted saves and how many lie within 25%;
the findings are in docs/cost_model.md.
"""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

from zckpt_nb.format.records import Route
from zckpt_nb.format.units import counted
from zckpt_nb.plan.costs import Prediction, predict
from zckpt_nb.plan.planning import GB, READ_RANK_FILES, Bandwidths, time_terms, work

MEASURED = Path(__file__).parent / "data" / "measured_cpu_compare.json"


def seconds(s: float, unit: str = "ms") -> str:
    """A duration in `unit` to 3 significant figures."""
    value = s / {"s": 1, "ms": 1e-3}[unit]
    return f"{float(f'{value:.3g}'):,g} {unit}"


def measured_records(extra_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The records measured on this project's 2-core CPU machine (shipped), plus any `compare.json` in `extra_dir`."""
    return json.loads(MEASURED.read_text()) + (load_records(Path(extra_dir)) if extra_dir else [])


def records_sentence(records: list[dict[str, Any]]) -> str:
    """What measured records cover, read from them: per machine, each model's world sizes and the repeats."""
    lines = []
    for machine in dict.fromkeys(r.get("machine", "?") for r in records):
        mine = [r for r in records if r.get("machine", "?") == machine]
        models = dict.fromkeys(r["model"] for r in mine)
        sizes = {m: sorted({r["world_size"] for r in mine if r["model"] == m}) for m in models}
        repeats = sorted({len(r.get("repeat_seconds") or [0]) for r in mine})
        modes = len({r["mode"] for r in mine})
        each = "measured once" if repeats == [1] else f"the median of {' or '.join(map(str, repeats))} repeats"
        name = "the machine running this notebook" if machine == platform.node() else machine
        lines.append(f"Measured saves on {name}: "
                     + "; ".join(f"`{m}` at N = {', '.join(map(str, n))}" for m, n in sizes.items())
                     + f"; {counted(modes, 'save mode')}, {len(mine)} records (every rank), each {each}")
    return ". ".join(lines) + "."


ON_ALL_RANKS = ("partitioned", "gathered16", "per_param")  # the saves; offline and hf run in one process


def cpu_share(record: dict[str, Any]) -> float:
    """Ranks per CPU core during a save (at least 1): CPU ranks beyond the machine's cores take turns."""
    cpus = record.get("cpus")
    return max(1.0, record["world_size"] / cpus) if cpus and record["mode"] in ON_ALL_RANKS else 1.0


def features(record: dict[str, Any], pred: Prediction | None = None) -> dict[str, float]:
    """A measured save as the terms its seconds are fitted from: its mode's fixed cost and bytes, what it moves.

    Each mode has its own writer (the committed save's hashed O_DIRECT writes, `torch.save` through the page cache,
    safetensors), so each gets its own fixed cost and its own seconds per byte written and read. The routes that
    read a checkpoint open, check and unpickle 2 files per rank whatever their size: a cost per file. Work done by
    the CPU takes `cpu_share` times as long when ranks share cores; the collectives' bytes and ring steps are waits.
    `pred`: the record's prediction, when the caller has it already.
    """
    pred = pred or predict(record["model"], record["world_size"], record["dtype"], record["persistence_threshold"])
    mode, q, share = record["mode"], work(pred, record["mode"]), cpu_share(record)
    mine = {m: share * (m == mode) for m in Route}
    return {**{f"fixed {m}": v for m, v in mine.items()},
            **{f"bytes {m}": v * (q["write"] + q["read"]) for m, v in mine.items()},
            **{f"files {m}": q["files"] * (m == mode) for m in READ_RANK_FILES},
            "net": q["net"], "steps": q["steps"]}


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per unit of each feature, at least 0, that minimise the relative error over `rows`.

    Weighted least squares (numpy); a term that comes out below 0 is dropped and the rest refitted (a cost cannot be
    negative, and numpy has no non-negative solver).
    """
    import numpy as np

    keys = [k for k in rows[0]["features"] if any(r["features"][k] for r in rows)]
    while True:
        x = np.array([[r["features"][k] / r["measured s"] for k in keys] for r in rows])
        theta = np.linalg.lstsq(x, np.ones(len(rows)), rcond=None)[0]
        if (theta >= 0).all():
            return {k: float(theta[keys.index(k)]) if k in keys else 0.0 for k in rows[0]["features"]}
        keys.pop(int(np.argmin(theta)))


def predicted(row: dict[str, Any], constants: dict[str, float]) -> float:
    """A measured save's seconds from fitted constants."""
    return sum(v * constants[k] for k, v in row["features"].items())


def calibration(records: list[dict[str, Any]], bw: Bandwidths) -> list[dict[str, Any]]:
    """Rank 0 of each measured save: its seconds predicted from `bw` alone, and from its machine's constants.

    The constants (`features`: per mode a fixed cost and seconds per byte written and read; seconds per byte
    received and per ring step) are fitted on the machine's *other* saves (leave one out), so no record is predicted
    from a fit that saw it. Records are fitted per machine (their `machine` field); too few: no fitted figure.
    """
    rows = []
    for r in (r for r in records if r["rank"] == 0):
        pred = predict(r["model"], r["world_size"], r["dtype"], r["persistence_threshold"])
        rows.append({"machine": r.get("machine", "?"), "model": r["model"], "mode": r["mode"], "N": r["world_size"],
                     "measured s": r["seconds"], "repeat s": r.get("repeat_seconds", []),
                     "bandwidth-only s": sum(time_terms(pred, bw)[r["mode"]].values()),
                     "bytes exact": r["predicted_bytes"] == r["measured_payload_bytes"], "features": features(r, pred)})
    for i, row in enumerate(rows):
        others = [o for j, o in enumerate(rows) if j != i and o["machine"] == row["machine"]]
        row["fitted s"] = predicted(row, fit(others)) if enough([row, *others]) else None
        for key in ("bandwidth-only s", "fitted s"):
            row[key.replace(" s", " error")] = None if row[key] is None else row[key] / row["measured s"] - 1
    return rows


def enough(rows: list[dict[str, Any]]) -> bool:
    """Whether there are more saves than constants to fit (leaving one out)."""
    return len(rows) > len(rows[0]["features"]) + 1


def rate(seconds_per_byte: float) -> str:
    """A fitted seconds-per-byte constant as GB/s."""
    return f"{1 / seconds_per_byte / GB:.3g} GB/s" if seconds_per_byte else "not fitted (0)"


def machine_constants(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per machine with enough saves, the constants fitted on all of them, as a person reads them."""
    out = []
    for machine in dict.fromkeys(r["machine"] for r in rows):
        mine = [r for r in rows if r["machine"] == machine]
        if not enough(mine):
            continue
        c = fit(mine)
        named = [*((f"{m}: fixed time per save", seconds(c[f"fixed {m}"], "ms")) for m in Route),
                 *((f"{m}: bandwidth, bytes written and read", rate(c[f"bytes {m}"])) for m in Route),
                 *((f"{m}: time per rank file read", seconds(c[f"files {m}"], "ms")) for m in READ_RANK_FILES),
                 ("network: bandwidth, bytes received", rate(c["net"])),
                 ("time of one ring step", seconds(c["steps"], "ms"))]
        out += [{"machine": machine, "constant": k, "value": v} for k, v in named]
    return out


def predicted_over_measured(error: float) -> float:
    """A relative error (predicted / measured - 1) back as the ratio, kept above 0 for the log."""
    return max(1 + error, 1e-9)


def misfit(error: float) -> float:
    """How far a prediction missed, as |log(predicted / measured)|: 10x under counts as much as 10x over."""
    return abs(math.log(predicted_over_measured(error)))


def as_factor(error: float) -> str:
    """A relative error as a person reads a miss: '2.8x over', '10.3x under'."""
    ratio = predicted_over_measured(error)
    return f"{ratio:.1f}x over" if ratio >= 1 else f"{1 / ratio:.1f}x under"


def calibration_sentence(rows: list[dict[str, Any]], tolerance: float = 0.25) -> str:
    """How many predicted times lie within `tolerance` of the measured ones, both ways, and the bytes verdict."""
    def within(key: str) -> str:
        rated = [r for r in rows if r[key] is not None]
        near = sum(abs(r[key]) <= tolerance for r in rated)
        worst = max(rated, key=lambda r: misfit(r[key]), default=None)
        return (f"{near} of {len(rated)} within {tolerance:.0%}" + (f" (worst: {worst['model']} {worst['mode']} at "
                f"N = {worst['N']}, {as_factor(worst[key])})" if worst else ""))

    exact = sum(r["bytes exact"] for r in rows)
    repeats = [x / r["measured s"] - 1 for r in rows for x in r["repeat s"]]
    floor = (f" The measurements' own spread: {sum(abs(e) <= tolerance for e in repeats)} of {len(repeats)} single "
             f"repeats lie within {tolerance:.0%} of their median." if repeats else "")
    unfitted = sum(r["fitted error"] is None for r in rows)
    few = f" ({unfitted} saves of a machine with too few of them to fit have no fitted figure)" if unfitted else ""
    return (f"Against {len(rows)} measured saves (rank 0): bandwidths alone (the probe of the machine running this, "
            f"applied to every save, whichever machine measured it) put {within('bandwidth-only error')}; with each "
            f"measuring machine's constants fitted on its other saves, {within('fitted error')}{few}.{floor} "
            f"Bytes written: {exact} of {len(rows)} equal the prediction exactly.")


def load_records(out_dir: Path) -> list[dict[str, Any]]:
    """Records `compare_world_sizes.py` measured into `out_dir/compare.json`, in the shipped records' keys."""
    from dataclasses import asdict

    from measured_routes import load_records as measured  # benchmarks/measured_routes.py

    renamed = {"route": "mode", "peak_rss_bytes": "peak_memory_bytes"}
    return [{renamed.get(k, k): v for k, v in asdict(r).items()} for r in measured(out_dir)]


def calibration_table(rows: list[dict[str, Any]], shown: int = 12) -> list[dict[str, Any]]:
    """The `shown` saves the fitted constants predict worst, worst first, as a person reads them (ms, and each
    prediction's miss as a factor over or under the measured time)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.1f}"

    def miss(v: float | None) -> str:
        return "-" if v is None else f"{as_factor(v)} ({v:+.0%})"

    return [{"model": r["model"], "mode": r["mode"], "N": r["N"], "measured ms": ms(r["measured s"]),
             "bandwidths alone ms": ms(r["bandwidth-only s"]), "fitted ms": ms(r["fitted s"]),
             "bandwidths alone, miss": miss(r["bandwidth-only error"]), "fitted, miss": miss(r["fitted error"])}
            for r in worst_first(rows)[:shown]]


def worst_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calibrated saves by the fitted prediction's error, largest first (unfitted last)."""
    return sorted(rows, key=lambda r: -misfit(r["fitted error"] or 0))


def save_calibration(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Every calibrated save, as `calibration_table` words it, in a CSV file at `path`; the path."""
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{"machine": r["machine"], **t} for r, t in zip(worst_first(rows), calibration_table(rows, len(rows)))]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(full[0]))
        writer.writeheader()
        writer.writerows(full)
    return path


def constants_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`machine_constants` with one column per machine, one row per constant."""
    machines = list(dict.fromkeys(r["machine"] for r in rows))
    names = list(dict.fromkeys(r["constant"] for r in rows))
    value = {(r["machine"], r["constant"]): r["value"] for r in rows}
    return [{"constant": c, **{m.split(" (")[0]: value.get((m, c), "-") for m in machines}} for c in names]


def probe_disk(directory: Path, nbytes: int = 2**26) -> Bandwidths:
    """This machine's write GB/s (`torch.save` of one buffer, then fsync) and read GB/s (`torch.load` of it, from the
    page cache); the network is not probed (that needs two ranks) and is set to the write figure."""
    import os
    import time

    import torch

    path = directory / "zckpt_probe.pt"
    buffer = torch.ones(nbytes // 4)
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(buffer, f)
        f.flush()
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    start = time.perf_counter()
    torch.load(path, weights_only=True)
    read = time.perf_counter() - start
    path.unlink()
    return Bandwidths(nbytes / written / GB, nbytes / read / GB, nbytes / written / GB)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra_dir", default=None, help="a folder whose compare.json joins the shipped records")
    parser.add_argument("--csv", default="build/bench/calibration.csv", help="every calibrated save, worst first")
    parser.add_argument("--shown", type=int, default=12)
    args = parser.parse_args()
    records = measured_records(args.extra_dir)
    print(records_sentence(records))
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    probed = probe_disk(Path(args.csv).parent)
    print(f"probed here: write {probed.write_gbps:.3g} GB/s, read {probed.read_gbps:.3g} GB/s")
    rows = calibration(records, probed)
    for row in constants_table(machine_constants(rows)):
        print("  " + "  ".join(f"{v}" for v in row.values()))
    for row in calibration_table(rows, args.shown):
        print("  " + "  ".join(f"{k}: {v}" for k, v in row.items()))
    print(calibration_sentence(rows))
    print(f"every save: {save_calibration(rows, args.csv)}")


if __name__ == "__main__":
    main()
