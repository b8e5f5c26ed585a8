"""Notebook 10: leaving and joining DeepSpeed, a ZeRO-3 run through PyTorch DCP (FSDP2) and back, measured and said."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from zckpt_nb.convert.dcp import largest_state_bytes
from zckpt_nb.errors import UsageError
from zckpt_nb.format.manifest import read_manifest
from zckpt_nb.measure.trace import trace_command

TOLERANCE = 1e-4  # issue 26's bound on the loss gap after each switch (written "1e-4" in the sentences)


def check_plan(steps: int, switch: int, dtype: str) -> None:
    """Refuse, in one line, a plan with no room for two legs after the switch, or a dtype the FSDP2 worker lacks."""
    if not 0 < switch or 2 * switch >= steps:
        raise UsageError(f"SWITCH_STEP = {switch} with STEPS = {steps}: need 0 < SWITCH_STEP and 2 x SWITCH_STEP < "
                         "STEPS (ZeRO-3 to the switch, FSDP2 for SWITCH_STEP steps, ZeRO-3 again to STEPS)")
    if dtype != "fp32":
        raise UsageError(f"DTYPE = {dtype!r}: the FSDP2 worker trains in fp32 only; set DTYPE = 'fp32'")


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


def cost_rows(costs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per route or stage: what it keeps, seconds, peak RSS of its own process, bytes written."""
    c, mib = costs["manifest"]["conversion"], 2**20
    uni = c["universal"]
    return [
        {"route": "zero_to_fp32.py", "keeps": "fp32 weights", "time (s)": f"{costs['zero_to_fp32']['seconds']:.1f}",
         "peak RSS (MiB)": round(costs["zero_to_fp32"]["peak_rss_bytes"] / mib),
         "written (MiB)": f"{costs['zero_to_fp32']['bytes'] / mib:.2f}"},
        {"route": "to-dcp, stage 1: ds_to_universal" + (" (reused)" if uni["reused"] else ""),
         "keeps": "weights, both moments", "time (s)": f"{uni['seconds']:.1f}",
         "peak RSS (MiB)": round(uni["peak_rss_bytes"] / mib), "written (MiB)": f"{uni['bytes'] / mib:.2f}"},
        {"route": "to-dcp, stage 2: DCP writer", "keeps": "weights, both moments, step, LR, data position",
         "time (s)": f"{c['seconds']:.1f}", "peak RSS (MiB)": round(c["peak_rss_bytes"] / mib),
         "written (MiB)": f"{c['bytes'] / mib:.2f}"},
        {"route": "to-dcp, the whole command", "keeps": "weights, both moments, step, LR, data position",
         "time (s)": f"{costs['to_dcp']['seconds']:.1f}", "peak RSS (MiB)": round(costs["to_dcp"]["peak_rss_bytes"]
                                                                                  / mib),
         "written (MiB)": f"{c['bytes'] / mib:.2f}"},
    ]


def principle_sentence(costs: dict[str, Any], num_params: int) -> str:
    """The principle's "full P on rank 0, all-gather + conversion" for a cross-framework export, against the run."""
    c, mib = costs["manifest"]["conversion"], 2**20
    extra, bound, full = c["peak_rss_bytes"] - c["baseline_rss_bytes"], costs["bound_bytes"], 12 * num_params
    ratio = costs["to_dcp"]["seconds"] / costs["zero_to_fp32"]["seconds"]
    return (f"The principle says a cross-framework export needs the full P on rank 0 and an all-gather followed by a "
            f"format conversion. Here no all-gather ran: to-dcp is one process with no process group, reading the "
            f"{costs['manifest']['source_world_size']} ranks' files after training, one parameter at a time. Its DCP "
            f"writer rose {extra / mib:.1f} MiB above its baseline against the full fp32 state's {full / mib:.1f} MiB "
            f"(P x 12 bytes) and the bound of {bound / mib:.1f} MiB (2x the largest parameter's fp32 weights and "
            + ("moments): within it, so it never held the full P. " if extra <= bound else
               "moments): over it. On a checkpoint this small the writer's fixed allocations (DCP's plan and write "
               "buffers) outweigh one parameter's state, so this run cannot show the bound; "
               "`benchmarks/dcp_convert.py` measures the bound on larger models (docs/dcp.md). ")
            + f"Stage 1 (ds_to_universal) peaked at "
            f"{c['universal']['peak_rss_bytes'] / mib:.0f} MiB in its own process. The whole command took "
            f"{ratio:.2f}x the time of zero_to_fp32.py, which keeps the weights only.")


