"""A two-node cluster (kvferry.cluster.harness.localcluster.two_nodes): node 0 (router + prefill) in
the root namespace, node 1 (decode) in a network namespace of its own behind a veth pair,
over tcp, started with torchrun's static rendezvous as scripts/serve-node.sh does. A request
served across the link replays its prompt. Needs root and iproute2; the namespace and the
link are always removed. A partition of this link mid-transfer is a row of the fault suite
(``partition@mid-transfer``, tests/faults/test_fault_suite.py)."""

from __future__ import annotations

import subprocess

import pytest

from kvferry.cluster.harness import localcluster, netns
from kvferry.cluster.harness.workload import expected_replay, make_prompt

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture
def needs_netns():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_request_served_across_two_namespaces(needs_netns, tmp_path):
    args = ["--prefill", "1", "--context-length", "2048", "--pool-tokens", "8192"]
    with localcluster.two_nodes(2, 1, args, tmp_path) as cluster:
        prompt = make_prompt("@2n0de@", 500)
        status, body = cluster.complete(prompt, 500, timeout=60)
        assert status == 200, body
        assert body["text"] == expected_replay(prompt, 500)
        status, cap = cluster.call("GET", "/capacity", timeout=10)
        assert status == 200 and len(cap["ranks"]) == 2 and all(r["ok"] for r in cap["ranks"])
        assert "decode rank 2 ready" in cluster.node1_log.read_text()
        ns, dev = cluster.node1_host.netns, cluster.node1_host.dev
    # gone with the cluster: node 1's namespace and both ends of the link
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode != 0
