"""Every notebook runs top to bottom with its defaults and under a learner's parameters (other N, other settings),
and every check it prints (`course.show.check`) holds.

A verdict printed by a notebook must be the one its own data gives: the tests recompute it from the run's files.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import nbformat
import pytest
import torch

from zckpt_nb.convert.inspect import inspect_checkpoint
from zckpt_nb.convert.safeload import load as safe_load
from zckpt_nb.course.notebooks import execute, failed_checks, notebook_paths
from zckpt_nb.course.panel import probe_dir
from zckpt_nb.course.ranks import lesson_dtype
from zckpt_nb.format.layout import committed_tags, tag_for
from zckpt_nb.lessons import claims, worlds
from zckpt_nb.lessons.dcp import dcp_rows, fsdp_answer, leg_gaps, round_trip_sentence, switch_answer, tolerance
from zckpt_nb.lessons.nodes import folder_rows
from zckpt_nb.lessons.own_model import drop_answer, max_difference, partition_answer
from zckpt_nb.model import get_preset
from zckpt_nb.plan.costs import predict
from zckpt_nb.plan.interval import job_mtbf_seconds, lost_fraction, optimal_interval
from zckpt_nb.plan.planning import Bandwidths, plan
from zckpt_nb.run.launch import RunResult

NOTEBOOKS = notebook_paths(Path(__file__).resolve().parents[1] / "notebooks")
BY_PREFIX = {p.name[:2]: p for p in NOTEBOOKS}
# A learner's parameters: odd and single world sizes, DeepSpeed's default persistence threshold, other presets' knobs.
MATRIX = [
    ("01", {"WORLD_SIZES": [1, 3], "THRESHOLD_NPROC": 3, "PERSISTENCE_THRESHOLD": 100_000, "OTHER_THRESHOLD": 0,
            "DTYPE": "bf16"}),
    ("02", {"NPROC": 3, "RESUME_STEP": 1, "DTYPE": "bf16"}),
    ("03", {"NPROC": 3, "FREEZE": "embeddings"}),
    ("04", {"NPROC": 3, "MODEL": "tiny", "DTYPE": "bf16", "PERSISTENCE_THRESHOLD": 100_000,
            "MAX_SHARD_SIZE": "1MB"}),
    ("05", {"NPROC": 1, "KEEP_LAST": 1, "DTYPE": "bf16"}),
    ("06", {"NPROC": 3, "PERSISTENCE_THRESHOLD": 100_000, "DTYPE": "bf16", "SAVE_MODES": ["plain", "async"],
            "REPEATS": 4}),
    ("07", {"SOURCE_NPROC": 3, "TARGET_NPROCS": [2], "STEPS": 10, "RESUME_STEP": 5, "GLOBAL_BATCH": 7, "NODES": 3,
            "NODE_STEPS": 2, "DTYPE": "bf16"}),
    ("08", {"NPROC": 3, "DTYPE": "bf16", "STEPS": 3, "DROP_RANK": 0, "DROP_FILE": "model_states"}),
    ("09", {"CONFIGS": ["llama-3-8b", "gpt2-xl"], "SIZES": [8, 4096], "DTYPE": "fp32", "NODES": 1, "GPUS_PER_NODE": 3,
            "PERSISTENCE_THRESHOLD": 100_000, "PLAN_CONFIG": "gpt2-xl", "WRITE_GBPS": 20.0, "COPY_GBPS": 5.0,
            "STEP_LATENCY_US": 8.0, "FILE_MS": 3.0, "FS_CAP_GBPS": 50.0}),
    ("10", {"FSDP_NPROC": 1, "SWITCH_STEP": 4, "DTYPE": "bf16"}),
]


def parameter_defaults(path: Path) -> dict:
    """What the notebook's `parameters` cell sets (run, so the test reads the notebook's own defaults)."""
    cell = next(c for c in nbformat.read(path, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    values: dict = {}
    exec(cell.source, values)
    return values


def run_notebook(path: Path, tmp_path: Path, parameters: dict) -> nbformat.NotebookNode:
    """Execute with OUTPUT_ROOT in tmp_path; fail on any error output; return the executed notebook."""
    out = execute(path, tmp_path, parameters={"OUTPUT_ROOT": str(tmp_path / "runs"), **parameters})
    nb = nbformat.read(out, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]
    assert not failed_checks(out), failed_checks(out)  # every check the notebook prints holds under these parameters
    assert out.with_suffix(".html").stat().st_size > 10_000
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 2, "every notebook shows its measurements as plots"
    return nb


def markdown_outputs(nb: nbformat.NotebookNode) -> str:
    """Every Markdown a code cell displayed (where computed sentences go)."""
    return "\n".join(o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if "text/markdown" in o.get("data", {}))


def passed_checks(nb: nbformat.NotebookNode) -> list[str]:
    """Every check line a notebook printed that held (`course.show.check`)."""
    return [line for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
            for line in o.text.splitlines() if line.startswith("✓ ")]


def check_01(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 01 checked every world size's slices and both thresholds, and its files agree with the cost model."""
    get = {**parameter_defaults(BY_PREFIX["01"]), **parameters}
    held = passed_checks(nb)
    sizes = sorted(set(get["WORLD_SIZES"]))
    assert [line for line in held if "every rank's slice is" in line] == [
        f"✓ N = {n}: every rank's slice is Σ⌈k/N⌉ = {predict('tiny', n).slice_numel:,} elements, as predicted"
        for n in sizes]
    assert sum("held its slice plus the persistent tensors" in line for line in held) == 2
    assert any("same tensor bytes at both thresholds" in line for line in held)
    for n in sizes:  # the notebook's own arithmetic against the library's cost model, on the files it wrote
        info = inspect_checkpoint(runs / f"n{n}")
        assert {s.partition_numel for s in info.ranks} == {predict("tiny", n).slice_numel}


