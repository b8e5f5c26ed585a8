"""Notebook 10: leaving and joining DeepSpeed, a ZeRO-3 run through PyTorch DCP (FSDP2) and back, measured and said."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from zckpt_nb.convert.dcp import largest_state_bytes
from zckpt_nb.course.trace import trace_command
from zckpt_nb.errors import UsageError
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.format.units import counted, secs
from zckpt_nb.lessons.claims import RESUME_TOLERANCE

DEFAULT_FSDP_NPROC = 3  # notebook 10's defaults, which its exercises' answers compare against
DEFAULT_SWITCH_STEP = 6


def check_plan(steps: int, switch: int, dtype: str) -> None:
    """Refuse, in one line, a plan with no room for two legs after the switch, or a dtype the workers lack."""
    if not 0 < switch or 2 * switch >= steps:
        raise UsageError(f"SWITCH_STEP = {switch} with STEPS = {steps}: need 0 < SWITCH_STEP and 2 x SWITCH_STEP < "
                         "STEPS (ZeRO-3 to the switch, FSDP2 for SWITCH_STEP steps, ZeRO-3 again to STEPS)")
    if dtype not in RESUME_TOLERANCE:
        raise UsageError(f"DTYPE = {dtype!r}: set DTYPE = 'auto', 'fp32' or 'bf16'")


def tolerance(run: Any) -> tuple[float, str]:
    """The loss-gap bound a run's dtype can meet (claims.RESUME_TOLERANCE), and how the sentences write it."""
    bound = RESUME_TOLERANCE[run.data.get("dtype", "fp32")]
    return bound, f"{bound:.0e}".replace("e-0", "e-")