def leg_gaps(base: Any, leg: Any) -> list[float]:
    """|the leg's loss - the uninterrupted run's| at each step the leg trained."""
    by_step = dict(zip(base.steps, base.losses))
    return [abs(loss - by_step[s]) for s, loss in zip(leg.steps, leg.losses)]


def gap_curves(base: Any, legs: dict[str, Any], floor: float = 1e-9) -> dict[str, tuple[list[int], list[float]]]:
    """Per leg, its steps and |loss gap|, raised to `floor` so that an exact match still shows on a log scale."""
    return {name: (list(leg.steps), [max(g, floor) for g in leg_gaps(base, leg)]) for name, leg in legs.items()}


def leg_sentence(base: Any, leg: Any, what: str) -> str:
    """One switch: how far the leg's loss stayed from the uninterrupted run, and over how many steps."""
    gaps = leg_gaps(base, leg)
    inside = "within" if max(gaps) <= TOLERANCE else "NOT within"
    first = "equal to the bit" if gaps[0] == 0 else f"{gaps[0]:.1e} off"
    return (f"{what} on {leg.world_size} rank(s) trained steps {leg.steps[0]} to {leg.steps[-1]} and its loss stayed "
            f"{inside} 1e-4 of the uninterrupted ZeRO-3 run on {base.world_size} rank(s): largest gap "
            f"{max(gaps):.1e} over {len(gaps)} steps, the first step {first}")


def round_trip_sentence(base: Any, fsdp: Any, back: Any) -> str:
    """Both switches, and what the remaining differences are."""
    worst = max(max(leg_gaps(base, fsdp)), max(leg_gaps(base, back)))
    why = ("Nothing differs: every loss equal to the bit." if worst == 0 else
           "What remains is float summation order, not lost state: the global batch split over another number of "
           "ranks (other matmul shapes), gradients reduced by FSDP2's reduce-scatter instead of DeepSpeed's, and "
           "the clipping factor computed as a multiplication by 1/(norm + 1e-6) instead of a division.")
    return (f"{leg_sentence(base, fsdp, 'FSDP2')}. {leg_sentence(base, back, 'ZeRO-3 after from-dcp')}. {why}")


def gaps_summary(base: Any, fsdp: Any, back: Any) -> str:
    """One line: the largest loss gap of each leg, and whether both stayed within the bound."""
    a, b = max(leg_gaps(base, fsdp)), max(leg_gaps(base, back))
    both = "both within" if max(a, b) <= TOLERANCE else "NOT both within"
    return (f"The largest loss gaps from the uninterrupted run were {a:.1e} for FSDP2 on {fsdp.world_size} rank(s) "
            f"and {b:.1e} for ZeRO-3 on {back.world_size} rank(s) after from-dcp, {both} 1e-4")


def fsdp_answer(base: Any, fsdp: Any, dcp_dir: str | Path) -> str:
    """Exercise: the same DCP files loaded on another number of FSDP2 ranks."""
    files = len(read_manifest(dcp_dir)["files"])
    return (f"The DCP checkpoint (the same {files} files, written once by one process with full tensors) was "
            f"resharded by `dcp.load` onto {fsdp.world_size} FSDP2 rank(s). {leg_sentence(base, fsdp, 'FSDP2')}.")


def switch_answer(base: Any, fsdp: Any, dcp_dir: str | Path) -> str:
    """Exercise: where the switch is, the step, learning rate and data position carried over."""
    manifest = read_manifest(dcp_dir)
    step, lr = manifest["step"], fsdp.data["lrs"][0]
    same = "the same as" if math.isclose(lr, base.data["lrs"][step], rel_tol=1e-9) else "NOT the same as"
    return (f"The DCP checkpoint holds step {step} (Adam's bias correction continues from it). FSDP2's first step was "
            f"step {fsdp.steps[0]}, trained with learning rate {lr:.3e}, {same} the uninterrupted run's at that step. "
            f"{leg_sentence(base, fsdp, 'FSDP2')}.")
