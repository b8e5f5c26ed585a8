"""zckpt_nb: checkpointing under DeepSpeed ZeRO Stage 3, taught and measured.

For a training loop of your own (every rank calls each of these):

    zckpt_nb.save(engine, output_dir, mode="commit", tokenizer=None, client_state=None, keep_last=0)
    zckpt_nb.wait(engine)                  # an asynchronous save's commit, before training ends
    client_state = zckpt_nb.resume(engine, output_dir)

`zckpt_nb.Checkpointer` is the object behind them; `mode` is a `zckpt_nb.SaveMode` or a `zckpt_nb.Route`. They are
imported on first use: `import zckpt_nb` loads neither torch nor DeepSpeed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["save", "wait", "resume", "Checkpointer", "SaveMode", "Route"]


def __getattr__(name: str) -> Any:
    if name in ("SaveMode", "Route"):  # plain enums: no torch, no DeepSpeed
        from zckpt_nb.format import records

        return getattr(records, name)
    if name in __all__:
        from zckpt_nb.saving import api

        return getattr(api, name)
    raise AttributeError(f"module 'zckpt_nb' has no attribute {name!r}")
