"""A dead peer during a save is a peer failure, not a write error: one clear error on the survivors, no further
collective. Two real gloo ranks; rank 1 SIGKILLs itself, rank 0 then enters the commit protocol's agreement."""

import os
import subprocess
import sys
import textwrap

import pytest

from zckpt_nb.errors import CollectiveTimeout, is_peer_failure, peer_failure
from zckpt_nb.run.launch import free_port, kill_tree

RANK = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from zckpt_nb.errors import CollectiveTimeout
    from zckpt_nb.saving.collective import gather
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    gather({"rank": dist.get_rank()})  # both ranks alive: the protocol works
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a peer killed mid-save (OOM killer, preemption)
    time.sleep(1)
    try:
        gather({"rank": 0, "error": None})
    except CollectiveTimeout as e:
        print("ONE LINE:", e, flush=True)
        os._exit(3)  # not sys.exit: in the interpreter's teardown a gloo thread can abort the process (SIGABRT)
""")


def test_a_killed_peer_ends_the_agreement_with_one_clear_error():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", RANK], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=90)
        procs[1].wait(timeout=10)
    finally:
        for p in procs:
            kill_tree(p)
    assert procs[1].returncode == -9
    assert procs[0].returncode == 3, out
    line = next(line for line in out.splitlines() if line.startswith("ONE LINE:"))
    assert "rank 0: the commit protocol's agreement stopped: a peer rank died" in line
    assert "'latest' was not moved" in line and "Traceback" not in out


@pytest.mark.fast
def test_any_torch_distributed_error_is_a_peer_failure_and_a_disk_error_is_not():
    import torch.distributed as dist

    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a "
                                 "network error")
    assert is_peer_failure(nccl) and is_peer_failure(RuntimeError("Connection closed by peer"))
    assert not is_peer_failure(OSError(28, "No space left on device"))
    err = peer_failure(nccl, 3, "save of global_step8")
    assert isinstance(err, CollectiveTimeout) and len(str(err).splitlines()) == 1
    assert str(err).startswith("rank 3: save of global_step8 stopped") and "DistBackendError" in str(err)
