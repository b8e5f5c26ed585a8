"""What verifying costs a resume: DeepSpeed's own `engine.load_checkpoint` against `zckpt_nb.resume` (every rank hashes
its own files against the manifest, then DeepSpeed reads them weights-only), in one job, interleaved.

    python benchmarks/resume_cost.py --nproc 2 --hidden 768 --layers 6 --repeats 5
    PYTHONPATH=/tmp/zckpt_old python benchmarks/resume_cost.py ...   # another version of the package (a worktree)

The job saves one committed checkpoint with `zckpt_nb.save`, then loads it `--repeats` times each way, alternating
which goes first; each load's time is its slowest rank's. The page cache is warm for both (every load reads the same
files just read). Prints the medians, the spread and the ratio zckpt/plain.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def slowest(seconds: float) -> float:
    """The slowest rank's figure."""
    import torch
    import torch.distributed as dist

    figure = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(figure, op=dist.ReduceOp.MAX)
    return figure.item()


def rank_main(args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import HfDeepSpeedConfig

    import zckpt_nb

    deepspeed.init_distributed(dist_backend="gloo")
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=128)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  (transformers reads it while building the model)
    model = AutoModelForCausalLM.from_config(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    own = engine.checkpoint_engine  # DeepSpeed's own; zckpt_nb.resume installs the package's around it
    outcome = zckpt_nb.save(engine, args.out, step=1)
    assert outcome.committed, outcome.error

    def plain() -> None:
        engine.checkpoint_engine = own
        engine.load_checkpoint(args.out, tag=outcome.tag)

    def verified() -> None:
        zckpt_nb.resume(engine, args.out)  # the newest committed checkpoint: every check runs (any version)

    times: dict[str, list[float]] = {"plain": [], "zckpt": []}
    for repeat in range(args.repeats):
        for name, load in (("plain", plain), ("zckpt", verified))[:: 1 if repeat % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            load()
            times[name].append(slowest(time.perf_counter() - start))
    if dist.get_rank() == 0:
        size = sum(p.stat().st_size for p in (Path(args.out) / outcome.tag).iterdir())
        print(f"checkpoint: {size / 2**20:.1f} MiB on {dist.get_world_size()} ranks, {args.repeats} loads each way")
        for name, found in times.items():
            print(f"{name:6s} median {statistics.median(found):.3f} s  (min {min(found):.3f}, max {max(found):.3f})")
        ratios = [z / p for z, p in zip(times["zckpt"], times["plain"])]
        print(f"zckpt/plain, pair by pair: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the teardown, where a gloo thread can abort a finished rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or str(Path(tmp) / "ckpt")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                   "--master_port", "29533", __file__, "--rank", "--out", out, "--hidden", str(args.hidden),
                   "--layers", str(args.layers), "--repeats", str(args.repeats)]
        job = subprocess.Popen(command, env=dict(os.environ, DS_ACCELERATOR="cpu"), start_new_session=True)
        try:
            code = job.wait(timeout=1800)
        finally:
            if job.poll() is None:  # timed out or interrupted: every rank goes with torchrun
                os.killpg(job.pid, signal.SIGKILL)
        sys.exit(code)


if __name__ == "__main__":
    main()
