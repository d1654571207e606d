"""The fact that a writer's process is gone (kvferry.cluster.processes.process_gone), which
the rank runtime and the vLLM connector both read: the whole process, every thread of it.
No vLLM needed.

The case: a process whose main thread has exited (a zombie in /proc) while another of its
threads still runs, as a killed multithreaded prefill is for a while on a loaded host.
Broken mode: the main thread's state alone (``main_thread_exited``) calls that process gone.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time

import pytest

from kvferry.cluster.processes import main_thread_exited, process_gone

SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())  # exit(2): one thread
LEADER_GONE = f"""
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
sys.stdout.write("ready\\n")
sys.stdout.flush()
ctypes.CDLL(None).syscall({SYS_EXIT}, 0)
"""


def _main_thread_zombie(pid: int, limit_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid}: main thread still running after {limit_s} s")


@pytest.fixture
def leader_gone():
    """A process whose main thread exited while another thread sleeps on."""
    if SYS_EXIT is None:
        pytest.skip(f"no exit(2) number known for {platform.machine()}")
    proc = subprocess.Popen([sys.executable, "-c", LEADER_GONE], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _main_thread_zombie(proc.pid)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_process_with_a_live_thread_has_not_exited(leader_gone):
    assert leader_gone.poll() is None  # waitpid: not exited
    assert not process_gone(leader_gone.pid)
    leader_gone.kill()
    t0 = time.monotonic()
    while not process_gone(leader_gone.pid):
        assert time.monotonic() - t0 < 10.0, "killed, yet not seen exited"
        time.sleep(0.01)
    leader_gone.wait(10)
    assert process_gone(leader_gone.pid)  # reaped


def test_broken_mode_the_main_threads_state_calls_it_gone(leader_gone):
    assert leader_gone.poll() is None
    assert main_thread_exited(leader_gone.pid)


def test_a_running_process_has_not_exited():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
