"""The seed's snippet in a real training loop: `if rank == 0: engine.save_checkpoint(...)`. Under ZeRO-3 it hangs.

`save_checkpoint` is collective: rank 0 waits in its first barrier for ranks that never call it, and the other ranks
train on until their next collective waits for rank 0. The collective timeout (`--collective_timeout`) ends both
waits with an error. Launched like the package's worker, with its options:
`launch(2, 12, out, worker="zckpt_nb.examples.rank0_only", save_every=4, collective_timeout=10)`.
"""

from __future__ import annotations

import os
import sys
import time

from zckpt_nb import data
from zckpt_nb.errors import gist, is_peer_failure
from zckpt_nb.format.layout import tag_for
from zckpt_nb.run import lifeline
from zckpt_nb.run.logs import WORKER_ERROR
from zckpt_nb.run.options import TrainOptions
from zckpt_nb.train import Worker, quiet_libraries, set_up, train_step


def save_on_rank0(worker: Worker, step: int) -> None:
    """The seed's snippet: only rank 0 saves (and writes the tokenizer); the other ranks go on training."""
    if worker.rank == 0:
        start = time.perf_counter()
        try:
            worker.engine.save_checkpoint(worker.opts.output_dir, tag=tag_for(step))
            worker.tokenizer.save_pretrained(worker.opts.output_dir)
        except RuntimeError as e:
            if not is_peer_failure(e):
                raise
            raise SystemExit(f"{WORKER_ERROR}rank 0: under ZeRO-3 every rank must call save_checkpoint; it was "
                             f"called on rank 0 only for {tag_for(step)} and gave up after "
                             f"{time.perf_counter() - start:.0f} s waiting for ranks that never joined") from None


def main() -> None:
    """Train with the package's set-up, saving the seed's way every --save_every steps."""
    lifeline.arm()
    quiet_libraries()
    worker = set_up(TrainOptions.parse())
    opts = worker.opts
    share = data.rank_share(opts.global_batch, worker.world, worker.rank)
    try:
        for step in range(opts.steps):
            batch = data.global_batch_for_step(worker.tokens, step=step, seed=opts.seed,
                                               global_batch=opts.global_batch, seq_len=worker.preset.seq_len)
            loss = train_step(worker.engine, batch, share, worker.world, worker.device)
            if worker.rank == 0:
                print(f"step {step + 1}/{opts.steps} loss {loss:.4f}", flush=True)
            if opts.save_every and (step + 1) % opts.save_every == 0:
                save_on_rank0(worker, step + 1)
    except RuntimeError as e:  # a training step's collective, waiting for rank 0
        if not is_peer_failure(e):
            raise
        sys.exit(f"{WORKER_ERROR}rank {os.environ.get('RANK', '?')}: a training step's collective timed out or "
                 f"lost a rank ({gist(e)}): rank 0 is saving alone")
    lifeline.leave(0)


if __name__ == "__main__":
    main()
