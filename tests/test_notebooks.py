"""Every notebook runs top to bottom with its defaults and under a learner's parameters (other N, other settings),
and every check it prints (`course.show.check`) holds.

A verdict printed by a notebook must be the one its own data gives: the tests recompute it from the run's files.
"""

from __future__ import annotations

import itertools
import json
import re
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch

from zckpt_nb.convert.inspect import inspect_checkpoint
from zckpt_nb.convert.safeload import load as safe_load
from zckpt_nb.course.notebooks import execute, failed_checks, notebook_paths
from zckpt_nb.course.panel import probe_dir
from zckpt_nb.course.ranks import lesson_dtype
from zckpt_nb.format.layout import MANIFEST, committed_tags, tag_for
from zckpt_nb.format.manifest import read_manifest, sha256_file
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
    ("04", {"NPROC": 3, "MODEL": "tiny", "DTYPE": "fp32", "PERSISTENCE_THRESHOLD": 100_000,
            "MAX_SHARD_SIZE": "1MB"}),
    ("05", {"KEEP_LAST": 1, "DTYPE": "bf16", "SAVE_EVERY": 3, "STEPS": 12}),  # NPROC = 1 is refused
    ("06", {"NPROC": 3, "PERSISTENCE_THRESHOLD": 100_000, "DTYPE": "bf16", "SAVE_MODES": ["plain", "async"]}),
    ("07", {"SOURCE_NPROC": 3, "TARGET_NPROCS": [2], "DS_NPROC": 2, "STEPS": 10, "RESUME_STEP": 5, "GLOBAL_BATCH": 7,
            "NODES": 3, "NODE_STEPS": 2, "DTYPE": "bf16"}),
    ("08", {"NPROC": 2, "DTYPE": "bf16", "STEPS": 3, "DROP_RANK": 0, "DROP_FILE": "model_states"}),
    ("09", {"CONFIGS": ["llama-3-8b", "gpt2-xl"], "SIZES": [8, 4096], "DTYPE": "fp32", "NODES": 1, "GPUS_PER_NODE": 3,
            "PERSISTENCE_THRESHOLD": 100_000, "PLAN_CONFIG": "gpt2-xl", "WRITE_GBPS": 20.0, "COPY_GBPS": 5.0,
            "FS_CAP_GBPS": 50.0}),
    ("10", {"SOURCE_NPROC": 3, "FSDP_NPROC": 1, "SWITCH_STEP": 4, "STEPS": 12, "DTYPE": "bf16"}),  # 3 ranks pad
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
        f"✓ N = {n}: every rank's slice is Σ⌈k/N⌉ = {predict('tiny', n).slice_numel:,} elements, as predicted: "
        f"{n * predict('tiny', n).slice_numel - predict('tiny', 1).num_params:,} padding elements in all"
        for n in sizes]
    assert sum("held its slice plus the tensors kept whole" in line for line in held) == 2
    for n in sizes:  # what the notebook's worker counted in the live engine: its slice (and nothing whole at 0)
        folder = runs / f"n{n}" / f"threshold_{get['PERSISTENCE_THRESHOLD']}"  # one checkpoint per threshold
        counted = [json.loads((folder / f"rank{r}.json").read_text())["held"] for r in range(n)]
        assert all(h["slice"] == predict("tiny", n).slice_numel for h in counted)
        assert get["PERSISTENCE_THRESHOLD"] or all(h["whole"] == 0 for h in counted)
        memory = [json.loads((folder / f"rank{r}.json").read_text())["memory"] for r in range(n)]  # engine's bytes
        per_element = 16 if lesson_dtype(get["DTYPE"]) == "bf16" else 20  # weights, grads, fp32 master, 2 moments
        assert all(sum(m[k]["bytes"] for k in m) == per_element * predict("tiny", n).slice_numel for m in memory)
    parts = ", ".join(f"N = {n}: {predict('tiny', n).slice_numel:,}" for n in sizes)  # one check, every world size
    assert sum(line.startswith("✓ weights, gradients and fp32 master are Σ⌈k/N⌉") and line.endswith(f"({parts})")
               for line in held) == 1
    for n in sizes:  # the dict save_checkpoint hands torch.save holds the live fp32 master and moments, no copy
        folder = runs / f"n{n}" / f"threshold_{get['PERSISTENCE_THRESHOLD']}"
        same = [json.loads((folder / f"rank{r}.json").read_text())["same storage"] for r in range(n)]
        assert all(s["as returned"] and not s["master vs weights"] for s in same)
    assert any("the live master/moment tensors (same storage)" in line for line in held)
    assert any("same tensor bytes at both thresholds" in line for line in held)
    assert any("both fixes and safeload.load read the same fp32 slice" in line for line in held)  # plain torch.load
    assert any("is the parameters' own slices: Σ p.ds_tensor.numel() elements" in line for line in held)  # measure.py
    prefix = "bf16_" if get["DTYPE"] == "bf16" else ""  # CPU ranks: "auto" is fp32
    assert any(f"every optimizer file is named {prefix}zero_pp_rank_" in line for line in held)
    other = 100_000 if get["OTHER_THRESHOLD"] is None else get["OTHER_THRESHOLD"]  # None: DeepSpeed's default
    thresholds = {get["PERSISTENCE_THRESHOLD"], other}
    gathers = sum(t >= 112 for t in thresholds) if get["THRESHOLD_NPROC"] > 1 else 0  # tiny's smallest tensor: 112
    assert sum("all-gather bytes rank 0 put in" in line for line in held) == gathers  # the comms logger's bytes
    for n in sizes:  # the notebook's own arithmetic against the library's cost model, on the files it wrote
        info = inspect_checkpoint(runs / f"n{n}" / f"threshold_{get['PERSISTENCE_THRESHOLD']}")
        assert {s.partition_numel for s in info.ranks} == {predict("tiny", n).slice_numel}