def dcp_rows(dcp_dir: str | Path) -> list[dict[str, Any]]:
    """Per top-level key of a DCP checkpoint (read from its `.metadata` only): entries, tensors, MiB, an example."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rows: dict[str, dict[str, Any]] = {}
    for fqn, meta in FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items():
        key, _, rest = fqn.partition(".")
        row = rows.setdefault(key, {"top-level key": key, "entries": 0, "tensors": 0, "MiB": 0.0,
                                    "example entry": rest})
        row["entries"] += 1
        if isinstance(meta, TensorStorageMetadata):
            row["tensors"] += 1
            row["MiB"] += meta.size.numel() * meta.properties.dtype.itemsize / 2**20
    return [{**r, "MiB": f"{r['MiB']:.2f}"} for r in rows.values()]  # one format per column, 0 as 0.00


def traced(command: list[str], timeout: float) -> Any:
    """Run `command` traced from outside (time and the kernel's peak RSS); a failure raises with its last line."""
    trace = trace_command(command, timeout=timeout)
    if trace.returncode:
        raise RuntimeError(f"{command[1:3]} exited with {trace.returncode}: {trace.output.strip().splitlines()[-1:]}")
    return trace


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def convert_both(ckpt: str | Path, tag: str, dcp_out: str | Path, fp32_out: str | Path,
                 timeout: float = 600) -> dict[str, Any]:
    """`zero_to_fp32.py` and `python -m zckpt_nb to-dcp` on checkpoint `tag`, each its own process, as users run
    them; each one's seconds and peak RSS, and the to-dcp manifest (its stages' costs)."""
    fp32 = traced([sys.executable, str(Path(ckpt) / "zero_to_fp32.py"), str(ckpt), str(fp32_out), "--tag", tag],
                  timeout)
    to_dcp = traced([sys.executable, "-m", "zckpt_nb", "to-dcp", str(ckpt), str(dcp_out), "--tag", tag], timeout)
    return {"zero_to_fp32": {"seconds": fp32.wall, "peak_rss_bytes": fp32.peak_bytes,
                             "bytes": folder_bytes(Path(fp32_out))},
            "to_dcp": {"seconds": to_dcp.wall, "peak_rss_bytes": to_dcp.peak_bytes},
            "manifest": read_manifest(dcp_out), "bound_bytes": 2 * largest_state_bytes(ckpt, tag)}


def tensor_dtypes(dcp_dir: str | Path, keys: tuple[str, ...] = ("model", "optimizer")) -> set[Any]:
    """The dtypes of a DCP checkpoint's tensors under top-level `keys` (Adam's `step` counters left out), read from
    its `.metadata` alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items()
    return {m.properties.dtype for fqn, m in entries if isinstance(m, TensorStorageMetadata)
            and fqn.split(".")[0] in keys and not fqn.endswith(".step")}


def stage_seconds(costs: dict[str, Any]) -> dict[str, float]:
    """The seconds of to-dcp's measured stages, from the manifest's conversion fields (new keys ignored): the
    universal copy when this command made it, the DCP writer, and the wait for the rank files' hash check."""
    c = costs["manifest"].conversion
    made = via_universal(costs) and not c.get("universal", {}).get("reused", False)
    return {"ds_to_universal": c.get("universal", {}).get("seconds", 0.0) if made else 0.0, "DCP writer": c["seconds"],
            "hash check wait": c.get("check_wait_seconds", 0.0)}


def startup_seconds(costs: dict[str, Any]) -> float:
    """The whole to-dcp command's wall time less its measured stages: process start-up and imports (torch,
    DeepSpeed, transformers), which nothing inside the process can time."""
    return max(0.0, costs["to_dcp"]["seconds"] - sum(stage_seconds(costs).values()))


def time_compared(costs: dict[str, Any]) -> str:
    """to-dcp's whole command against zero_to_fp32.py, each timed once: within 10% is a tie, not a ranking."""
    mine, theirs = costs["to_dcp"]["seconds"], costs["zero_to_fp32"]["seconds"]
    told = f"{secs(mine)} s against zero_to_fp32.py's {secs(theirs)} s"
    if abs(mine / theirs - 1) <= 0.1:
        return f"about the time of zero_to_fp32.py ({told}, one run each: a tie)"
    return f"{mine / theirs:.2f}x the time of zero_to_fp32.py ({told})"


def time_summary(costs: dict[str, Any]) -> str:
    """The two whole commands' seconds and how much of to-dcp's was start-up and imports, for a summary line."""
    return (f"`to-dcp`'s whole command took {secs(costs['to_dcp']['seconds'])} s ({secs(startup_seconds(costs))} s "
            f"of it process start-up and imports); `zero_to_fp32.py` took {secs(costs['zero_to_fp32']['seconds'])} s, "
            "start-up included")


def time_made_of(costs: dict[str, Any]) -> str:
    """What the two times are made of: start-up and imports against bytes, and where the bytes would dominate."""
    mine, written = costs["to_dcp"]["seconds"], costs["manifest"].conversion["bytes"]
    ratio = written / costs["zero_to_fp32"]["bytes"]
    return (f"Of to-dcp's {secs(mine)} s, {secs(startup_seconds(costs))} s lay outside its timed stages: process "
            "start-up and imports, which zero_to_fp32.py, a process of its own, pays too. The bytes are another "
            f"matter: to-dcp wrote {ratio:.1f}x zero_to_fp32.py's bytes (both moments besides the weights) and made "
            "them durable (fsync), so on a model large enough for the bytes to dominate it takes longer; docs/dcp.md "
            "measures both on `large`.")


def via_universal(costs: dict[str, Any]) -> bool:
    """Whether to-dcp read the universal copy (made or reused) rather than the rank files themselves."""
    return costs["manifest"].conversion.get("route", "universal copy") == "universal copy"


def cost_rows(costs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per route or stage: what it keeps, seconds, peak RSS of its own process, bytes written."""
    c, mib = costs["manifest"].conversion, 2**20
    uni, everything = c["universal"], "weights, both moments, step, LR, data position"
    fp32 = costs["zero_to_fp32"]
    rows = [{"route": "zero_to_fp32.py", "keeps": "fp32 weights", "time (s)": secs(fp32["seconds"]),
             "peak RSS (MiB)": round(fp32["peak_rss_bytes"] / mib), "written (MiB)": f"{fp32['bytes'] / mib:.2f}"}]
    if via_universal(costs):
        rows.append({"route": "to-dcp, stage 1: ds_to_universal" + (" (reused)" if uni["reused"] else ""),
                     "keeps": "weights, both moments", "time (s)": secs(uni["seconds"]),
                     "peak RSS (MiB)": round(uni["peak_rss_bytes"] / mib),
                     "written (MiB)": f"{uni['bytes'] / mib:.2f}"})
    source = "stage 2: DCP writer" if via_universal(costs) else "DCP writer, reading the rank files"
    rows.append({"route": f"to-dcp, {source}", "keeps": everything, "time (s)": secs(c["seconds"]),
                 "peak RSS (MiB)": round(c["peak_rss_bytes"] / mib), "written (MiB)": f"{c['bytes'] / mib:.2f}"})
    rows.append({"route": "to-dcp, start-up and imports (whole minus stages)", "keeps": "-",
                 "time (s)": secs(startup_seconds(costs)), "peak RSS (MiB)": "-", "written (MiB)": "-"})
    rows.append({"route": "to-dcp, the whole command", "keeps": everything,
                 "time (s)": secs(costs["to_dcp"]["seconds"]),
                 "peak RSS (MiB)": round(costs["to_dcp"]["peak_rss_bytes"] / mib),
                 "written (MiB)": f"{c['bytes'] / mib:.2f}"})
    return rows


def peak_sentence(costs: dict[str, Any], num_params: int) -> str:
    """What the DCP writer's peak is made of: its baseline, one parameter's state at a time, and fixed costs; and
    where its bound (2x the largest parameter's fp32 state) is checked when this run is too small to show it."""
    c, mib = costs["manifest"].conversion, 2**20
    extra, bound, full = c["peak_rss_bytes"] - c["baseline_rss_bytes"], costs["bound_bytes"], 12 * num_params
    made_of = (f"The DCP writer's peak ({c['peak_rss_bytes'] / mib:.0f} MiB) is its process's baseline "
               f"({c['baseline_rss_bytes'] / mib:.0f} MiB: the process with torch loaded and its source opened, "
               "before the first tensor) plus "
               f"{extra / mib:.1f} MiB, which holds one parameter's state at a time (the largest: "
               f"{bound / 2 / mib:.1f} MiB of fp32 weights and moments; the bound is twice it, {bound / mib:.1f} "
               "MiB) and costs that do not grow with the model (DCP's save plan, its write buffers, and freed "
               "blocks the allocator keeps instead of handing back). ")
    if extra <= bound:
        return made_of + f"It stayed within the bound, far below the full fp32 state's {full / mib:.1f} MiB."
    return (made_of + f"Here the model is so small that those fixed costs exceed the bound and even the full fp32 "
            f"state ({full / mib:.1f} MiB, P x 12 bytes), so this run cannot show that the writer never holds the "
            "whole state; docs/dcp.md checks the bound on the `large` preset (`benchmarks/dcp_convert.py`), where "
            "one parameter's state outweighs them.")


def principle_sentence(costs: dict[str, Any], num_params: int) -> str:
    """The principle's "full P on rank 0, all-gather + conversion" for a cross-framework export, against the run."""
    c, mib = costs["manifest"].conversion, 2**20
    stage1 = (f" Stage 1 (ds_to_universal) peaked at {c['universal']['peak_rss_bytes'] / mib:.0f} MiB in its own "
              "process." if via_universal(costs) and not c["universal"]["reused"] else "")
    ranks = f"the {costs['manifest'].source_world_size} ranks' files"
    source = f"the universal copy made from {ranks}" if via_universal(costs) else f"{ranks} directly"
    shown = (" (the peak above)" if c["peak_rss_bytes"] - c["baseline_rss_bytes"] <= costs["bound_bytes"]
             else " by design (docs/dcp.md measures it on `large`)")
    return (f"The principle says a cross-framework export needs the full P on rank 0 and an all-gather followed by a "
            f"format conversion. That is imprecise: no all-gather runs. to-dcp is one process with no process group, "
            f"reading {source} after training, one parameter at a time, so what it holds is bounded by the largest "
            f"parameter's state plus fixed costs, not by P{shown}.{stage1} The whole command "
            f"took {time_compared(costs)}, and kept the moments that zero_to_fp32.py drops. {time_made_of(costs)}")


def leg_gaps(base: Any, leg: Any) -> list[float]:
    """|the leg's loss - the uninterrupted run's| at each step the leg trained."""
    by_step = dict(zip(base.steps, base.losses))
    return [abs(loss - by_step[s]) for s, loss in zip(leg.steps, leg.losses)]


def gap_curves(base: Any, legs: dict[str, Any], floor: float = 1e-9) -> dict[str, tuple[list[int], list[float]]]:
    """Per leg, its steps and |loss gap|, raised to `floor` so that an exact match still shows on a log scale."""
    return {name: (list(leg.steps), [max(g, floor) for g in leg_gaps(base, leg)]) for name, leg in legs.items()}


def leg_sentence(base: Any, leg: Any, what: str, reference: str | None = None) -> str:
    """One switch: how far the leg's loss stayed from the uninterrupted run (`reference`: how the sentence names
    it, by default in full), within the bound its dtype can meet."""
    gaps, (bound, told) = leg_gaps(base, leg), tolerance(base)
    inside = "within" if max(gaps) <= bound else "NOT within"
    first = "equal to the bit" if gaps[0] == 0 else f"{gaps[0]:.1e} off"
    named = reference or f"the uninterrupted ZeRO-3 run on {counted(base.world_size, 'rank')}"
    return (f"{what} on {counted(leg.world_size, 'rank')} trained steps {leg.steps[0]} to {leg.steps[-1]} and its loss "
            f"stayed {inside} {told} of {named}: largest gap {max(gaps):.1e} over {len(gaps)} steps, the first step "
            f"{first}")


def round_trip_sentence(base: Any, fsdp: Any, back: Any) -> str:
    """Both switches, and what the remaining differences are."""
    worst = max(max(leg_gaps(base, fsdp)), max(leg_gaps(base, back)))
    dtype = base.data.get("dtype", "fp32")
    why = ("Nothing differs: every loss equal to the bit." if worst == 0 else
           "What remains is float summation order, not lost state: the global batch split over another number of "
           "ranks (other matmul shapes), gradients reduced by FSDP2's reduce-scatter instead of DeepSpeed's, and "
           "the clipping factor computed as a multiplication by 1/(norm + 1e-6) instead of a division"
           + (". In bf16 every such difference is rounded to bf16's 8 significant bits in the forward and backward "
              "passes (both frameworks keep fp32 masters), hence the bound of "
              f"{tolerance(base)[1]} instead of fp32's 1e-4." if dtype == "bf16" else "."))
    return (f"{leg_sentence(base, fsdp, 'FSDP2')}. "
            f"{leg_sentence(base, back, 'ZeRO-3 after from-dcp', 'the uninterrupted run, too')}. {why}")


def gaps_summary(base: Any, fsdp: Any, back: Any) -> str:
    """One line: the largest loss gap of each leg, and whether both stayed within the bound."""
    a, b = max(leg_gaps(base, fsdp)), max(leg_gaps(base, back))
    bound, told = tolerance(base)
    both = "both within" if max(a, b) <= bound else "NOT both within"
    return (f"In {base.data.get('dtype', 'fp32')}, the largest loss gaps from the uninterrupted run were {a:.1e} for "
            f"FSDP2 on {counted(fsdp.world_size, 'rank')} and {b:.1e} for ZeRO-3 on {counted(back.world_size, 'rank')} "
            "after from-dcp, "
            f"{both} {told} (section 5)")


def fsdp_answer(base: Any, fsdp: Any, dcp_dir: str | Path, default: int = DEFAULT_FSDP_NPROC) -> str:
    """Exercise: the same DCP files loaded on another number of FSDP2 ranks, against the default's."""
    files, n = len(read_manifest(dcp_dir).files), fsdp.world_size
    gap, (bound, told) = max(leg_gaps(base, fsdp)), tolerance(base)
    share = "all" if n == 1 else f"about {base.num_params / n:,.0f}"
    than = ("" if n == default else f" (against {base.num_params / default:,.0f} on the default {default} ranks)")
    alt = 1 if default > 1 else 2
    other_share = "all" if alt == 1 else f"about {base.num_params / alt:,.0f}"
    return (f"No second conversion: FSDP2 on {counted(n, 'rank')} loaded the very {files} files to-dcp wrote once, by "
            f"one process with whole tensors; `dcp.load` cut each tensor into {counted(n, 'shard')}, so each rank "
            f"held {share} of the {base.num_params:,} parameters with their moments{than}. The leg's largest loss "
            f"gap was {gap:.1e}, {'within' if gap <= bound else 'NOT within'} {told}"
            + (f", the gap of section 5. These are the defaults; with FSDP_NPROC = {alt}, the same {files} files "
               f"would load again with no second conversion, each rank holding {other_share} of the parameters: "
               "set it to measure the loss gap." if n == default else f"; compare it with section 5's on the "
               f"default {default} ranks: the number of ranks changes only the order of float additions."))


def switch_answer(base: Any, fsdp: Any, dcp_dir: str | Path, default: int = DEFAULT_SWITCH_STEP) -> str:
    """Exercise: where the switch is, the step and learning rate carried over, against the default switch's."""
    step, lr, lrs = read_manifest(dcp_dir).step, fsdp.data["lrs"][0], base.data["lrs"]
    same = "the same as" if math.isclose(lr, lrs[step], rel_tol=1e-9) else "NOT the same as"
    other = (f" Leaving at the default step {default}, it would have been {lrs[default]:.3e}: the learning rate "
             "crossed over is the schedule's own at the switch step, wherever that is."
             if step != default and default < len(lrs) else "")
    return (f"The DCP checkpoint holds step {step}, so Adam's bias correction continues from it. FSDP2's first step "
            f"was step {fsdp.steps[0]}, trained with learning rate {lr:.3e}, {same} the uninterrupted run's at that "
            f"step.{other}" + (at_other(lrs, max(1, default - 2)) if step == default else ""))


def at_other(lrs: list[float], other: int) -> str:
    """At the default switch: what exercise 2's `SWITCH_STEP = other` would carry over, read from the uninterrupted
    run's logged learning rates (the schedule is the same run's, so no second run is needed to say it)."""
    if other >= len(lrs):
        return f" These are the defaults: set SWITCH_STEP = {other} to compare."
    return (f" These are the defaults. With SWITCH_STEP = {other}, the checkpoint would hold step {other} and "
            f"FSDP2's first step, step {other}, should train with the uninterrupted run's learning rate at that "
            f"step, {lrs[other]:.3e}: set it to check.")
