"""Several nodes, inside the ranks: does every rank see the output folder its storage layout needs?

Shared: every node mounts one `--output_dir`, rank 0 writes the manifest and `latest`. Node-local
(`--node_local_storage`, DeepSpeed's `use_node_local_storage`): each node's local rank 0 writes its own manifest (the
whole checkpoint, and which node holds which file) and `latest`. Before training every rank looks for the probe files
each node's local rank 0 wrote (`check_layout`), and a layout that does not match is refused in one line.
"""

from __future__ import annotations

import os
import secrets
import socket
from contextlib import suppress
from pathlib import Path
from typing import Any

from zckpt_nb.errors import LayoutError
from zckpt_nb.format.layout import committed_tags, node_rank, tag_step, writes_folder
from zckpt_nb.saving.collective import gather
from zckpt_nb.saving.rotation import delete_tag

PROBE = ".zckpt_probe.node{}"


def layout_problem(reports: list[dict[str, Any]], output_dir: Path, node_local: bool) -> str | None:
    """One line when some rank does not see what its layout needs (every rank computes the same from `reports`)."""
    def where(nodes: set[int]) -> str:
        found = {r["node"]: f"node {r['node']} (host {r['host']}, folder {r['fs']})" for r in reports
                 if r["node"] in nodes}
        return ", ".join(found[n] for n in sorted(found))

    if not node_local:
        blind = {r["node"] for r in reports if 0 not in r["sees"]}
        return (f"--output_dir {output_dir} is not one shared folder: {where(blind)} cannot see the probe file rank 0 "
                f"wrote there; mount one shared filesystem on every node, or pass --node_local_storage to keep each "
                "node's part in its own folder") if blind else None
    blind = {r["node"] for r in reports if r["node"] not in r["sees"]}
    if blind:
        return (f"--output_dir {output_dir}: the ranks of {where(blind)} do not share one folder; give all ranks of "
                "a node the same --output_dir")
    crossed = {r["node"] for r in reports if set(r["sees"]) - {r["node"]}}
    return (f"--node_local_storage, but {where(crossed)} write into one shared folder {output_dir}; drop "
            "--node_local_storage (a shared filesystem needs none) or give each node its own --output_dir"
            ) if crossed else None


def check_layout(output_dir: str | Path, node_local: bool) -> None:
    """Every rank: refuse (LayoutError) an output folder that does not fit the layout, leaving nothing."""
    import torch.distributed as dist

    output_dir = Path(output_dir)
    probe = output_dir / PROBE.format(node_rank())
    mine = secrets.token_hex(16) if writes_folder(node_local=True) else None
    if mine:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(mine)
    tokens = dict(pair for pair in gather((node_rank(), mine) if mine else None) if pair)
    stat = os.stat(output_dir)  # this rank's view: node, host, the folder's identity, which nodes' probes it sees
    sees = []
    for node, token in tokens.items():
        with suppress(OSError):  # a probe this rank cannot read: it does not see that node's folder
            if (output_dir / PROBE.format(node)).read_text() == token:
                sees.append(node)
    reports = gather({"node": node_rank(), "host": socket.gethostname(), "fs": f"{stat.st_dev}:{stat.st_ino}",
                      "sees": sees})
    dist.barrier()  # every rank has looked before any probe goes
    if mine:
        probe.unlink(missing_ok=True)
    problem = layout_problem(reports, output_dir, node_local)
    if problem:
        raise LayoutError(problem)


def drop_partial(output_dir: str | Path, tag: str) -> None:
    """Before resuming from `tag`, delete newer checkpoints committed on this node only."""
    for newer in [t for t in committed_tags(output_dir) if tag_step(t) > tag_step(tag)]:
        error = delete_tag(Path(output_dir), newer)
        if error:
            print(f"cannot drop {newer}, committed on this node only: {error}", flush=True)