def check_02(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 02 checked its resume, and the two runs' logs say the same as its checks."""
    get = {**parameter_defaults(BY_PREFIX["02"]), **parameters}
    held = passed_checks(nb)
    assert len([line for line in held if "resume" in line]) == 4, held  # losses, LRs, steps, optimizer tensors
    assert any("holds 12 B of tensors per element of its slice plus Adam's" in line for line in held)  # optimizer files
    assert any(re.search(r"the rest of the file, [\d,]+ B, is the same on every rank", line) for line in held)
    assert get["NPROC"] == 1 or any("rank 0 gave up inside save_checkpoint" in line for line in held)  # bounded
    assert get["NPROC"] == 1 or any("at least one rank timed out" in line for line in held)  # rank-0-only save
    assert any(f"engine.global_steps back to {get['RESUME_STEP']}," in line for line in held)  # DeepSpeed's own count
    loaded = f"load_checkpoint loaded global_step{get['RESUME_STEP']}, not global_step{get['STEPS']}, the tag `latest`"
    assert any(loaded in line for line in held)  # --tag names the middle tag; `latest` names the last
    assert not (runs / "mistakes" / "latest").exists()
    printed = [re.search(r"step (\d+) loss ([\d.e+-]+) lr ([\d.e+-]+)", line) for name in ("minimal", "minimal_resumed")
               for line in (runs / f"{name}.log").read_text().splitlines()]
    full, resumed = {}, {}
    for m in filter(None, printed):
        (resumed if int(m[1]) in full else full)[int(m[1])] = m[2]
    assert sorted(full) == list(range(1, get["STEPS"] + 1))
    assert sorted(resumed) == list(range(get["RESUME_STEP"] + 1, get["STEPS"] + 1))
    assert all(full[s] == resumed[s] for s in resumed)  # CPU ranks: the resume repeats every loss bit for bit
    exercise_2(runs, get, full)
    forget = min(3, get["STEPS"] - get["RESUME_STEP"])  # the steps mistake 2 trains before mistake 3's save
    forgot = [re.search(r"step (\d+) loss ([\d.e+-]+)", line)
              for line in (runs / "mistakes.log").read_text().splitlines()]
    forgot = [m for m in forgot if m and int(m[1]) <= forget]  # mistake 2: the worker resumed again from step 0
    assert len(forgot) == forget
    assert all(m[2] != full[get["RESUME_STEP"] + int(m[1])] for m in forgot)
    trap = [re.search(r"mistake 1: token embedding std [\d.]+, loss ([\d.e+-]+)", line)
            for line in (runs / "mistakes.log").read_text().splitlines()]  # the side model, mistakes launch
    assert float(next(filter(None, trap))[1]) > 2 * float(full[1])  # the bare zero.Init trap starts far above
    info = inspect_checkpoint(runs / "minimal", tag_for(get["STEPS"]))
    assert info.world_size == get["NPROC"] and info.num_params == predict("tiny", 1).num_params


def exercise_2(runs: Path, get: dict, full_losses: dict) -> None:
    """Notebook 02's exercise 2 answer (LOAD_SCHEDULER = False): its worker resumed with --no_scheduler runs step
    RESUME_STEP + j at the uninterrupted run's LR of step j (j >= 2); LRs differ from RESUME_STEP + 2, losses from
    RESUME_STEP + 3."""
    from zckpt_nb.course import runs as course_runs

    steps, resume, dtype = get["STEPS"], get["RESUME_STEP"], "fp32" if get["DTYPE"] == "auto" else get["DTYPE"]
    job = course_runs.run(f"DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node {get['NPROC']} "
                          f"{runs / 'zero3_worker.py'} {runs / 'no_scheduler'} --steps {steps} "
                          f"--load {runs / 'minimal'} --tag global_step{resume} --model {get['MODEL']} --dtype {dtype} "
                          f"--threshold {get['PERSISTENCE_THRESHOLD']} --no_scheduler",
                          timeout=300, log=runs / "no_scheduler.log", echo=False)
    assert any(line.endswith(f"engine.global_steps {resume}") for line in job.said("resumed from"))
    lines = [re.search(r"step (\d+) loss ([\d.e+-]+) lr ([\d.e+-]+)", line)
             for name in ("minimal", "no_scheduler") for line in (runs / f"{name}.log").read_text().splitlines()]
    full_lr, loss, lr = {}, {}, {}
    for m in filter(None, lines):
        if int(m[1]) in full_lr:
            loss[int(m[1])], lr[int(m[1])] = m[2], m[3]
        else:
            full_lr[int(m[1])] = m[3]
    assert sorted(lr) == list(range(resume + 1, steps + 1))
    assert lr[resume + 1] == full_lr[resume + 1]  # the param group's saved lr
    assert all(lr[resume + j] == full_lr[j] for j in range(2, steps - resume + 1))  # index j - 2
    if steps >= resume + 2:
        assert lr[resume + 2] != full_lr[resume + 2] and loss[resume + 2] == full_losses[resume + 2]
    if steps >= resume + 3:
        assert loss[resume + 3] != full_losses[resume + 3]


def check_03(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 03 checked bf16, the frozen saves and the three warm-start loads, on the files it wrote."""
    get = {**parameter_defaults(BY_PREFIX["03"]), **parameters}
    held = passed_checks(nb)
    assert len(held) == 36, held  # 4.3 checks that every rank's loads equal rank 0's; the appendix the bytes
    assert any(f"got {get['LOAD_TAG']}'s weights exactly" in line for line in held)
    assert any("the script line wrote what the function wrote" in line for line in held)  # zero_to_fp32.py, run
    assert any("after it: on every rank every master is a bf16 value" in line for line in held)
    assert any("the recovery, the base model from its files" in line for line in held)
    assert (runs / "base" / "config.json").exists()  # the base model the frozen fine-tuning and the recovery load
    nproc, tag = get["NPROC"], get["LOAD_TAG"]
    loads = [json.loads((runs / "warm" / f"loads_rank{rank}.json").read_text()) for rank in range(nproc)]
    trap = [load["load_optimizer_states=False"] for load in loads]  # its fp32 state dict, then every parameter gathered
    assert all(sorted(m["what"] for m in t["marks"]) == ["fp32_state_dict", "gathered", "masters_read"] for t in trap)
    assert all(m["bytes"] == 4 * predict("tiny", 1).num_params for t in trap for m in t["marks"]
               if m["what"] != "masters_read")  # the masters read: 4 bytes an element of every slice, padding too
    assert all(m["bytes"] >= 4 * predict("tiny", 1).num_params for t in trap for m in t["marks"])
    default = [load["the whole checkpoint"] for load in loads]  # the files the engine opened: its own only
    assert all([f for m in d["marks"] if m["what"] == "own_optimizer_file" for f in m["files"]]
               == [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] for rank, d in enumerate(default))
    counters = json.loads((runs / "warm" / "counters.json").read_text())  # step counter and scheduler, per tag
    assert [counters["tags"][t]["global_steps"] for t in ("older", "newer")] == [get["STEPS"], 2 * get["STEPS"]]
    assert all(load["the whole checkpoint"]["counters"] == counters["tags"][tag] for load in loads)  # the default
    assert all(load["load_module_only=True"]["counters"] == counters["fresh"] for load in loads)
    both = [load["load_module_only=True, load_optimizer_states=False"] for load in loads]  # latest's weights, run
    assert all(b["diff_newer"] == 0 and b["moment"] == 0 and b["counters"] == counters["fresh"] for b in both)
    assert any("the default load: on every rank the step counter and the scheduler are back" in line for line in held)
    started = [load["zero_to_fp32 + from_pretrained"] for load in loads]  # the warm start that works
    assert all(s[f"diff_{tag}"] == 0 and s["moment"] == 0 for s in started)
    assert sorted(p.name for p in (runs / "warm" / f"{tag}_fp32").iterdir()) == ["config.json", "pytorch_model.bin"]
    for name in ("fp32", "bf16", "frozen", "frozen_bf16", "frozen_excluded"):
        assert inspect_checkpoint(runs / name).world_size == get["NPROC"]
    fragments = safe_load(next((runs / "frozen_bf16").glob("*/*rank_0_*model_states.pt")))["frozen_param_fragments"]
    assert fragments and all(t.dtype == torch.bfloat16 for t in fragments.values())  # frozen weights kept in bf16
    assert inspect_checkpoint(runs / "warm", "older").num_params == predict("tiny", 1).num_params


def check_04(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 04 proved its routes and the by-hand folder, then (appendix) the export, its peak measured, and their
    reloads; the folders hold the masters."""
    from safetensors.torch import load_file

    held = passed_checks(nb)
    assert len(held) == 19, held  # section 5 prints model bytes, no check; the appendix checks adopt and the export
    assert any("equal the working weights: every route holds the weights it should" in line for line in held)
    assert any("zero_to_fp32.py's files are the split printed above, tensor for tensor" in line for line in held)
    assert any("routes 1, 2 and 3 (script) and by hand: the reloaded logits equal" in line for line in held)
    assert any("the export: reloaded without DeepSpeed, its logits equal the engine's" in line for line in held)
    assert (runs / "run" / "route_1" / "config.json").exists() and (runs / "run" / "route_2" / "config.json").exists()
    assert sum("the ranks logged exactly the predicted collective bytes" in line for line in held) == 2
    kept_whole = [int(m[1].replace(",", "")) for line in held if (m := re.search(r"W = ([\d,]+) elements kept", line))]
    assert len(kept_whole) == 2 and all(w > 0 for w in kept_whole), held  # the formulas' W term is tested
    assert json.loads((runs / "run_flag_off.json").read_text()) == {"returned": False, "files": []}
    assert (runs / "run" / "config.json").exists() and (runs / "route_3_script" / "config.json").exists()
    dtype = {**parameter_defaults(BY_PREFIX["04"]), **parameters}["DTYPE"]
    assert any(f"in {dtype}, the masters and the working weights are" in line for line in held)
    exported = {k: v for f in (runs / "export").glob("*.safetensors") for k, v in load_file(f).items()}
    masters = safe_load(runs / "route_3_function" / "pytorch_model.bin")
    assert exported and all(torch.equal(exported[k], masters[k]) for k in exported)
    by_hand = {k: v for f in (runs / "by_hand").glob("*.safetensors") for k, v in load_file(f).items()}
    assert by_hand.keys() == exported.keys() and all(torch.equal(by_hand[k], masters[k]) for k in by_hand)
    text = "\n".join(o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")
    peaks = re.search(r"peak resident memory: the export ([\d,.]+) MiB; a process that only imports its libraries "
                      r"([\d,.]+) MiB", text)  # the appendix's measurement (peak.py), printed
    assert peaks and float(peaks[1].replace(",", "")) >= float(peaks[2].replace(",", "")) > 50, text[-2000:]


def check_05(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 05 checked its hand-written commit, its hang, its two killed saves, its manifest and its resume
    through a full disk; the files agree."""
    get = {**parameter_defaults(BY_PREFIX["05"]), **parameters}
    held = passed_checks(nb)
    assert len(held) == 34, held  # 33, and KeepErrors on /dev/full (appendix)
    step1 = runs / "first_job" / "mine" / "global_step1"
    mine = json.loads((step1 / "manifest.json").read_text())["files"]
    assert sorted(f["path"] for f in mine) == sorted(p.name for p in step1.iterdir() if p.name != "manifest.json")
    for f in mine:  # the hand-written commit's manifest: each file's rank, size and SHA-256 as on disk
        assert f"zero_pp_rank_{f['rank']}_" in f["path"] and (step1 / f["path"]).stat().st_size == f["bytes"], f
        assert sha256_file(step1 / f["path"]) == f["sha256"], f
    assert len(mine) == 2 * get["NPROC"]
    assert (runs / "first_job" / "mine" / "latest").read_text() == "global_step1"  # global_step2 failed on one rank
    assert not (runs / "first_job" / "mine" / "global_step2" / "manifest.json").exists()
    assert (runs / "commit" / "latest").read_text().strip() == tag_for(get["SAVE_EVERY"])  # the save before the crash
    resumed = [json.loads(line) for rank in range(get["NPROC"])  # the resume job's records, rank by rank
               for line in (runs / f"resume_rank{rank}.jsonl").read_text().splitlines()]
    assert any(r["rank"] == get["NPROC"] - 1 and r.get("deepspeed_resume", "").startswith("FileNotFoundError")
               for r in resumed)  # DeepSpeed's load_checkpoint followed `latest` first
    exits = {r["rank"]: r["exited"] for r in resumed if "exited" in r}  # then every rank agreed, and stopped
    assert sorted(exits) == list(range(get["NPROC"])) and len(set(exits.values())) == 1, exits
    assert f"rank {get['NPROC'] - 1}: FileNotFoundError" in exits[0], exits
    failed = [r for r in resumed if r.get("save") and not r["committed"]]  # the save the disk could not hold
    assert sorted(r["rank"] for r in failed) == list(range(get["NPROC"]))
    assert len({json.dumps(r["errors"]) for r in failed}) == 1, failed  # every rank's errors, alike on every rank
    if any("neighbour_came" in r for r in resumed):  # the tmpfs (root): room for one rank's files, not all
        assert not any(r["preflight"] for r in failed) and "needed together" in failed[0]["errors"][0], failed
    else:  # no root: a file blocks the folder; the preflight passes and DeepSpeed's makedirs fails
        assert all(r["preflight"] for r in failed), failed
    kills = [r for mode in ("plain", "commit") for r in (json.loads(line) for line in  # the victim's last records
             (runs / f"{mode}_rank{get['NPROC'] - 1}.jsonl").read_text().splitlines()) if "killed_in" in r]
    assert [r["killed_in"] for r in kills] == [tag_for(2 * get["SAVE_EVERY"])] * 2, kills
    for killed, tags in (("manifest", ["global_step1"]), ("latest", ["global_step1", "global_step3"])):
        folder = runs / f"mine_killed_before_{killed}"  # the hand-written commit, killed -9 in its step 3
        assert (folder / "latest").read_text() == "global_step1"
        assert sorted(p.parent.name for p in folder.glob("*/manifest.json")) == tags
    kept = sorted((p.parent.name for p in (runs / "resumed").glob("*/manifest.json")), key=lambda t: int(t[11:]))
    assert len(kept) == min(get["KEEP_LAST"], get["STEPS"] // get["SAVE_EVERY"] - 1)  # 2 x SAVE_EVERY: the full disk
    assert kept[-1] == tag_for(get["STEPS"]) and not (runs / "resumed" / tag_for(2 * get["SAVE_EVERY"])).exists()
    rotated = [tag for r in resumed if r.get("committed") and "deleted" in r for tag in r["deleted"]]
    assert rotated and not any((runs / "resumed" / tag).exists() for tag in rotated), rotated


def check_06(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 06 timed every save of every mode on every rank, in the dtype it resolved, after one save per mode
    kept apart; its tie table calls each pair of modes as the exact test on those timings does, at 5% over the number
    of pairs (Bonferroni); DeepSpeed's decoupled writer was timed in a launch of its own, waiting once per save in its
    commit, in turn with plain, both with CRC-32 on, and called against plain as the same test does at 5%; no launch
    on N + 1 ranks (more ranks than cores would time the sharing of the cores)."""
    get = {**parameter_defaults(BY_PREFIX["06"]), **parameters}.get
    n, modes, dtype = get("NPROC"), get("SAVE_MODES"), lesson_dtype(get("DTYPE"))
    folder = probe_dir(runs, get("MODEL"), dtype, get("PERSISTENCE_THRESHOLD"), n)

    def read(where: Path, name: str) -> list[dict]:
        return [r for rank in range(n) for r in json.loads((where / f"{name}_rank{rank}.json").read_text())]

    records, first = read(folder, "timings"), read(folder, "first_saves")
    assert sorted((r["mode"], r["repeat"], r["rank"]) for r in records) == sorted(
        (m, i, rank) for m in modes for i in range(get("REPEATS")) for rank in range(n))
    assert sorted((r["mode"], r["rank"]) for r in first) == sorted((m, rank) for m in modes for rank in range(n))
    text = "\n".join(o.get("data", {}).get("text/plain", "") or o.get("text", "") for c in nb.cells
                     if c.cell_type == "code" for o in c.outputs)  # tables and printed lines
    pairs = list(itertools.combinations(modes, 2))

    def slowest(rows: list[dict], mode: str) -> list[float]:
        return [max(r["call_s"] + r["wait_s"] for r in rows if (r["mode"], r["repeat"]) == (mode, i))
                for i in range(get("REPEATS"))]

    def exact(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
        """The exact test's score (pairs xs wins), an even split's, and the share of splits as far from even."""
        wins = sum((x < y) + 0.5 * (x == y) for x in xs for y in ys)
        pooled, even = xs + ys, len(xs) * len(ys) / 2
        splits = list(itertools.combinations(range(len(pooled)), len(xs)))
        as_far = sum(abs(sum((pooled[i] < pooled[j]) + 0.5 * (pooled[i] == pooled[j]) for i in chosen
                             for j in range(len(pooled)) if j not in chosen) - even) >= abs(wins - even)
                     for chosen in splits)
        return wins, even, as_far / len(splits)

    for a, b in pairs:
        xs, ys = slowest(records, a), slowest(records, b)
        wins, even, p = exact(xs, ys)
        called = p < 0.05 / len(pairs)
        verdict = "tie" if not called else f"{a if wins > even else b} faster"
        assert re.search(rf"{a}\s+{b}\s+\S+\s+{wins:g} of {len(xs) * len(ys)}\s+\S+\s+{verdict}", text), \
            (a, b, wins, verdict)
    for r in records:  # the probe's timers inside each save call: nested, so none negative and no more than the call
        parts = [r["timings"].get(k, 0) for k in ("preflight", "deepspeed", "files", "after")]
        assert min(parts) >= 0 and sum(parts) <= r["call_s"] + 1e-6, r
        if r["mode"] == "async":  # the by-hand thread's two phases, after the call
            assert r["committed"] and r["timings"]["thread_files"] > 0 and r["timings"]["thread_commit"] > 0, r
    if "async" in modes:  # the by-hand commit's manifest, in the tag `latest` names
        assert (folder / "async" / (folder / "async" / "latest").read_text() / "manifest.json").is_file()
    if "plain" in modes and len(modes) > 1:  # commit leaves the package's wrapper on DeepSpeed's engine: the last
        # plain save (after every other mode's) must still get torch.save(path), not the writer's file object
        last = max((folder / "plain").glob("global_step*"), key=lambda p: int(p.name[len("global_step"):]))
        shard = next(last.glob("*zero_pp_rank_0_*optim_states.pt"))
        assert zipfile.ZipFile(shard).namelist()[0].split("/")[0] == shard.stem, shard
    held = json.loads((folder / "held_rank0.json").read_text())  # the persistence threshold's tensors kept whole
    assert (held["persistent_tensors"] > 0) == (get("PERSISTENCE_THRESHOLD") > 0) and held["owned"] >= held[
        "elements"] / n
    decoupled = read(folder / "deepspeed_decoupled", "timings")  # section 5: decoupled and plain in turn, one launch
    assert sorted((r["mode"], r["repeat"], r["rank"]) for r in decoupled) == sorted(
        (m, i, rank) for m in ("decoupled", "plain") for i in range(get("REPEATS")) for rank in range(n))
    # one wait in the writer's commit per decoupled save, none after a plain one; neither fsyncs
    assert all(r["durable_s"] is None and r["commits"] == (r["mode"] == "decoupled") for r in decoupled)
    for mode in ("decoupled", "plain"):  # CRC-32 on for both: every zip record of their optimizer files carries one
        crcs = [z.CRC for f in (folder / "deepspeed_decoupled" / mode).glob("global_step*/*optim_states.pt")
                for z in zipfile.ZipFile(f).infolist()]
        assert crcs and all(crcs), mode
    wins, even, p = exact(slowest(decoupled, "decoupled"), slowest(decoupled, "plain"))
    verdict = f"{'decoupled' if wins > even else 'plain'} faster" if p < 0.05 else "a tie"
    assert re.search(rf"decoupled's stall the shorter in {wins:g} of {2 * even:g} pairs, chance .*: {verdict} at 5%",
                     text), (wins, verdict)
    side = min(get("REPEATS"), 3)  # the package's async saves beside async's by hand: at most 3 repeats
    packaged = read(folder, "packaged")  # zckpt_nb.save(mode="async"), after each async save by hand: side repeats
    timed = sorted((r["repeat"], r["rank"]) for r in packaged if r["repeat"] is not None)
    if "async" in modes:  # and its first save, kept apart; every one committed, the newest with its manifest
        assert sum(r["repeat"] is None for r in packaged) == n and all(r["committed"] for r in packaged)
        assert timed == [(i, rank) for i in range(side) for rank in range(n)], timed
        for r in packaged:  # its call cut by the same wrappers as commit's: all four parts, nested in the call
            parts = [r["timings"][k] for k in ("preflight", "deepspeed", "files", "after")]
            assert min(parts) >= 0 and sum(parts) <= r["call_s"] + 1e-6, r
        assert (folder / "packaged_async" / (folder / "packaged_async" / "latest").read_text() / MANIFEST).is_file()
    else:
        assert not packaged
    assert not probe_dir(runs, get("MODEL"), dtype, get("PERSISTENCE_THRESHOLD"), n + 1).exists()  # no N + 1 launch


def check_07(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 07's checks, recomputed from the files and logs its runs left: DeepSpeed's engine.load_checkpoint
    refused the checkpoint as saved on another world size (loaded it on the saving one), both converters wrote the
    same bytes, every resumed run (the package's and DeepSpeed's alone) stayed within its dtype's tolerance, each
    node's folder held its own rank's files (the same without the flag), and a resume without tag= loaded on node 0
    alone while one with tag= matched the uninterrupted run."""
    get = {**parameter_defaults(BY_PREFIX["07"]), **parameters}.get
    held, source, nodes = passed_checks(nb), get("SOURCE_NPROC"), get("NODES")
    assert not markdown_outputs(nb)  # every finding is printed by code in a cell
    dtype, tag = lesson_dtype(get("DTYPE")), tag_for(get("RESUME_STEP"))
    base = RunResult.from_dir(runs / "uninterrupted", [], 0.0)
    assert (base.world_size, base.dtype, base.global_batch) == (source, dtype, get("GLOBAL_BATCH") or 16)

    ds_world, log = get("DS_NPROC"), (runs / "resume_deepspeed.log").read_text().splitlines()
    said = [line for line in log if line.startswith("as saved, rank ")]  # engine.load_checkpoint on the save itself
    refuse = ds_world != source
    assert len(said) == ds_world and all((" raised " in line) == refuse for line in said)
    assert not refuse or any("used a DP world size of" in line for line in said)
    assert any(line.startswith("✓ DeepSpeed's batch check refuses train_batch_size") for line in held)
    assert any(line.startswith(f"✓ DeepSpeed's loader {'refused' if refuse else 'loaded'} the checkpoint as saved")
               for line in held)

    ds_copy = runs / "ds_universal" / tag
    assert (runs / "ds_universal" / "latest_universal").read_text().strip() == tag  # ds_to_universal's pointer
    flags = dict(re.findall(r"^(as saved|universal): engine.load_universal_checkpoint\(\) (\w+)", "\n".join(log), re.M))
    assert flags == {"as saved": "False", "universal": "True"}  # what each engine made of its config
    returned = Path(re.search(r"^universal: .* load_checkpoint returned (\S+);", "\n".join(log), re.M)[1])
    assert returned.parent.resolve() == ds_copy.resolve()  # without tag=: the tag latest_universal names
    assert any(line.startswith("✓ its engines read it: load_universal_checkpoint() False") for line in held)
    for n in get("TARGET_NPROCS"):  # train --resume converted by itself on another world size: DeepSpeed's bytes
        if n != source:
            assert not (runs / f"resumed_on_{n}" / "universal" / "latest_universal").exists()  # it passes tag=
            ours = read_manifest(runs / f"resumed_on_{n}" / "universal" / tag)
            assert all(sha256_file(ds_copy / e.path) == e.sha256 for e in ours.files)
            assert len(ours.files) == sum(p.is_file() for p in ds_copy.rglob("*"))
            assert any(line.startswith(f"✓ N = {n}: every file of the package's copy has DeepSpeed's bytes")
                       for line in held)

    full = {s + 1: loss for s, loss in zip(base.steps, base.losses)}  # the notebook's numbering: from 1
    wanted = list(range(get("RESUME_STEP") + 1, get("STEPS") + 1))
    resumed = {}
    for n in get("TARGET_NPROCS"):
        run = RunResult.from_dir(runs / f"resumed_on_{n}", [], 0.0)
        assert run.world_size == n and run.global_batch == base.global_batch
        assert run.ds_config["checkpoint"]["load_universal"] == (n != source)
        assert (run.resharded is not None and not run.resharded["reused"]) == (n != source)  # converted, not reused
        resumed[n] = {s + 1: loss for s, loss in zip(run.steps, run.losses)}
    printed = (re.search(r"^step (\d+) loss (\S+)$", line)
               for line in (runs / "resume_deepspeed.log").read_text().splitlines())
    resumed["deepspeed"] = {int(m[1]): float(m[2]) for m in printed if m}
    assert all(sorted(losses) == wanted for losses in resumed.values())
    worst = max(abs(losses[s] - full[s]) for losses in resumed.values() for s in wanted)
    tolerance = {"fp32": 1e-4, "bf16": 0.05}[dtype]
    assert worst <= tolerance
    assert (f"✓ every resumed loss is within {tolerance:.1e} of the uninterrupted run's ({dtype}): the same "
            f"optimisation  (largest difference {worst:.1e})") in held
    printed = (re.search(r"^control step (\d+) loss (\S+)$", line)
               for line in (runs / "resume_deepspeed.log").read_text().splitlines())
    control = {int(m[1]): float(m[2]) for m in printed if m}  # the negative control: weights only, same launch
    assert sorted(control) == wanted
    first = abs(control[wanted[0]] - full[wanted[0]])  # before the control's first update
    off = max(abs(control[s] - full[s]) for s in wanted[1:])  # after it
    assert first <= tolerance < off and any(line.startswith(f"✓ the negative control fails the same test after its "
                                                         f"first update: the warm start (load_module_only=True) is "
                                                         f"up to {off:.1e} off from step {wanted[1]} on")
                                            for line in held)
    assert any(line.startswith("✓ every rank's piece cut by hand equals what DeepSpeed's loader gave it")
               for line in held)

    half = get("NODE_STEPS") // 2  # section 6: DeepSpeed alone saves after step `half` into each node's folder
    assert len(list(runs.glob("node[0-9]*"))) == nodes

    def listing(folder: Path) -> list[str]:
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    for k in range(nodes):
        folder = runs / f"node{k}"
        names = [p.name for p in (folder / tag_for(half)).glob("*.pt")]
        assert len(names) == 2 and all(f"rank_{k}_" in name for name in names)
        assert (folder / "latest").is_file() == (folder / "zero_to_fp32.py").is_file() == (k == 0)
        assert (folder / "zero_to_torch.py").is_file() == (k == 0)  # _copy_recovery_script writes both scripts
        assert listing(folder) == listing(runs / f"noflag{k}")  # without the flag: the same files
        text = (runs / f"flag{k}.log").read_text()
        returned = re.search(rf"node {k} rank {k}: no tag= load_checkpoint returned (\S+)", text)[1]
        assert (returned == "None") == (k > 0)
        found = {label: dict(re.findall(rf"node {k} rank {k}: {re.escape(label)} step (\d+) loss (\S+)", text))
                 for label in ("uninterrupted", "no tag=", "tag=")}
        after = [str(s) for s in range(half + 1, get("NODE_STEPS") + 1)]
        assert all(float(found["tag="][s]) == float(found["uninterrupted"][s]) for s in after)
        assert all(float(found["no tag="][s]) != float(found["uninterrupted"][s]) for s in after)
    others = ", ".join(map(str, range(1, nodes)))
    assert any(line.startswith(f"✓ without tag=, node 0 alone loaded (node {others} got None)") for line in held)
    assert any(line.startswith("✓ DeepSpeed's reader rebuilt all P = ") for line in held)


def check_08(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 08's checks, recomputed from the files and logs its runs left: each rank's slice, the copy with a file
    dropped, every export against DeepSpeed's own fp32 reconstruction, Trainer's and accelerate's resumes."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file, save

    get = {**parameter_defaults(BY_PREFIX["08"]), **parameters}.get
    nproc, steps, tag, held = get("NPROC"), get("STEPS"), tag_for(get("STEPS")), passed_checks(nb)
    assert not markdown_outputs(nb)  # every finding is printed by code in a cell
    assert len(held) == 57, held
    assert any(line.startswith("✓ use_cpu=True set up a multi-CPU PartialState on gloo; Trainer's Accelerator then ran "
                               "DeepSpeed ZeRO-3 (distributed_type DEEPSPEED: cpu did not reach it)")
               for line in held)  # use_cpu: not the Accelerator's
    assert any(line.startswith("✓ a missing model-states file: adopt refuses, naming rank 1's model states; "
                               "DeepSpeed's reader returns every tensor") for line in held)
    lines = (runs / "raw.log").read_text()  # the own loop: trained, saved after STEPS, resumed in the same launch
    trained, resumed = ({(r, s): x for r, s, *x in re.findall(rf"rank (\d+): {what} step (\d+) loss (\S+) lr (\S+)",
                                                              lines)} for what in ("trained", "resumed"))
    assert sorted(resumed) == sorted((str(r), str(s)) for r in range(nproc) for s in (steps + 1, steps + 2))
    assert all(trained[key] == got for key, got in resumed.items())  # the repr of each loss and LR, every digit
    assert sorted(re.findall(r"rank (\d+): resumed at step (\d+)", lines)) == [(str(r), str(steps))
                                                                                for r in range(nproc)]
    assert "✓ every resumed loss and LR equals the uninterrupted run's" in held
    control = {(r, s): x for r, s, x in re.findall(r"rank (\d+): control step (\d+) loss (\S+)", lines)}
    assert sorted(control) == sorted(resumed) and not all(trained[key][0] == loss for key, loss in control.items())
    assert any(line.startswith("✓ the control fails the same test: resumed from the save one step older")
               for line in held)
    plain_trained, plain_resumed = ({(r, s): x for r, s, *x in re.findall(  # Plain, a plain nn.Module, resumed
        rf"rank (\d+): plain {what} step (\d+) loss (\S+) lr (\S+)", lines)} for what in ("trained", "resumed"))
    assert sorted(plain_resumed) == sorted(resumed)
    assert all(plain_trained[key] == got for key, got in plain_resumed.items())
    plain_control = {(r, s): x for r, s, x in re.findall(r"rank (\d+): plain control step (\d+) loss (\S+)", lines)}
    assert sorted(plain_control) == sorted(resumed)  # Plain's control: its save one step older, the same steps
    assert not all(plain_trained[key][0] == loss for key, loss in plain_control.items())
    assert any(line.startswith("✓ Plain's control fails the same test: resumed from its save one step older")
               for line in held)
    assert any(line.startswith("✓ in every folder the rank files outweigh everything else in it together")
               for line in held)  # section 5's plot: the caption's ratios, checked above it
    assert sorted(p.name for p in (runs / "raw_plain" / tag).glob("*.pt")) == sorted(
        p.name for p in (runs / "raw" / tag).glob("*.pt"))  # the same two files per rank
    shapes = safe_load(next((runs / "raw" / tag).glob("*rank_0_*model_states.pt")))["param_shapes"]
    predicted = sum(-(-s.numel() // nproc) for group in shapes for s in group.values())
    slices = [sum(t.numel() for t in safe_load(p)["optimizer_state_dict"]["fp32_flat_groups"])
              for p in (runs / "raw" / tag).glob("*optim_states.pt")]
    assert len(slices) == nproc and set(slices) == {predicted}
    assert f"✓ every rank holds Σ⌈k/N⌉ = {predicted:,} fp32 master elements, as predicted from the config" in held
    padding = sum(-(-s.numel() // nproc) * nproc - s.numel() for group in shapes for s in group.values())
    assert any(line.startswith(f"✓ the {nproc} slices together hold the P = ")
               and f"plus the padding, {padding:,} elements" in line for line in held)
    dropped, kind = list(range(nproc))[get("DROP_RANK")], get("DROP_FILE")
    broken = runs / "broken" / tag
    assert [r for r in range(nproc) if not list(broken.glob(f"*rank_{r}_*{kind}.pt"))] == [dropped]
    assert not (broken / "zckpt_manifest.json").exists()
    gone = [p.name for p in (runs / "raw" / tag).glob("*.pt") if not (broken / p.name).exists()]
    assert len(gone) == 1 and f"rank_{dropped}_" in gone[0] and gone[0].endswith(f"{kind}.pt")
    assert (f"✓ adopt raised CheckpointError naming rank {dropped}'s {kind.split('_')[0]} states, and wrote no "
            f"manifest; the copy lacks one file of the checkpoint's, {gone[0]}") in held
    assert f"✓ by hand, the broken copy is refused, naming rank {dropped}'s {kind.split('_')[0]} states" in held
    assert any(line.startswith("✓ by hand, the checkpoint passes, and every rank file's SHA-256 equals")
               for line in held)
    flipped = next((runs / "raw_flipped" / tag).glob("*optim_states.pt"))  # one bit flipped: torch.load still reads it
    with zipfile.ZipFile(flipped) as archive:
        assert "/data/" in archive.testzip()  # its CRC-32 names the damaged tensor record
    with zipfile.ZipFile(runs / "raw" / tag / flipped.name) as archive:
        assert archive.testzip() is None

    def exact(export_dir: Path, ckpt_dir: Path, ckpt_tag: str) -> int:
        exported = {k: v for f in export_dir.glob("*.safetensors") for k, v in load_file(f).items()}
        masters = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=ckpt_tag)
        assert set(exported) == set(masters) and all(torch.equal(exported[k], masters[k]) for k in masters)
        return len(masters)

    n = exact(runs / "hf", runs / "raw", tag)
    assert exact(runs / "zero_to_fp32", runs / "raw", tag) == n  # what DeepSpeed's zero_to_fp32.py wrote
    assert any(line.startswith(f"✓ own loop's export: {n} of {n} tensors") for line in held)
    n = exact(runs / "trainer_hf", runs / "trainer" / f"checkpoint-{steps + 2}", tag_for(steps + 2))
    assert any(line.startswith(f"✓ Trainer's final/ exported: {n} of {n} tensors") for line in held)
    assert any(line.startswith("✓ gather on: save_model wrote whole weights in " + ("bfloat16" if get("DTYPE") == "bf16"
                                                                                   else "float32")) for line in held)
    masters = get_fp32_state_dict_from_zero_checkpoint(str(runs / "trainer" / f"checkpoint-{steps + 2}"),
                                                       tag=tag_for(steps + 2))
    dtype = torch.bfloat16 if get("DTYPE") == "bf16" else torch.float32  # "auto": fp32 on CPU ranks
    assert save({k: v.to(dtype) for k, v in masters.items()}, metadata={"format": "pt"}) == (
        runs / "trainer_resumed" / "final" / "model.safetensors").read_bytes()  # the gathered file: the masters, as is
    assert any(line.startswith("✓ model.safetensors is, byte for byte, the uninterrupted run's masters in ")
               for line in held)
    assert "✓ the resumed run fed the uninterrupted run's batches at every step after the save" in held
    assert "✓ frozen, fewer than N² elements: the join raises nothing and returns wrong values" in held
    n = exact(runs / "accelerate_hf", runs / "accelerate", "pytorch_model")
    assert any(line.startswith(f"✓ accelerate's export: {n} of {n} tensors") for line in held)

    def logged(run: str) -> dict:
        state = json.loads((runs / run / f"checkpoint-{steps + 2}" / "trainer_state.json").read_text())
        return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}

    full, log = logged("trainer"), (runs / "trainer.log").read_text()  # resumed and control: in the same launch
    assert re.search(r"use_cpu True: TrainingArguments set up PartialState MULTI_CPU \(backend gloo, .*Trainer's "
                     r"Accelerator: distributed_type DEEPSPEED, backend gloo, ZeRO stage 3, model wrapped in "
                     r"DeepSpeedEngine", log)  # use_cpu reaches the PartialState only: Trainer still runs DeepSpeed
    found = {run: json.loads(re.search(rf"{run} logged losses (.*)$", log, re.M)[1]) for run in ("resumed", "control")}
    resumed, control = ({int(s): x for s, x in found[run].items()} for run in ("resumed", "control"))
    assert all(full[s] == resumed[s] for s in (steps + 1, steps + 2))  # CPU ranks: bit for bit
    assert not all(full[s] == control[s] for s in (steps + 1, steps + 2))  # the batches replayed: not the same
    assert "✓ every resumed loss equals the uninterrupted run's" in held
    assert any(line.startswith("✓ the control fails the same test: resumed without skipping") for line in held)
    drawn = {run: {int(s): x for s, x in json.loads(re.search(rf"{run} draws (.*)$", log, re.M)[1]).items()}
             for run in ("uninterrupted", "resumed", "control")}  # rank 0's torch.rand(1) before each step
    past = (steps + 1, steps + 2)
    assert [drawn["resumed"][s] for s in past] == [drawn["uninterrupted"][s] for s in past] != [
        drawn["uninterrupted"][s] for s in (1, 2)]  # the generator as saved after the skip, not as seeded
    generator = torch.Generator()
    generator.set_state(safe_load(runs / "trainer" / f"checkpoint-{steps}" / "rng_state_0.pth")["cpu"])
    torch.empty((), dtype=torch.int64).random_(generator=generator)  # the control: restored, then the base seed drawn
    assert [drawn["control"][s] for s in past] == [torch.rand(1, generator=generator).item() for _ in past]
    assert any(line.startswith("✓ the resumed run drew what the uninterrupted run drew at steps") for line in held)
    assert any(line.startswith("✓ the control's draws are the saved generator's after one int64") for line in held)
    fed = {run: {int(s): h for s, h in json.loads(re.search(rf"{run} batches (.*)$", log, re.M)[1]).items()}
           for run in ("uninterrupted", "control")}  # rank 0's SHA-256 of each step's input_ids
    state = json.loads((runs / "trainer" / f"checkpoint-{steps + 2}" / "trainer_state.json").read_text())
    per_epoch = round(1 / state["log_history"][0]["epoch"])  # step 1 logs epoch 1 / (steps per epoch)
    start = steps // per_epoch * per_epoch  # the steps before the epoch the save falls in
    assert [fed["control"][s] for s in past] == [fed["uninterrupted"][start + j] for j in (1, 2)]  # the epoch replayed
    assert any(line.startswith("✓ the control trained the epoch's first batches again") for line in held)
    names = [p.name for p in (runs / "trainer" / f"checkpoint-{steps}" / tag).glob("*optim_states.pt")]
    assert len(names) == nproc and all(n.startswith("bf16_") == (lesson_dtype(get("DTYPE")) == "bf16") for n in names)

    def printed(log: str, what: str) -> dict:
        found = re.findall(rf"rank (\d+): {what} step (\d+) loss (\S+) lr (\S+)", (runs / log).read_text())
        return {(int(r), int(s)): (loss, lr) for r, s, loss, lr in found}

    before, after = printed("accelerate.log", "trained"), printed("accelerate_resumed.log", "resumed")
    control = printed("accelerate_resumed.log", "control")  # load_state, then set_seed: the same LRs, other batches
    assert sorted(after) == sorted(control) == [(r, s) for r in range(nproc) for s in (steps + 1, steps + 2)]
    assert all(before[key] == value for key, value in after.items())
    assert all(before[key][1] == lr for key, (_, lr) in control.items())
    assert not all(before[key][0] == loss for key, (loss, _) in control.items())
    assert "✓ every resumed loss and LR equals the uninterrupted run's" in held
    assert any(line.startswith("✓ the control's LRs equal them too") for line in held)
    assert sorted(p.name for p in (runs / "accelerate").glob("random_states_*.pkl")) == [
        f"random_states_{r}.pkl" for r in range(nproc)]
    shared = {e.path: e for e in read_manifest(runs / "accelerate" / "pytorch_model").shared}
    assert all(shared[f"random_states_{r}.pkl"].rank == r and shared[f"random_states_{r}.pkl"].sha256 == sha256_file(
        runs / "accelerate" / f"random_states_{r}.pkl") for r in range(nproc))  # adopt listed accelerate's files
    changed = runs / "accelerate_tampered" / f"random_states_{nproc - 1}.pkl"
    assert sha256_file(changed) != shared[changed.name].sha256
    assert "✓ verify refused the copy, naming the changed RNG file" in held
    assert ("✓ by hand, the same verdict: the changed RNG file's SHA-256, and only its, differs from the manifest's "
            "entry") in held  # hashlib against the manifest read with json
    one = runs / "one_rng"  # section 6: accelerate's folder with the no-backend RNG file alone
    assert [p.name for p in one.glob("random_states_*.pkl")] == ["random_states_0.pkl"]
    assert not (one / "pytorch_model" / "zckpt_manifest.json").exists() and nproc > 1
    assert any(line.startswith("✓ adopt refused a folder with one RNG file for ") for line in held)
    batches = set()
    for r in range(nproc):  # the no-backend processes: each its own torch.distributed rank, accelerate's process 0
        found = re.search(rf"RANK={r}: distributed_type DEEPSPEED, accelerate backend None, process_index 0 of "
                          rf"num_processes 1; torch.distributed rank {r} of {nproc} \(gloo\);.* first batch (\[.*?\]); "
                          r"prepared DataLoader\(range\(6\)\) gives (\[.*\])",
                          (runs / f"no_backend_{r}.log").read_text())
        batches.add(found[1])
        assert json.loads(found[2]) == list(range(6))  # num_processes 1: the prepared DataLoader is not split
    assert len(batches) == 1  # set_seed(0, device_specific=True) seeded every process alike: the same batch
    assert [p.name for p in (runs / "no_backend").iterdir()] == ["random_states_0.pkl"]


def stream_text(nb: nbformat.NotebookNode) -> str:
    """Everything the code cells printed."""
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "stream")


def check_09(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 09 checks every config it counts, and its chosen interval is Young's for the rates it planned with."""
    text, get = stream_text(nb), {**parameter_defaults(BY_PREFIX["09"]), **parameters}.get
    assert text.count("✓") >= len(get("CONFIGS")) + 3
    assert "✓ plan's write, read and network seconds are these bytes over rates" in text
    assert f"✓ all {get('SAVE_REPEATS')} timed saves were committed when their call returned" in text
    assert f"files / predicted over {get('SAVE_REPEATS')} saves: median " in text  # each save's files over its probe
    assert "✓ every save of the loop committed, one tag per save" in text  # the loop ran on a one-rank engine
    assert "✓ the process group holds the timeout given to init_distributed" in text
    assert "✓ async loses less exactly when copy / write exceeds 1 / (1 - sqrt(C / 2M))^2" in text
    assert "✓ the plan's choice here is section 5's" in text  # one verdict from the plan's rates, not two
    assert "✓ at each end, async loses less exactly when its copy / write exceeds its own crossover" in text
    assert "measured here: both ends" in text or "measured here: the two ends pick different modes" in text
    assert "; choose " in text.split("lost with this machine's ratio x ")[1].splitlines()[0]  # with the ratio's margin
    assert "✓ each tag's files are predict(\"tiny\", 1, " in text  # the cost model against the loop's real files
    assert f"✓ engine.global_steps after the load is the tag's step, {get('LOOP_SAVE_EVERY')}" in text
    if get("LOOP_STEPS") > get("LOOP_SAVE_EVERY"):  # the loop's steps after the first tag, trained again from it
        assert (f"✓ resumed from global_step{get('LOOP_SAVE_EVERY')}, steps {get('LOOP_SAVE_EVERY') + 1} to "
                f"{get('LOOP_STEPS')}: every loss and learning rate equals the loop's, bit for bit") in text
    if get("WRITE_GBPS") and get("COPY_GBPS"):  # the rates given, not measured: the same figures here as there
        n = get("NODES") * get("GPUS_PER_NODE")
        bw = Bandwidths(get("WRITE_GBPS"), get("WRITE_GBPS"), get("NET_GBPS"))
        part = next(r for r in plan(get("PLAN_CONFIG"), n, bw, get("DTYPE"), get("PERSISTENCE_THRESHOLD"),
                                    fs_cap_gbps=get("FS_CAP_GBPS")) if r.route == "partitioned")
        mtbf = job_mtbf_seconds(get("GPU_INTERRUPTION_HOURS"), n)
        shared = min(get("WRITE_GBPS"), get("FS_CAP_GBPS") / n)  # each rank's write while all n write, under the cap
        modes = {"commit": (part.stall_s, 0.0), "async": (part.written_bytes / (get("COPY_GBPS") * 1e9),
                                                         part.written_bytes / (shared * 1e9))}
        lost = {m: lost_fraction(optimal_interval(c, mtbf), c, mtbf, lag=lag, restart=get("RESTART_S"))
                for m, (c, lag) in modes.items()}
        chosen = min(lost, key=lambda m: lost[m].total)
        minutes = lost[chosen].interval / 60  # the notebook's sig3: three significant figures
        shown = f"{minutes:#.3g}".rstrip(".") if minutes < 1000 else f"{minutes:,.0f}"
        assert f"choose {chosen}, saving every {shown} min of training" in text
        assert f'zckpt_nb.save(engine, save_dir, mode="{chosen}")' in text  # the loop saves the way the plan chose


def check_10(nb: nbformat.NotebookNode, runs: Path, parameters: dict) -> None:
    """Notebook 10's checks held, and its runs' files say the same: each leg's losses and learning rates against the
    uninterrupted run's, what each DCP folder's `.metadata` lists, what the loading script found on its ranks, and
    from-dcp's files against the FSDP2 save they came from."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    get = {**parameter_defaults(BY_PREFIX["10"]), **parameters}.get
    switch, dtype, held = get("SWITCH_STEP"), lesson_dtype(get("DTYPE")), passed_checks(nb)
    assert len(held) == 34, held
    assert any(line.startswith(f"✓ a crash inside commit, after dcp.save wrote .metadata, leaves no crash/"
                               f"{tag_for(switch)}, no staging folder and no zckpt_manifest.json")
               for line in held)  # the appendix: to_dcp with commit raising, in the notebook's process
    assert not (runs / "crash").exists()  # nothing of that output, not even the folder made for it
    assert any(line.startswith("✓ DeepSpeed's skipped_steps line raises KeyError on a model-states file without")
               for line in held)  # section 7: a key _load_checkpoint reads by subscript, shown missing
    assert any("LambdaLR (the preset's lr" in line and "gives DeepSpeed's learning rate, bit for bit" in line
               for line in held)  # fsdp_leg.py's gamma against WarmupDecayLR at every scheduler step
    assert any(line.startswith("✓ so the job would train step 1 at learning rate 0 from zero moments")
               for line in held)  # exercise 3: allow_partial_load from the weights-only folder, run
    assert any(line.startswith("✓ rebuilt by hand, every parameter's fp32 weights, exp_avg and exp_avg_sq equal "
                               "to-dcp's") for line in held)
    def said(log: str) -> list[dict]:
        """Rank 0's JSON lines in a notebook script's log: where it resumed, then one per step (numbered from 1)."""
        return [json.loads(line) for line in (runs / log).read_text().splitlines() if line.startswith("{")]

    head, *source = said("zero3.log")  # the notebook's own ZeRO-3 script: its set-up, then one line per step
    fsdp, back_job = said("fsdp.log"), said("back.log")  # the back job loads from-dcp's, by hand's, the control's
    back, by_hand, control = ([r for r in back_job if r["folder"] == str(runs / f)]
                              for f in ("back/universal", "by_hand", "control/universal"))
    assert [(r["step"], r["loss"], r["lr"]) for r in by_hand[1:]] == [(r["step"], r["loss"], r["lr"]) for r in back[1:]]
    assert (head["world"], fsdp[0]["world"], back[0]["world"]) == (get("SOURCE_NPROC"), get("FSDP_NPROC"),
                                                                   get("BACK_NPROC"))
    assert head["dtype"] == fsdp[0]["dtype"] == back[0]["dtype"] == dtype
    assert [r["step"] for r in source] == list(range(1, get("STEPS") + 1))
    assert committed_tags(runs / "zero3") == [tag_for(s) for s in range(switch, get("STEPS") + 1, switch)]
    tolerance = {"fp32": 1e-4, "bf16": 0.05}[dtype]
    losses, lrs = {r["step"] - 1: r["loss"] for r in source}, {r["step"] - 1: r["lr"] for r in source}
    kept, zeroed, fsdp_control = ([r for r in fsdp[1:] if r["run"] == m] for m in ("kept", "zeroed", "control"))
    assert fsdp[0]["resumed"] == fsdp[0]["adam step"] == switch
    for leg, first, end in ((kept, switch, 2 * switch), (back[1:], 2 * switch, get("STEPS"))):
        assert [r["step"] - 1 for r in leg] == list(range(first, end))
        assert all(r["lr"] == lrs[r["step"] - 1] for r in leg)
        assert max(abs(r["loss"] - losses[r["step"] - 1]) for r in leg) <= tolerance
    # Adam's moments zeroed on the way in: the first loss as the kept run's, bit for bit, every later one different
    assert [r["step"] for r in zeroed] == [r["step"] for r in kept] and zeroed[0]["loss"] == kept[0]["loss"]
    assert all(z["loss"] != k["loss"] for z, k in zip(zeroed[1:], kept[1:]))
    kept_worst = max(abs(r["loss"] - losses[r["step"] - 1]) for r in kept)  # section 8: the zeroed run's gaps
    assert min(abs(r["loss"] - losses[r["step"] - 1]) for r in zeroed[1:]) > 100 * kept_worst  # over 100 x the kept's
    assert any(line.startswith(f"✓ from step {switch + 2} on, every gap of the zeroed run exceeds 100 x the kept run's "
                               "largest") for line in held)
    # the FSDP2 leg's control, in the same launch: to-dcp's folder with wte's halves swapped, the same steps
    assert [(r["step"], r["lr"]) for r in fsdp_control] == [(r["step"], r["lr"]) for r in kept]
    off = max(abs(r["loss"] - losses[r["step"] - 1]) for r in fsdp_control)
    assert off > tolerance and any(line.startswith(f"✓ the FSDP2 leg's control fails the same test: with one tensor "
                                                   f"garbled, a loss lies {off:.1e}") for line in held)
    assert back[0]["step"] == 2 * switch and back[0]["checkpoint"]["load_universal"]  # engine.load_checkpoint's
    assert sum(f"every loss within {tolerance:g} of the uninterrupted run's" in line for line in held) == 2

    def listed(folder: Path) -> tuple[list[str], set]:
        """A DCP folder's top-level keys and tensor dtypes, from its `.metadata`."""
        meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        return (list(dict.fromkeys(name.split(".")[0] for name in meta)),
                {m.properties.dtype for m in meta.values() if isinstance(m, TensorStorageMetadata)})

    dcp_dir = runs / "fsdp" / tag_for(switch)
    assert listed(dcp_dir) == (["model", "optimizer", "lr_scheduler", "train_state"], {torch.float32})
    assert listed(runs / "plain_dcp") == (["model"], {torch.float32})
    assert listed(runs / "fsdp" / tag_for(2 * switch))[1] == {torch.float32}  # FSDP2's own save: fp32 masters
    manifest = json.loads((dcp_dir / "zckpt_manifest.json").read_text())
    assert manifest["step"] == switch and manifest["source_world_size"] == get("SOURCE_NPROC")
    loaded = [json.loads(line) for line in (runs / "load_dcp.log").read_text().splitlines() if line.startswith("{")]
    assert [r["model + optimizer"] == "loaded" for r in loaded] == [True, False, True]  # to-dcp, weights, by hand
    assert all(r["equal"] == r["compared"] for r in loaded) and loaded[0]["adam steps"] == [switch]
    assert all(len(r["elements per rank"]) == get("FSDP_NPROC") and sum(r["elements per rank"]) == head["parameters"]
               for r in loaded)  # each rank held its shard alone
    assert (f"✓ its AdamW has taken {switch} steps (Adam's step {switch}), with moments that are not zero: its next "
            f"step is {switch + 1}") in held

    import torch.distributed.checkpoint as dcp

    saved = runs / "fsdp" / tag_for(2 * switch)  # FSDP2's save, against what from-dcp made of it
    meta = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    whole = {n: torch.empty(m.size, dtype=m.properties.dtype) for n, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(whole, checkpoint_id=saved, no_dist=True)
    zero = runs / "back" / "universal" / tag_for(2 * switch) / "zero"
    params = sorted(p.name for p in zero.iterdir() if p.is_dir())
    assert params == sorted({n.removeprefix("optimizer.state.").rsplit(".", 1)[0] for n in whole
                             if n.startswith("optimizer.state.")})
    for p in params:
        for kind, key in (("fp32", f"model.{p}"), ("exp_avg", f"optimizer.state.{p}.exp_avg"),
                          ("exp_avg_sq", f"optimizer.state.{p}.exp_avg_sq")):
            assert torch.equal(torch.load(zero / p / f"{kind}.pt", weights_only=True), whole[key].flatten()), (p, kind)
    state = torch.load(zero / "optimizer_state.pt", weights_only=True)["optimizer_state_dict"]["state"][0]
    assert int(state["step"]) == 2 * switch == back[0]["step"]
    assert any(line.startswith("✓ each one's fp32.pt, exp_avg.pt and exp_avg_sq.pt equal the ones written by hand")
               for line in held)
    # the control: the same switch back with wte's halves swapped
    assert [(r["step"], r["lr"]) for r in control[1:]] == [(r["step"], r["lr"]) for r in back[1:]]
    off = max(abs(r["loss"] - losses[r["step"] - 1]) for r in control[1:])
    assert off > tolerance and any(line.startswith(f"✓ the way back's control fails the same test: with one tensor "
                                                   f"garbled, a loss lies {off:.1e}") for line in held)


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
