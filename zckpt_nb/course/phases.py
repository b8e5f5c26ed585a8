"""Notebook 06's split of one save call into phases (its section 1 probe imports it): within the block, timed
wrappers stand in for the two methods a save calls, DeepSpeed's `engine.save_checkpoint` (once) and its checkpoint
engine's `save` (once per file), so the call divides into

- preflight: from the block's start to DeepSpeed's call (`zckpt_nb.save`'s free-space check and its collective);
- deepspeed: DeepSpeed's call minus files (state dicts, collectives, barriers, folders);
- files: the writer's `save` of every file, each timed on its own;
- after: from DeepSpeed's return to the block's end (`commit`'s agreement, manifest and `latest`; the package's
  `async` starting its thread).

The package's own `timings` do not separate DeepSpeed's part from the files; these wrappers cut every mode's call at
the same two places."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def phases(engine) -> Iterator[dict]:
    """Time the save call in the block: yields a dict that the block's end fills with the four phases, in seconds."""
    ds_call, marks, files, timings = engine.save_checkpoint, {}, [], {}

    def timed_call(*args, **kwargs):  # what the block calls as engine.save_checkpoint, directly or in zckpt_nb.save
        writer = engine.checkpoint_engine  # by now the package's, in zckpt_nb.save: it writes, hashes, fsyncs or copies
        hand_on = writer.save

        def timed_file(state_dict, path):  # DeepSpeed calls this once per file
            start = time.perf_counter()
            hand_on(state_dict, path)
            files.append(time.perf_counter() - start)

        writer.save, marks["in"] = timed_file, time.perf_counter()
        try:
            return ds_call(*args, **kwargs)
        finally:
            writer.save, marks["out"] = hand_on, time.perf_counter()

    engine.save_checkpoint = timed_call  # on the instance: the class's method is untouched
    start = time.perf_counter()
    try:
        yield timings
        end = time.perf_counter()
    finally:
        del engine.save_checkpoint  # DeepSpeed's own method again
    timings.update(preflight=marks["in"] - start, deepspeed=marks["out"] - marks["in"] - sum(files),
                   files=sum(files), after=end - marks["out"])
