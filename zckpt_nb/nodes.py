"""Several nodes: where a launch sits among them, and whether every rank sees the output folder it must see.

A job on several nodes is one `torchrun` launch per node (`--nnodes`, `--node_rank`, `--master_addr`,
`--master_port`). Its checkpoints live in one of two layouts:

- shared: every node mounts the same `--output_dir` (NFS, Lustre, ...); rank 0 writes the files beside
  the tags, the manifest and `latest`; every rank writes its own shards there;
- node-local (`--node_local_storage`, DeepSpeed's `"checkpoint": {"use_node_local_storage": true}`): each node
  has its own `--output_dir`; each node's local rank 0 writes the files beside the tags, and its own manifest
  (listing the whole checkpoint and which node holds which file) and its own `latest`.

A save must never claim files that are not where its manifest says, so before training every rank looks for
probe files written by each node's local rank 0 (`check_layout`) and the job refuses a layout that does not
match, in one line naming the nodes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE = ".zckpt_probe.node{}"


class LayoutError(RuntimeError):
    """The output folders the ranks see do not match the storage layout asked for; the message is one line."""


@dataclass(frozen=True)
class Nodes:
    """Where one launch sits among the job's nodes: torchrun's --nnodes, --node_rank, --master_addr/--master_port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (one node only: the other nodes could not know it)

    def problem(self) -> str | None:
        """One line saying what is wrong with these flags, or None."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            return (f"--nnodes must be >= 1 and --node_rank in 0..{self.nnodes - 1} "
                    f"(got {self.nnodes}, {self.node_rank})")
        if not 0 <= self.master_port < 2**16:
            return f"--master_port must be a TCP port, 1..65535 (got {self.master_port})"
        if self.nnodes > 1 and not self.master_port:
            return (f"--nnodes {self.nnodes} needs --master_port: pass the same --master_addr and --master_port "
                    "(a free port on the node of --node_rank 0) to every node's launch")
        return None

    def job(self) -> str:
        """What names this job on every node (the rendezvous address); empty on one node."""
        return f"{self.master_addr}:{self.master_port}" if self.nnodes > 1 else ""

    def who(self, local_rank: int, nproc: int) -> str:
        """A rank's label in the launcher's output: 'rank R', or 'node K rank R' on several nodes (R: global rank)."""
        rank = self.node_rank * nproc + local_rank
        return f"rank {rank}" if self.nnodes == 1 else f"node {self.node_rank} rank {rank}"

    def torchrun_flags(self, port: int) -> list[str]:
        """torchrun's flags for this node (`port` stands in for a master_port of 0)."""
        return ["--nnodes", str(self.nnodes), "--node_rank", str(self.node_rank),
                "--master_addr", self.master_addr, "--master_port", str(self.master_port or port)]


ONE_NODE = Nodes()


def node_rank() -> int:
    """This rank's node (torchrun's GROUP_RANK)."""
    return int(os.environ.get("GROUP_RANK", 0))


def writes_folder(node_local: bool) -> bool:
    """Does this rank write the folder's shared files, manifest and `latest` (rank 0; local rank 0 if node-local)?

    DeepSpeed's own rule for creating the checkpoint folder.
    """
    return int(os.environ.get("LOCAL_RANK" if node_local else "RANK", 0)) == 0


def probe_report(output_dir: Path, tokens: dict[int, str]) -> dict[str, Any]:
    """This rank's view: node, host, filesystem identity of `output_dir` and which nodes' probes it sees there."""
    st = os.stat(output_dir)
    sees = [n for n, token in tokens.items() if read_probe(output_dir / PROBE.format(n)) == token]
    return {"node": node_rank(), "host": socket.gethostname(), "fs": f"{st.st_dev}:{st.st_ino}", "sees": sees}


def read_probe(path: Path) -> str | None:
    """A probe file's token, or None when this rank cannot see it."""
    try:
        return path.read_text()
    except OSError:
        return None


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
    """Every rank: refuse (LayoutError, the same line on every rank) an output folder that does not fit the layout.

    Each node's local rank 0 writes a probe file with a random token; every rank reports which probes it sees;
    the probes are removed again, so a refused job leaves nothing behind.
    """
    import torch.distributed as dist

    from zckpt_nb.commit import gather

    output_dir = Path(output_dir)
    probe = output_dir / PROBE.format(node_rank())
    mine = secrets.token_hex(16) if writes_folder(node_local=True) else None
    if mine:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(mine)
    tokens = dict(pair for pair in gather((node_rank(), mine) if mine else None) if pair)
    reports = gather(probe_report(output_dir, tokens))
    dist.barrier()  # every rank has looked before any probe goes
    if mine:
        probe.unlink(missing_ok=True)
    problem = layout_problem(reports, output_dir, node_local)
    if problem:
        raise LayoutError(problem)


