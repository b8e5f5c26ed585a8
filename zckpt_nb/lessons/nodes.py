"""Notebook 07: the nodes of one job simulated on this machine, and what each folder holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt_nb.convert.verify import describe_manifest, verify
from zckpt_nb.errors import LaunchError
from zckpt_nb.format.layout import RANK_FILE, latest_name
from zckpt_nb.format.manifest import elsewhere
from zckpt_nb.run.launch import free_port, launch
from zckpt_nb.run.nodes import Nodes


def simulate(dirs: list[str | Path], steps: int, **launch_kw: Any) -> list[Any]:
    """Notebook 07: one launch per folder in `dirs`, as the nodes of one job on this machine (127.0.0.1).

    Returns, per node, its `RunResult`, or the failed launch's `LaunchError`; each launch has its own timeout.
    """
    import threading

    port, results = free_port(), [None] * len(dirs)

    def node(k: int) -> None:
        try:
            results[k] = launch(1, steps, dirs[k], nodes=Nodes(len(dirs), k, master_port=port), **launch_kw)
        except LaunchError as e:
            results[k] = e

    threads = [threading.Thread(target=node, args=(k,)) for k in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def folder_rows(dirs: list[str | Path]) -> list[dict[str, Any]]:
    """Per distinct output folder of a (simulated) multi-node run: what its newest checkpoint holds, and `verify`."""
    rows = []
    for folder in dict.fromkeys(Path(d) for d in dirs):
        tag = latest_name(folder)
        manifest = verify(folder, tag)
        ranks = sorted({int(m.group(1)) for p in (folder / tag).iterdir() if (m := RANK_FILE.search(p.name))})
        rows.append({"folder": folder.name, "latest": tag, "ranks whose files it holds": ", ".join(map(str, ranks)),
                     "files its manifest lists": len(manifest["files"]),
                     "of them on other nodes": len(elsewhere(manifest)), "verify says": describe_manifest(manifest)})
    return rows
