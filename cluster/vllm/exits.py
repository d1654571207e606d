"""What a connector reads of a writer's process on this host, for the proof that it is
gone (I4): whether the whole process exited. The rule that turns this fact into a proof
is :func:`kvferry.engine.protocol.proof.gone_proof`.
"""

from __future__ import annotations

import os
import select

from kvferry.cluster.processes import process_gone


def writer_exited(pid: int) -> bool:
    """``pid``'s whole process has exited on this host: every thread, not only its main
    one. A killed process's main thread is a zombie while its other threads are still
    exiting, their memory still mapped (milliseconds, or hundreds of them on a loaded
    host), and that main thread is what :func:`kvferry.cluster.processes.process_gone`
    reads. A pidfd polls readable only once the last thread exited (the exit waitpid
    reports); where there are no pidfds, /proc's task list must hold only the zombie."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # reaped already
    except (OSError, AttributeError):
        if not process_gone(pid):
            return False
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except FileNotFoundError:
            return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    finally:
        os.close(fd)
