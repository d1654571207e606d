"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for the tests
and fault-suite rows that need a real network path between ranks (tcp only, a link that can
be taken down). Host a may instead stay in the root namespace (``root_a``): what runs there
is reachable from this process on 127.0.0.1, as in any other local cluster. Needs root and
iproute2. The namespaces and the veth pair are always removed, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, or no iproute2)."""


@dataclass(frozen=True)
class Host:
    """One side of the pair: its namespace (None: the root namespace), its end of the veth
    pair and its address."""

    netns: str | None
    dev: str
    addr: str

    def command(
        self, argv: list[str], env: dict[str, str] | None = None, own_pids: bool = False
    ) -> list[str]:
        """``argv`` run in this host's namespace, with ``env`` added to its environment.
        ``own_pids``: in a PID namespace of its own too (with its own /proc), so that no
        process of the other host can see its processes: what another machine is to them."""
        ns = ["ip", "netns", "exec", self.netns] if self.netns else []
        pids = ["unshare", "--pid", "--fork", "--mount-proc"] if own_pids else []
        return [*ns, *pids, "env", *(f"{k}={v}" for k, v in (env or {}).items()), *argv]

    def set_link(self, up: bool) -> None:
        """Take this host's end of the pair down (a partition) or bring it back up."""
        ip(*self._in_ns(), "link", "set", self.dev, "up" if up else "down")

    def _in_ns(self) -> tuple[str, ...]:
        return ("-n", self.netns) if self.netns else ()


def ip(*args: str) -> None:
    """Run ``ip`` with ``args``; raises CalledProcessError with ip's own message."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return None


def unused_subnet(first_two: str) -> str:
    """A ``first_two.N`` (three octets) that no address or route of the root namespace is
    in yet: what a pair with one end in the root namespace may use."""
    taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
    taken += subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=20).stdout
    free = [n for n in range(256) if f"{first_two}.{n}." not in taken]
    if not free:
        raise NetnsUnavailable(f"every {first_two}.N.0/24 is in use on this machine")
    return f"{first_two}.{random.choice(free)}"


@contextlib.contextmanager
def two_hosts(prefix: str, subnet: str, root_a: bool = False) -> Iterator[tuple[Host, Host]]:
    """``subnet`` is the first three octets (``"10.77.0"``): the hosts get .1 and .2/24.
    ``prefix`` (a few letters) keeps names of concurrent users apart; a random tag is
    added, and every name stays within the kernel's 15 characters. With ``root_a``, host a
    is the root namespace: its end of the pair (and ``subnet``) is visible to the whole
    machine while the pair exists, so give it a subnet no one else uses."""
    why = unavailable_reason()
    if why is not None:
        raise NetnsUnavailable(why)
    tag = uuid.uuid4().hex[:6]
    a = Host(None if root_a else f"{prefix}na{tag}", f"{prefix}a{tag}", f"{subnet}.1")
    b = Host(f"{prefix}nb{tag}", f"{prefix}b{tag}", f"{subnet}.2")
    created: list[str] = []
    try:
        for host in (a, b):
            if host.netns:
                ip("netns", "add", host.netns)
                created.append(host.netns)
        ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for host in (a, b):
            if host.netns:
                ip("link", "set", host.dev, "netns", host.netns)
                ip("-n", host.netns, "link", "set", "lo", "up")
            ip(*host._in_ns(), "addr", "add", f"{host.addr}/24", "dev", host.dev)
            host.set_link(True)
        yield a, b
    finally:
        # Deleting a namespace removes its end of the veth pair, and with it the other end;
        # a pair left in the root namespace by a failed set-up is deleted by name.
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        if root_a:
            subprocess.run(["ip", "link", "del", a.dev], capture_output=True, timeout=20)
