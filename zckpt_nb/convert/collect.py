"""Copying checkpoints: one tag into a fresh folder, or the node-local parts into one folder."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from zckpt_nb.convert.verify import check_output, verify
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.disk import atomic_write, staged
from zckpt_nb.format.layout import SHARED_FILES, latest_name
from zckpt_nb.format.manifest import Manifest, commit, shared_entries


def copy_checkpoint(src: str | Path, dst: str | Path, tag: str) -> Path:
    """Copy checkpoint `tag` (and the tokenizer beside it) into a fresh `dst` whose `latest` names it."""
    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src / tag, dst / tag)
    for name in (*SHARED_FILES, "zero_to_fp32.py"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    (dst / "latest").write_text(tag)
    return dst


def collect(parts: list[str | Path], out: str | Path, tag: str | None = None) -> Manifest:
    """Assemble the verified node-local parts of checkpoint `tag` into one folder `out`; its verified manifest."""
    parts, out = [Path(p) for p in parts], Path(out).absolute()
    check_output(out)
    tag = tag or latest_name(parts[0])
    manifests = [verify(part, tag) for part in parts]
    holder = {m.node: part for m, part in zip(manifests, parts)}
    first = manifests[0]
    needed = {e.node for e in first.files}
    if None in holder or len(holder) < len(parts) or any(m.files != first.files for m in manifests):
        raise CheckpointError(f"{', '.join(map(str, parts))} are not one node-local checkpoint {tag}, one folder "
                              "per node; pass the --output_dir of each node of a --node_local_storage run")
    if needed - holder.keys():
        raise CheckpointError(f"no folder given for node(s) {', '.join(map(str, sorted(needed - holder.keys())))} "
                              f"of {tag}; pass every node's --output_dir")
    with staged(out) as tmp:
        (tmp / tag).mkdir()
        for entry in first.files:
            shutil.copy2(holder[entry.node] / tag / entry.path, tmp / tag / entry.path)
        for name in (*SHARED_FILES, "zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its scripts on rank 0
            source = next((part / name for part in parts if (part / name).is_file()), None)
            if source:
                shutil.copy2(source, tmp / name)
        commit(tmp / tag, replace(first, node=None, shared=shared_entries(tmp)))
        atomic_write(tmp / "latest", tag)
    return verify(out, tag)