def check_02(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 02 checked its resume, and the two runs' logs say the same as its checks."""
    get = {**parameter_defaults(BY_PREFIX["02"]), **parameters}
    held = passed_checks(nb)
    assert len([line for line in held if "resume" in line]) == 3, held
    printed = [re.search(r"step (\d+) loss ([\d.e+-]+) lr ([\d.e+-]+)", line) for name in ("minimal", "minimal_resumed")
               for line in (runs / f"{name}.log").read_text().splitlines()]
    full, resumed = {}, {}
    for m in filter(None, printed):
        (resumed if int(m[1]) in full else full)[int(m[1])] = m[2]
    assert sorted(full) == list(range(1, get["STEPS"] + 1))
    assert sorted(resumed) == list(range(get["RESUME_STEP"] + 1, get["STEPS"] + 1))
    assert all(full[s] == resumed[s] for s in resumed)  # CPU ranks: the resume repeats every loss bit for bit
    info = inspect_checkpoint(runs / "minimal", tag_for(get["STEPS"]))
    assert info.world_size == get["NPROC"] and info.num_params == predict("tiny", 1).num_params


def check_03(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 03 checked bf16, the frozen saves and the three warm-start loads, on the files it wrote."""
    get = {**parameter_defaults(BY_PREFIX["03"]), **parameters}
    held = passed_checks(nb)
    assert len(held) == 9, held
    assert any(f"got {get['LOAD_TAG']}'s weights exactly" in line for line in held)
    for name in ("fp32", "bf16", "frozen", "frozen_excluded"):
        assert inspect_checkpoint(runs / name).world_size == get["NPROC"]
    assert inspect_checkpoint(runs / "warm", "older").num_params == predict("tiny", 1).num_params


def check_04(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 04 proved its four routes and its reload; the export it made loads and holds the masters."""
    from safetensors.torch import load_file

    held = passed_checks(nb)
    assert len(held) == 7, held
    assert any("equal the working weights: every route holds the weights it should" in line for line in held)
    exported = {k: v for f in (runs / "route_4").glob("*.safetensors") for k, v in load_file(f).items()}
    masters = safe_load(runs / "route_3" / "pytorch_model.bin")
    assert exported and all(torch.equal(exported[k], masters[k]) for k in exported)


def check_05(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 05 checked its hang, its two killed saves, its manifest and its resume; the files agree."""
    get = {**parameter_defaults(BY_PREFIX["05"]), **parameters}
    held = passed_checks(nb)
    assert len(held) == (11 if get["NPROC"] > 1 else 8), held
    assert (runs / "commit" / "latest").read_text().strip() == "global_step4"
    kept = committed_tags(runs / "resumed")
    assert len(kept) == min(get["KEEP_LAST"], get["STEPS"] // get["SAVE_EVERY"]) and kept[-1] == tag_for(get["STEPS"])


def check_06(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 06 timed every save of every mode on every rank, in the dtype it resolved, and its tie table calls
    each pair of modes as the exact test on those timings does."""
    get = {**parameter_defaults(BY_PREFIX["06"]), **parameters}.get
    n, modes, dtype = get("NPROC"), get("SAVE_MODES"), lesson_dtype(get("DTYPE"))
    folder = probe_dir(runs, get("MODEL"), dtype, get("PERSISTENCE_THRESHOLD"), n)
    records = [r for rank in range(n) for r in json.loads((folder / f"timings_rank{rank}.json").read_text())]
    assert sorted((r["mode"], r["repeat"], r["rank"]) for r in records) == sorted(
        (m, i, rank) for m in modes for i in range(get("REPEATS")) for rank in range(n))
    text = "\n".join(o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs)
    for a, b in itertools.combinations(modes, 2):
        def slowest(mode: str) -> list[float]:
            return [max(r["call_s"] + r["wait_s"] for r in records if (r["mode"], r["repeat"]) == (mode, i))
                    for i in range(get("REPEATS"))]
        xs, ys = slowest(a), slowest(b)
        wins = sum((x < y) + 0.5 * (x == y) for x in xs for y in ys)
        assert re.search(rf"{a}\s+{b}\s+\S+\s+{wins:g} of {len(xs) * len(ys)}", text), (a, b, wins)


def check_07(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 07's verdicts equal the ones its own measurements give."""
    text = markdown_outputs(nb)
    base = RunResult.from_dir(runs / "uninterrupted", [], 0.0)
    resumed = {int(d.name.rsplit("_", 1)[1]): RunResult.from_dir(d, [], 0.0)
               for d in sorted(runs.glob("resumed_on_*"))}
    rows = claims.reshard_rows(base, resumed)
    assert claims.reshard_sentence(rows, base.data["dtype"]) in text
    preset = get_preset("tiny")
    assert worlds.batch_answer(rows, base.data["global_batch"], preset.global_batch, preset.micro_batch,
                               base.data["dtype"], base.world_size) in text  # exercise 1
    assert base.data["dtype"] == lesson_dtype(parameters.get("DTYPE", "auto"))
    local = sorted(runs.glob("node*"))
    assert len(local) == parameters.get("NODES", 2) and worlds.nodes_answer(folder_rows(local), 2) in text
    assert "The principle calls a partitioned checkpoint optimal for training resumption. That holds on the " in text
    assert all(r.data["global_batch"] == parameters.get("GLOBAL_BATCH", 16) for r in [base, *resumed.values()])


def check_08(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 08's verdicts equal the ones its own measurements give."""
    text = markdown_outputs(nb)
    steps = {**parameter_defaults(BY_PREFIX["08"]), **parameters}["STEPS"]
    exact = max_difference(runs / "hf", runs / "raw", tag_for(steps)) == 0 and max_difference(
        runs / "trainer_hf", runs / "trainer" / f"checkpoint-{steps}", tag_for(steps)) == 0
    assert f"exported {'exactly' if exact else 'not exactly'} DeepSpeed's fp32 weights" in text
    nproc = {**parameter_defaults(BY_PREFIX["08"]), **parameters}["NPROC"]
    answers = [o["data"]["text/markdown"] for c in nb.cells if "answer" in c.metadata.get("tags", [])
               for o in c.outputs if "text/markdown" in o.get("data", {})]
    assert answers[0] == partition_answer(runs / "raw", nproc) and answers[0].endswith("equal.")
    get = {**parameter_defaults(BY_PREFIX["08"]), **parameters}.get
    assert answers[1] == drop_answer(runs / "raw", runs, tag_for(steps), get("DROP_RANK"), get("DROP_FILE"))
    assert ("cannot tell how many ranks" in answers[1]) == (get("DROP_RANK") in (0, -nproc)
                                                            and get("DROP_FILE") == "model_states")


def stream_text(nb: nbformat.NotebookNode) -> str:
    """Everything the code cells printed."""
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "stream")


def check_09(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 09 checks every config it counts, and its chosen interval is Young's for the rates it planned with."""
    text, get = stream_text(nb), {**parameter_defaults(BY_PREFIX["09"]), **parameters}.get
    assert text.count("✓") >= len(get("CONFIGS")) + 3
    if get("WRITE_GBPS") and get("COPY_GBPS"):  # the rates given, not measured: the same figures here as there
        n = get("NODES") * get("GPUS_PER_NODE")
        bw = Bandwidths(get("WRITE_GBPS"), get("WRITE_GBPS"), get("NET_GBPS"), get("STEP_LATENCY_US"), get("FILE_MS"))
        part = next(r for r in plan(get("PLAN_CONFIG"), n, bw, get("DTYPE"), get("PERSISTENCE_THRESHOLD"))
                    if r.route == "partitioned")
        mtbf = job_mtbf_seconds(get("GPU_MTBF_HOURS"), n)
        modes = {"commit": (part.stall_s, 0.0), "async": (part.written_bytes / (get("COPY_GBPS") * 1e9),
                                                         part.written_bytes / (get("WRITE_GBPS") * 1e9))}
        lost = {m: lost_fraction(optimal_interval(c, mtbf), c, mtbf, lag=lag, restart=get("RESTART_S"))
                for m, (c, lag) in modes.items()}
        chosen = min(lost, key=lambda m: lost[m].total)
        assert f"choose {chosen}, saving every {lost[chosen].interval / 60:,.1f} min of training" in text


def check_10(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 10's verdicts and exercise answers equal the ones its own runs give."""
    text = markdown_outputs(nb)
    get = {**parameter_defaults(BY_PREFIX["10"]), **parameters}.get
    base, fsdp, back = (RunResult.from_dir(runs / name, [], 0.0) for name in ("zero3", "fsdp", "back"))
    assert (base.world_size, fsdp.world_size, back.world_size) == (get("SOURCE_NPROC"), get("FSDP_NPROC"),
                                                                   get("BACK_NPROC"))
    assert fsdp.steps[0] == get("SWITCH_STEP") and back.steps[0] == 2 * get("SWITCH_STEP")
    dtype = lesson_dtype(get("DTYPE"))
    assert base.data["dtype"] == fsdp.data["dtype"] == back.data["dtype"] == dtype
    assert max(leg_gaps(base, fsdp) + leg_gaps(base, back)) < claims.RESUME_TOLERANCE[dtype]
    assert f"within {tolerance(base)[1]} of the uninterrupted" in text
    assert round_trip_sentence(base, fsdp, back) in text
    dcp_dir = runs / "fsdp" / f"global_step{get('SWITCH_STEP')}"
    assert [r["top-level key"] for r in dcp_rows(dcp_dir)] == ["model", "optimizer", "lr_scheduler", "train_state"]
    cost = json.loads((dcp_dir / "zckpt_manifest.json").read_text())["conversion"]
    assert f"plus {(cost['peak_rss_bytes'] - cost['baseline_rss_bytes']) / 2**20:.1f} MiB, which holds" in text
    answers = [o["data"]["text/markdown"] for c in nb.cells if "answer" in c.metadata.get("tags", [])
               for o in c.outputs if "text/markdown" in o.get("data", {})]
    assert answers == [fsdp_answer(base, fsdp, dcp_dir), switch_answer(base, fsdp, dcp_dir)]
    assert "the same as the uninterrupted run's" in answers[1]


CHECKS = {"01": check_01, "02": check_02, "03": check_03, "04": check_04, "05": check_05, "06": check_06,
          "07": check_07, "08": check_08, "09": check_09, "10": check_10}


def check_verdicts(prefix: str, nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """The notebook's verdict sentences equal the ones its own measurements give."""
    if prefix in CHECKS:
        CHECKS[prefix](nb, runs, parameters)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    nb = run_notebook(path, tmp_path, {})
    check_verdicts(path.name[:2], nb, tmp_path / "runs", {})


@pytest.mark.parametrize("prefix, parameters", MATRIX, ids=[f"{p}-{'-'.join(map(str, v))}" for p, v in MATRIX])
def test_notebook_runs_under_a_learners_parameters(prefix, parameters, tmp_path):
    nb = run_notebook(BY_PREFIX[prefix], tmp_path, parameters)
    check_verdicts(prefix, nb, tmp_path / "runs", parameters)
