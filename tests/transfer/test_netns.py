"""Two processes in two network namespaces joined by a veth pair, over tcp only: the
initiator's write+notify rounds are byte-checked by the target. Needs root and iproute2;
the namespaces and the veth pair are always removed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PEER_SCRIPT, start_target, stop

from kvferry.cluster.harness import netns

pytestmark = pytest.mark.netns


@pytest.fixture
def two_namespaces():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netns.two_hosts("kv", "10.77.0") as (a, b):
        yield a.netns, b.netns, a.dev, b.dev


def test_write_notify_rounds_across_namespaces(two_namespaces):
    ns_a, ns_b, veth_a, veth_b = two_namespaces
    env_a = {"UCX_NET_DEVICES": veth_a}
    target = start_target(
        "tcp",
        size=8 << 20,
        name="netns-target",
        prefix=["ip", "netns", "exec", ns_a, "env", *(f"{k}={v}" for k, v in env_a.items())],
    )
    try:
        cmd = [
            "ip",
            "netns",
            "exec",
            ns_b,
            "env",
            f"UCX_NET_DEVICES={veth_b}",
            sys.executable,
            str(PEER_SCRIPT),
            "initiator",
            "--transports",
            "tcp",
            "--address",
            target.hello["address"],
            "--segment",
            target.hello["segment"],
            "--rounds",
            "10",
            "--pages",
            "32",
            "--page-bytes",
            "16384",
        ]
        out = subprocess.run(cmd, capture_output=True, timeout=120, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["failures"] == [] and result["rounds"] == 10
        assert "tcp" in result["transports"]["target"]["transports"]
        assert veth_b in result["transports"]["target"]["transports"]
    finally:
        stop(target.proc)