def drop_partial(output_dir: str | Path, tag: str) -> None:
    """Before resuming from `tag`, a folder's writer deletes newer checkpoints committed on this node only.

    A crash between the nodes' commits leaves them; deleting them lets their steps be saved again. A failure is one
    printed line.
    """
    from zckpt_nb.rotation import delete_tag
    from zckpt_nb.verify import committed_tags, step_of

    for newer in [t for t in committed_tags(output_dir) if step_of(t) > step_of(tag)]:
        error = delete_tag(Path(output_dir), newer)
        if error:
            print(f"cannot drop {newer}, committed on this node only: {error}", flush=True)


def collect(parts: list[str | Path], out: str | Path, tag: str | None = None) -> dict[str, Any]:
    """Assemble the node-local parts of checkpoint `tag` (default: what `latest` names) into one folder `out`.

    Each part is verified first (its own files' sizes and SHA-256 against its manifest), the copies again at the
    end, so `out` is a plain checkpoint folder that `export` and DeepSpeed's `zero_to_fp32.py` read. Returns its
    manifest; CheckpointError in one line otherwise.
    """
    from zckpt_nb.verify import MANIFEST, SHARED_FILES, CheckpointError, latest_name, manifest_text, verify

    parts, out = [Path(p) for p in parts], Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty; collect into a new folder")
    tag = tag or latest_name(parts[0])
    manifests = [verify(part, tag) for part in parts]
    holder = {m.get("node"): part for m, part in zip(manifests, parts)}
    files, needed = manifests[0]["files"], {e.get("node") for e in manifests[0]["files"]}
    if None in holder or len(holder) < len(parts) or any(m["files"] != files for m in manifests):
        raise CheckpointError(f"{', '.join(map(str, parts))} are not one node-local checkpoint {tag}, one folder "
                              "per node; pass the --output_dir of each node of a --node_local_storage run")
    if needed - holder.keys():
        raise CheckpointError(f"no folder given for node(s) {', '.join(map(str, sorted(needed - holder.keys())))} "
                              f"of {tag}; pass every node's --output_dir")
    (out / tag).mkdir(parents=True)
    for entry in files:
        shutil.copy2(holder[entry["node"]] / tag / entry["path"], out / tag / entry["path"])
    for name in (*SHARED_FILES, "zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its scripts on rank 0
        source = next((part / name for part in parts if (part / name).is_file()), None)
        if source:
            shutil.copy2(source, out / name)
    first = manifests[0]
    (out / tag / MANIFEST).write_text(manifest_text(out, tag, first["step"], first["world_size"],
                                                         first["identity"], [{"files": files}]))
    (out / "latest").write_text(tag)
    return verify(out, tag)


def simulate(dirs: list[str | Path], steps: int, **launch_kw: Any) -> list[Any]:
    """Notebook 07: one launch per folder in `dirs`, as the nodes of one job on this machine (127.0.0.1).

    Returns, per node, its `RunResult`, or the failed launch's `LaunchError`; each launch has its own timeout.
    """
    import threading

    from zckpt_nb.launch import LaunchError, free_port, launch

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
    from zckpt_nb.verify import RANK_FILE, describe, elsewhere, latest_name, verify

    rows = []
    for folder in dict.fromkeys(Path(d) for d in dirs):
        tag = latest_name(folder)
        manifest = verify(folder, tag)
        ranks = sorted({int(m.group(1)) for p in (folder / tag).iterdir() if (m := RANK_FILE.search(p.name))})
        rows.append({"folder": folder.name, "latest": tag, "ranks whose files it holds": ", ".join(map(str, ranks)),
                     "files its manifest lists": len(manifest["files"]),
                     "of them on other nodes": len(elsewhere(manifest)), "verify says": describe(manifest)})
    return rows
