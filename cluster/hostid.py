"""What a rank calls its host in its card: the hostname, the kernel's boot id and the PID
namespace. Two ranks with the same identity see the same processes in /proc, so an owner
may take a writer's absence there as proof it is gone (``RankRuntime.write_path_closed``);
any other writer needs its launcher's exit record. The hostname alone is not enough: two
containers (or two hosts) can share a hostname and still not share their processes.

Each part must be read, never guessed: the boot id (all 128 bits of it) tells apart hosts
that share a hostname, and the namespace tells apart containers that share a kernel. The
initial PID namespace's inode is the same number on every host, so the namespace alone
names no host. A process that cannot read one of them refuses to name its host
(:class:`HostIdentityError`) rather than share a placeholder with every other such
process, which would let an owner take a writer on another host for one of its own and
its absence from /proc for proof that it is gone.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable

from kvferry.transfer.protocol import (
    BOOT_ID_PATH,
    PID_NAMESPACE_PATH,
    read_boot_id,
    read_pid_namespace,
)

__all__ = ["BOOT_ID_PATH", "PID_NAMESPACE_PATH", "HostIdentityError", "host_identity", "this_host"]


class HostIdentityError(RuntimeError):
    """This process cannot say which kernel and PID namespace it runs in."""


def _boot_id() -> str:
    return read_boot_id().replace("-", "")


def _pid_namespace() -> str:
    return str(read_pid_namespace())


def host_identity(
    hostname: str,
    boot_id: Callable[[], str] = _boot_id,
    pid_namespace: Callable[[], str] = _pid_namespace,
) -> str:
    """``hostname:bootid:pidns`` from the two readers; :class:`HostIdentityError` naming
    the path when either fails or reads nothing."""
    parts = []
    for what, path, read in (
        ("the kernel's boot id", BOOT_ID_PATH, boot_id),
        ("the PID namespace", PID_NAMESPACE_PATH, pid_namespace),
    ):
        try:
            value = read()
        except OSError as exc:
            raise HostIdentityError(
                f"cannot read {what} ({path}: {exc}): without it this rank cannot tell "
                "its host's processes from another host's, and it does not start"
            ) from exc
        if not value:
            raise HostIdentityError(f"{path} is empty: this rank cannot name its host")
        parts.append(value)
    return ":".join([hostname, *parts])


@functools.cache
def this_host() -> str:
    """This process's identity, e.g. ``gpu17:27c70c9a01a74cb7bd829c435799eef6:4026531836``."""
    return host_identity(socket.gethostname())
