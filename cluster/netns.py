"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for the tests
that need a real network path between ranks (tcp only, a link that can be taken down).
Needs root and iproute2. The namespaces (and with them the veth pair) are always removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import Iterator


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, or no iproute2)."""


@dataclass(frozen=True)
class Host:
    """One side of the pair: its namespace, its end of the veth pair and its address."""

    netns: str
    dev: str
    addr: str


def ip(*args: str) -> None:
    """Run ``ip`` with ``args``; raises CalledProcessError with ip's own message."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


@contextlib.contextmanager
def two_hosts(prefix: str, subnet: str) -> Iterator[tuple[Host, Host]]:
    """``subnet`` is the first three octets (``"10.77.0"``): the hosts get .1 and .2/24.
    ``prefix`` (a few letters) keeps names of concurrent users apart; a random tag is
    added, and every name stays within the kernel's 15 characters."""
    why = unavailable_reason()
    if why is not None:
        raise NetnsUnavailable(why)
    tag = uuid.uuid4().hex[:6]
    a = Host(f"{prefix}na{tag}", f"{prefix}a{tag}", f"{subnet}.1")
    b = Host(f"{prefix}nb{tag}", f"{prefix}b{tag}", f"{subnet}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            ip("netns", "add", host.netns)
            created.append(host.netns)
        ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for host in (a, b):
            ip("link", "set", host.dev, "netns", host.netns)
            ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            ip("-n", host.netns, "link", "set", host.dev, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in created:  # deleting a namespace removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
