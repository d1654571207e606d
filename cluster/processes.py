"""What a host reads of a writer's process, for the proof that it is gone (I4).

The facts only: whether a pid on this host has exited, and how long a host keeps driving
its worker after seeing it gone (``DRAIN_S``) before the proof holds. The rule that turns
facts into a proof is :func:`kvferry.engine.protocol.gone_proof`; every host (the rank
runtime, the vLLM connector) gathers its facts here.
"""

from __future__ import annotations

import os
import select

DRAIN_S = 0.2  # progress after a writer's death before its quarantined pages are released


def main_thread_exited(pid: int) -> bool:
    """``pid``'s main thread is a zombie or gone. Not the proof a process is gone: see
    :func:`process_gone` (kept for that contrast, and for hosts without pidfds)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def process_gone(pid: int) -> bool:
    """``pid``'s whole process has exited on this host: every thread, not only its main
    one. A killed process's main thread is a zombie while its other threads are still
    exiting with its memory mapped (milliseconds, or hundreds of them on a loaded host:
    a transport's progress thread can still complete a write then). A pidfd polls
    readable only once the last thread exited; where there are no pidfds, /proc's task
    list must hold only the zombie."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # reaped already
    except (OSError, AttributeError):
        if not main_thread_exited(pid):
            return False
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except FileNotFoundError:
            return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    finally:
        os.close(fd)
