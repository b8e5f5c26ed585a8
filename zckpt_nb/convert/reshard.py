"""Change the world size of a ZeRO-3 checkpoint: DeepSpeed's universal checkpoint, committed like a save.

DeepSpeed's `ds_to_universal` runs in a child process once every source file passed its SHA-256 and a weights-only
unpickle; its output, DIR/universal/<tag>/, is committed with the source manifest's SHA-256, and a later resume reuses
it while that hash still matches (docs/resharding.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zckpt_nb.convert.safeload import check_files, load
from zckpt_nb.convert.verify import verify_folder, verify_tag
from zckpt_nb.errors import CheckpointError
from zckpt_nb.format.disk import staged
from zckpt_nb.format.layout import MANIFEST, UNIVERSAL, universal_dir
from zckpt_nb.format.manifest import Manifest, commit, entries_under, read_manifest, sha256_file
from zckpt_nb.format.units import counted, mib
from zckpt_nb.measure import meters


def manifest_hash(ckpt_dir: str | Path, tag: str) -> str:
    """SHA-256 of the source checkpoint's manifest: names exactly the bytes a copy was converted from."""
    return sha256_file(Path(ckpt_dir) / tag / MANIFEST)


def convert(ckpt_dir: str | Path, tag: str, timeout: float = 600) -> Manifest:
    """Convert committed checkpoint `tag` into DIR/universal/<tag>, committed; returns its manifest."""
    ckpt_dir = Path(ckpt_dir)
    source = check_files(ckpt_dir, tag)
    final = universal_dir(ckpt_dir, tag)
    if final.parent.is_symlink():
        raise CheckpointError(f"{final.parent} is a symbolic link; refusing to write the universal copy through it")
    with staged(final) as tmp:  # ds_to_universal in a child process (`main`): its seconds and peak RSS
        start, env = time.perf_counter(), dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
        try:
            done = subprocess.run([sys.executable, "-m", "zckpt_nb.convert.reshard", str(ckpt_dir / tag), str(tmp)],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"converting {ckpt_dir / tag} to a universal checkpoint took over {timeout:.0f} s; "
                                  "stopped (nothing was loaded)") from None
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise CheckpointError(f"DeepSpeed's ds_to_universal failed on {ckpt_dir / tag}: {last[:200]}")
        peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
        cost = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak}
        latest = tmp.parent / "latest_universal"  # DeepSpeed's converter names its output there; we pass the tag
        if latest.is_file() and latest.read_text().strip() == tmp.name:
            latest.unlink()
        files = entries_under(tmp)
        cost |= {"bytes": sum(e.bytes for e in files), "source_bytes": source.total_bytes()}
        commit(tmp, Manifest(tag, source.step, files, kind=UNIVERSAL, identity=source.identity,
                             source_world_size=source.world_size,
                             source_manifest_sha256=manifest_hash(ckpt_dir, tag), conversion=cost))
    return read_manifest(final)


def reusable(ckpt_dir: str | Path, tag: str) -> Manifest | None:
    """The manifest of a committed universal copy of `tag` converted from its current bytes, else None."""
    folder = universal_dir(ckpt_dir, tag)
    if not (folder / MANIFEST).is_file():
        return None
    try:
        manifest = verify_folder(folder, UNIVERSAL)
    except CheckpointError:
        return None  # damaged: convert again
    return manifest if manifest.source_manifest_sha256 == manifest_hash(ckpt_dir, tag) else None


def ensure_universal(ckpt_dir: str | Path, tag: str, identity: dict[str, Any] | None = None,
                     timeout: float = 600) -> tuple[Manifest, bool]:
    """A committed universal copy of `tag`, converted now or reused; returns (its manifest, reused?)."""
    away = verify_tag(ckpt_dir, tag, identity=identity).elsewhere()
    if away:
        raise CheckpointError(f"{tag} in {ckpt_dir} is one node's part: {len(away)} of its files live on other nodes; "
                              "assemble the parts first (python -m zckpt_nb collect DIR... OUT), then convert OUT")
    manifest = reusable(ckpt_dir, tag)
    if manifest is not None:  # every file unpickled weights-only (DeepSpeed's universal load: weights_only=False)
        for entry in (e for e in manifest.files if e.path.endswith(".pt")):
            load(universal_dir(ckpt_dir, tag) / entry.path, mmap=True)
        return manifest, True
    return convert(ckpt_dir, tag, timeout), False


def describe_conversion(manifest: Manifest, reused: bool, world: int | None) -> str:
    """What was converted (or reused), what it cost, and where it loads (on `world` ranks, or any)."""
    c, n = manifest.conversion or {}, manifest.source_world_size
    saved = f"{manifest.tag} was saved by {counted(n, 'rank')}" + (f" and this run has {world}." if world else ".")
    sizes = f"{mib(c['source_bytes'])} of rank files became {mib(c['bytes'])} in {len(manifest.files)} files under " \
        f"{UNIVERSAL}/{manifest.tag}"
    what = f"Reused its universal copy ({sizes})." if reused else \
        f"Converted it to a universal checkpoint in {c['seconds']:.1f} s (peak RSS {mib(c['peak_rss_bytes'])}): " \
        f"{sizes}."
    own = bool((manifest.identity or {}).get("model"))  # this package's preset; else an adopted model
    where = "Loading it with DeepSpeed's load_universal." if world else \
        "Resume it on any number of ranks with train --resume --nproc M." if own else \
        "It loads on any number of ranks with DeepSpeed's \"checkpoint\": {\"load_universal\": true}."
    return f"{saved} {what} {where}"


def main(argv: list[str]) -> None:
    """The converter's child process: DeepSpeed's ds_to_universal, one worker, then this process's peak RSS."""
    from deepspeed.checkpoint import ds_to_universal

    src, dst = argv
    sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", dst,
                "--num_extract_workers", "1", "--num_merge_workers", "1"]  # in-process: one peak RSS to report
    ds_to_universal.main(ds_to_universal.parse_arguments())
    # VmHWM, not ru_maxrss: Linux carries into ru_maxrss the RSS of the parent's forked copy before exec
    print(json.dumps({"peak_rss_bytes": meters.rss_high_water()}))


if __name__ == "__main__":
    main(sys.argv[1:])
