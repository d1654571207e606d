"""Two processes in two network namespaces joined by a veth pair, over tcp only: the
initiator's write+notify rounds are byte-checked by the target. Needs root and iproute2;
the namespaces and the veth pair are always removed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import PEER_SCRIPT, read_json_line, start_target, stop

pytestmark = pytest.mark.netns


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_namespaces():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip)")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"kvfa{tag}", f"kvfb{tag}"
    veth_a, veth_b = f"kva{tag}", f"kvb{tag}"
    created: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, "10.77.0.1/24"), (ns_b, veth_b, "10.77.0.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, veth_a, veth_b
    finally:
        for ns in created:  # deleting a namespace removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_write_notify_rounds_across_namespaces(two_namespaces):
    ns_a, ns_b, veth_a, veth_b = two_namespaces
    env_a = {"UCX_NET_DEVICES": veth_a}
    target = start_target("tcp", size=8 << 20, name="netns-target",
                          prefix=["ip", "netns", "exec", ns_a, "env",
                                  *(f"{k}={v}" for k, v in env_a.items())])
    try:
        cmd = ["ip", "netns", "exec", ns_b, "env", f"UCX_NET_DEVICES={veth_b}",
               sys.executable, str(PEER_SCRIPT), "initiator", "--transports", "tcp",
               "--address", target.hello["address"], "--segment", target.hello["segment"],
               "--rounds", "10", "--pages", "32", "--page-bytes", "16384"]
        out = subprocess.run(cmd, capture_output=True, timeout=120, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["failures"] == [] and result["rounds"] == 10
        assert "tcp" in result["transports"]["target"]["transports"]
        assert veth_b in result["transports"]["target"]["transports"]
    finally:
        stop(target.proc)
