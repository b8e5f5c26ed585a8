"""Notebook 07: the nodes of one job simulated on this machine, and what each folder holds.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from zckpt_nb.convert.verify import verify
from zckpt_nb.format.layout import RANK_FILE, latest_name
from zckpt_nb.lessons.together import together
from zckpt_nb.run.devices import machine, node_placements
from zckpt_nb.run.launch import free_port, launch
from zckpt_nb.run.nodes import Nodes


def simulate(layouts: dict[str, tuple[list[Path], dict[str, Any]]], steps: int,
             **launch_kw: Any) -> dict[str, list[Any]]:
    """Notebook 07: per layout (name -> (one folder per node, its own launch options)), one launch per folder as the
    nodes of one job on this machine (127.0.0.1); every node of every layout started at once (`together`).

    Each node gets its own GPU (`run.devices.node_placements`: every node's rank is LOCAL_RANK 0, so without it all
    would take GPU 0), or all are CPU ranks. Returns, per layout and node, its `RunResult`, or the failed launch's
    `LaunchError`; each launch has its own timeout."""
    ports = {name: free_port() for name in layouts}
    where = {name: node_placements(len(dirs), 1, *machine()) for name, (dirs, _) in layouts.items()}
    calls = {(name, k): partial(launch, 1, steps, folder, nodes=Nodes(len(dirs), k, master_port=ports[name]),
                                placement=where[name][k], **options, **launch_kw)
             for name, (dirs, options) in layouts.items() for k, folder in enumerate(dirs)}
    results = together(calls)
    return {name: [results[name, k] for k in range(len(dirs))] for name, (dirs, _) in layouts.items()}


def folder_rows(dirs: list[str | Path]) -> list[dict[str, Any]]:
    """Per distinct output folder of a (simulated) multi-node run: what its newest checkpoint holds, and `verify`'s
    verdict in short (`verify` raises on any file that fails, so a row means every file here passed)."""
    rows = []
    for folder in dict.fromkeys(Path(d) for d in dirs):
        tag = latest_name(folder)
        manifest = verify(folder, tag)
        ranks = sorted({int(m.group(1)) for p in (folder / tag).iterdir() if (m := RANK_FILE.search(p.name))})
        away = manifest.elsewhere()
        here = len(manifest.files) - len(away)
        rows.append({"folder": folder.name, "latest": tag, "ranks whose files it holds": ", ".join(map(str, ranks)),
                     "files its manifest lists": len(manifest.files), "of them on other nodes": len(away),
                     "verify says": f"ok: the {here} files here match their SHA-256" + (
                         "; the others are checked on their nodes" if away else "")})
    return rows
