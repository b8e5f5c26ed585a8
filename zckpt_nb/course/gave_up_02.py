"""Notebook 02's mistakes: imported by the edited copy of its worker, so that an error a rank does not catch prints
where the rank gave up, in one line, instead of a traceback, and ends the rank.

Display plumbing, not part of the lesson: importing it sets `sys.excepthook`.
"""

import os
import sys
import time
import traceback


def gave_up(kind, error, tb):
    """The excepthook: `rank R gave up in <DeepSpeed call> > ... > <collective>: <first sentence of the error>.`"""
    where = [f.name for f in traceback.extract_tb(tb) if "deepspeed" in f.filename and "wrap" not in f.name]
    route = f"{where[0]} > ... > {where[-1]}" if where else kind.__name__  # the DeepSpeed call, the collective
    message = str(error).splitlines()[0].split("] ", 1)[-1]                # no C++ source path
    print(f"rank {os.environ['RANK']} gave up in {route}: {message.split('. ')[0].rstrip('.')}.", flush=True)
    time.sleep(2)  # exit after every rank's own deadline: an exit closes the connections and torchrun stops the rest
    os._exit(1)


sys.excepthook = gave_up
