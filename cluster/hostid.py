"""What a rank calls its host in its card: the hostname, the kernel's boot id and the PID
namespace. Two ranks with the same identity see the same processes in /proc, so an owner
may take a writer's absence there as proof it is gone (``RankRuntime.write_path_closed``);
any other writer needs its launcher's exit record. The hostname alone is not enough: two
containers (or two hosts) can share a hostname and still not share their processes.
"""

from __future__ import annotations

import functools
import os
import socket


@functools.cache
def this_host() -> str:
    """``hostname:bootid:pidns``, e.g. ``gpu17:3f2a1b9c:4026531836``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:8]
    except OSError:
        boot = "noboot"
    try:
        pidns = os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        pidns = "nopidns"
    return f"{socket.gethostname()}:{boot}:{pidns}"
