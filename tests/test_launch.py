"""The launcher: bad input stops before any rank starts; timeouts and interrupts leave no rank behind."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import procs_mentioning

from zckpt_nb.convert.verify import verify_tag
from zckpt_nb.errors import LaunchTimeout
from zckpt_nb.format.layout import committed_tags, incomplete_tags
from zckpt_nb.run import lock
from zckpt_nb.run.launch import launch

CLI = [sys.executable, "-m", "zckpt_nb", "train"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--resume"], "no committed checkpoint"),
    (["--model", "huge"], "invalid choice"),
    (["--no_such_flag"], "unrecognized arguments"),
])
def test_bad_input_fails_fast_with_one_line(tmp_path, args, message):
    out = tmp_path / "out"
    start = time.monotonic()
    done = run_cli("--output_dir", str(out), *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stderr.strip().splitlines()[-1].count("error") == 1
    assert not out.exists(), "nothing may be created before the input is known good"
    assert time.monotonic() - start < 60  # no rank started (a launch takes longer than the import)


def test_unwritable_output_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        done = run_cli("--output_dir", str(ro / "run"))
        assert done.returncode == 2 and "cannot be written" in done.stderr
    finally:
        subprocess.run(["umount", str(ro)])


def test_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    done = run_cli("--output_dir", str(tmp_path / "file" / "run"))
    assert done.returncode == 2 and "is a file" in done.stderr


def test_timeout_kills_every_rank_and_shows_their_last_lines(tmp_path):
    out = tmp_path / "slow"
    with pytest.raises(LaunchTimeout) as err:
        launch(2, 1_000_000, out, timeout=30, verbose=False, progress=False)
    text = str(err.value)
    assert "timed out" in text and str(out) in text
    assert "last lines of rank 0" in text and "last lines of rank 1" in text
    assert "rank 1/2 on cpu (gloo): holds" in text  # what rank 1 printed before it was killed
    time.sleep(1)
    assert procs_mentioning(str(out)) == []


def test_interrupting_the_caller_leaves_no_orphan_rank(tmp_path):
    out = tmp_path / "interrupted"
    # A Jupyter kernel turns SIGINT into KeyboardInterrupt while a cell runs, whatever it inherited; a process started
    # in the background of a shell without job control (`cmd &` in a script) inherits SIGINT ignored, so say it here
    script = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from zckpt_nb.run.launch import launch\n"
              f"launch(2, 1_000_000, {str(out)!r}, timeout=300, progress=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for line in proc.stdout:  # wait until rank 0 is really training
        if "[rank 0] step 1/" in line:
            break
    assert len(procs_mentioning(str(out))) >= 3  # torchrun and two ranks
    proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" sends
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        left = [" ".join(p.cmdline()) for p in procs_mentioning(str(out))]
        proc.kill()
        pytest.fail(f"the launcher did not exit within 120 s of SIGINT; still alive: {left}")
    deadline = time.monotonic() + 15
    while procs_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert procs_mentioning(str(out)) == []
    assert proc.returncode != 0
    assert Path(out, "launch.log").is_file() and os.path.getsize(Path(out, "launch.log")) > 0


def test_restarting_the_notebook_kernel_during_a_launch_leaves_no_rank(tmp_path):
    from jupyter_client import KernelManager

    out = tmp_path / "kernel"
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        client.execute("from zckpt_nb.run.launch import launch\n"
                       f"launch(2, 1_000_000, {str(out)!r}, timeout=300, progress=False)")
        deadline = time.monotonic() + 120  # until torchrun and both ranks run
        while len(procs_mentioning(str(out))) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(procs_mentioning(str(out))) >= 3, "the launch never started"
        time.sleep(5)  # the ranks are training
        manager.restart_kernel(now=True)  # Jupyter's "Restart kernel": SIGKILL of the kernel process
        deadline = time.monotonic() + 10
        while procs_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [" ".join(p.cmdline()) for p in procs_mentioning(str(out))]
    finally:
        for p in procs_mentioning(str(out)):
            p.kill()
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert left == [], "processes of the job outlived the kernel by 10 s"


def kill_torchrun(cli: subprocess.Popen) -> None:
    """SIGKILL the torchrun below the CLI (as an OOM killer would pick it)."""
    [torchrun] = [p for p in psutil.Process(cli.pid).children() if "torch.distributed.run" in " ".join(p.cmdline())]
    torchrun.kill()


@pytest.mark.parametrize("kill, exit_code, says", [
    (lambda cli: cli.send_signal(signal.SIGTERM), 128 + signal.SIGTERM, "interrupted by SIGTERM"),
    (lambda cli: cli.send_signal(signal.SIGHUP), 128 + signal.SIGHUP, "interrupted by SIGHUP"),
    (lambda cli: cli.kill(), -signal.SIGKILL, ""),
    (kill_torchrun, 1, "failed (exit code -9)"),
], ids=["sigterm-cli", "sighup-cli", "kill-9-cli", "kill-9-torchrun"])
def test_no_rank_outlives_its_launcher_however_it_is_killed(tmp_path, kill, exit_code, says):
    out = tmp_path / "killed"
    cli = subprocess.Popen([*CLI, "--nproc", "2", "--steps", "1000000", "--save_every", "3", "--keep_last", "2",
                            "--timeout", "300", "--output_dir", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in cli.stdout:  # wait until a checkpoint is committed and training goes on
            if "saved checkpoint global_step3 " in line:
                break
        kill(cli)
        text, _ = cli.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while procs_mentioning(str(out)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [" ".join(p.cmdline()) for p in procs_mentioning(str(out))]
    finally:
        for p in procs_mentioning(str(out)):  # never leave this test's processes to the next test
            p.kill()
        cli.kill()
        cli.wait()
    assert left == [], "processes of the job outlived it by 10 s"
    assert cli.returncode == exit_code and says in text
    assert len(incomplete_tags(out)) <= 1
    for tag in committed_tags(out):
        verify_tag(out, tag)


def test_a_second_job_on_the_same_folder_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen([*CLI, "--nproc", "2", "--steps", "1000000", "--timeout", "300", "--output_dir", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if "[rank 0] step 1/" in line:
                break
        second = run_cli("--nproc", "2", "--steps", "2", "--output_dir", str(out))
        assert second.returncode == 2
        assert f"is in use by another job (host {socket.gethostname()}, pid {first.pid})" in \
            second.stderr.strip().splitlines()[-1]
        assert first.poll() is None, "the first job trains on"
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        first.kill()
        first.wait()
    assert not (out / lock.LOCK).exists(), "the lock is given back however the job ends"


def test_a_stale_lock_is_taken_over_and_says_so(tmp_path, capsys):
    out = tmp_path / "stale"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time()
    dead.wait()
    (out / lock.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": started}))
    run = launch(2, 2, out, verbose=False, progress=False, timeout=300)
    assert run.steps == [0, 1]
    assert f"taking over the stale lock of pid {dead.pid} on {socket.gethostname()}" in capsys.readouterr().out
    assert not (out / lock.LOCK).exists()


@pytest.mark.parametrize("content, message", [
    (json.dumps({"host": "elsewhere", "pid": 1, "started": 0.0}), "in use by another job (host elsewhere, pid 1)"),
    ("{not json", "is unreadable"),
], ids=["other-host", "garbage"])
def test_a_lock_this_host_cannot_judge_is_refused_and_kept(tmp_path, content, message):
    (tmp_path / lock.LOCK).write_text(content)
    with pytest.raises(lock.FolderInUse, match=re.escape(message)):
        lock.take(tmp_path)
    assert (tmp_path / lock.LOCK).read_text() == content


def test_a_log_that_cannot_be_written_is_reported_and_hides_nothing(tmp_path, capsys):
    """A full disk at the job's end (the log goes into the output folder) must not mask the job's own outcome."""
    from zckpt_nb.examples import faults
    from zckpt_nb.run.launch import keep_log

    with faults.tmpfs(tmp_path / "ro", "ro,size=1m") as why:
        if why:
            pytest.skip(why)
        keep_log(tmp_path / "ro" / "run.log", ["rank0: done"])
    err = capsys.readouterr().err
    assert "could not write the job's log" in err and "Read-only file system" in err
