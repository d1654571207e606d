"""A two-node cluster: node 0 (router + prefill) and node 1 (decode) in two network
namespaces joined by a veth pair, over tcp, started with torchrun's static rendezvous as
scripts/serve-node.sh does. A request served across the link replays its prompt. Needs root
and iproute2; the namespaces are always removed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvferry.cluster import netns
from kvferry.cluster.localcluster import free_port
from kvferry.cluster.workload import expected_replay, make_prompt

pytestmark = [pytest.mark.netns, pytest.mark.slow]

ADDR_A, ADDR_B = "10.78.0.1", "10.78.0.2"


_ip = netns.ip


@pytest.fixture
def two_hosts():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netns.two_hosts("kc", "10.78.0") as (a, b):
        yield (a.netns, a.dev), (b.netns, b.dev)


def _node(ns: str, dev: str, node_rank: int, nproc: int, master_port: int, http_port: int,
          log, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", ns, "env", f"UCX_NET_DEVICES={dev}", f"GLOO_SOCKET_IFNAME={dev}",
           "PYTHONUNBUFFERED=1", "OMP_NUM_THREADS=1",
           sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--rdzv-backend=static", f"--master-addr={ADDR_A}",
           f"--master-port={master_port}", "-m", "kvferry.cluster.launch",
           "--transports", "tcp", "--prefill", "1", "--context-length", "2048",
           "--pool-tokens", "8192", "--port", str(http_port), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _get(ns: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    code = ("import json,sys,urllib.request,urllib.error\n"
            "data=sys.argv[2].encode() if sys.argv[2] else None\n"
            "req=urllib.request.Request(sys.argv[1],data=data,headers={'Content-Type':'application/json'})\n"
            "try:\n r=urllib.request.urlopen(req,timeout=%d); print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e: print(e.code); print(e.read().decode())\n" % timeout)
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, url,
                          json.dumps(body) if body else ""],
                         capture_output=True, text=True, timeout=timeout + 10)
    if out.returncode != 0:
        return 0, {"stderr": out.stderr[-500:]}
    status, payload = out.stdout.split("\n", 1)
    return int(status), json.loads(payload)


def test_request_served_across_two_namespaces(two_hosts, tmp_path):
    (ns_a, dev_a), (ns_b, dev_b) = two_hosts
    master_port, http_port = free_port(), free_port()
    logs = [open(tmp_path / "node0.log", "wb"), open(tmp_path / "node1.log", "wb")]
    nodes = [_node(ns_a, dev_a, 0, 2, master_port, http_port, logs[0]),
             _node(ns_b, dev_b, 1, 1, master_port, http_port, logs[1])]
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_healthy(ns_a, url, nodes, tmp_path / "node0.log")
        prompt = make_prompt("@2n0de@", 500)
        status, body = _get(ns_a, url + "/v1/completions", {"prompt": prompt, "max_tokens": 500}, timeout=60)
        assert status == 200, body
        assert body["text"] == expected_replay(prompt, 500)
        status, cap = _get(ns_a, url + "/capacity")
        assert status == 200 and len(cap["ranks"]) == 2 and all(r["ok"] for r in cap["ranks"])
        node1_log = (tmp_path / "node1.log").read_text()
        assert "decode rank 2 ready" in node1_log
    finally:
        _stop(nodes, logs)


def _wait_healthy(ns: str, url: str, nodes, log_path) -> None:
    deadline = time.monotonic() + 120
    while _get(ns, url + "/health", timeout=3)[0] != 200:
        assert all(n.poll() is None for n in nodes), log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "two-node cluster not healthy in 120 s"
        time.sleep(0.5)


def _stop(nodes, logs) -> None:
    for n in nodes:
        if n.poll() is None:
            os.killpg(n.pid, signal.SIGTERM)
    for n in nodes:
        try:
            n.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(n.pid, signal.SIGKILL)
    for f in logs:
        f.close()


def _wait_for(path, text: str, timeout_s: float) -> str:
    """The log once it contains ``text``; fails with the log's tail past the deadline."""
    deadline = time.monotonic() + timeout_s
    while text not in (log := path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s:.0f} s:\n{log[-3000:]}"
        time.sleep(0.2)
    return log


QUARANTINE_WATCH_S = 2.0   # how long the owner is watched with the link down after severing


@pytest.mark.parametrize("unsafe", [False, True], ids=["safe", "unsafe-release-on-sever"])
def test_partition_keeps_pages_quarantined_until_the_writer_acks(two_hosts, tmp_path, unsafe):
    """The link between writer and owner goes down mid-transfer. The owner times out,
    aborts, and at its deadline severs the writer; a remote writer's death cannot be proven,
    so the pages stay quarantined (counted, visible) through the partition. Once the link
    is back, the writer acks and the pages are released. Broken mode
    (--unsafe-release-on-sever): the owner releases at the deadline, with the writer's
    in-flight half still able to land, and the check catches it."""
    (ns_a, dev_a), (ns_b, dev_b) = two_hosts
    tag = "~partition~"
    extra = ("--transfer-timeout", "1", "--abort-deadline", "2", "--request-timeout", "4",
             "--fault", f"at:mid-transfer:pause:{tag}:3",
             *(("--unsafe-release-on-sever",) if unsafe else ()))
    master_port, http_port = free_port(), free_port()
    node0, node1 = tmp_path / "node0.log", tmp_path / "node1.log"
    logs = [open(node0, "wb"), open(node1, "wb")]
    nodes = [_node(ns_a, dev_a, 0, 2, master_port, http_port, logs[0], extra),
             _node(ns_b, dev_b, 1, 1, master_port, http_port, logs[1], extra)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_healthy(ns_a, url, nodes, node0)
        prompt = tag + make_prompt("@9a7t1@", 400)
        waiter = subprocess.Popen(
            ["ip", "netns", "exec", ns_a, sys.executable, "-c",
             "import json,sys,urllib.request,urllib.error\n"
             "req=urllib.request.Request(sys.argv[1],data=sys.argv[2].encode(),headers={'Content-Type':'application/json'})\n"
             "try:\n r=urllib.request.urlopen(req,timeout=30); print(r.status)\n"
             "except urllib.error.HTTPError as e: print(e.code)\n",
             url + "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 400})],
            stdout=subprocess.PIPE, text=True)
        # the first half is written and the rest is in flight: cut the link
        _wait_for(node0, "pause at mid-transfer", 30)
        _ip("-n", ns_b, "link", "set", dev_b, "down")
        log1 = _wait_for(node1, "severed rank 1", 30)
        if unsafe:
            # caught: released at the deadline while the writer was unreachable
            assert "released (unsafe)" in _wait_for(node1, "released (unsafe)", 10)
        else:
            watch_until = time.monotonic() + QUARANTINE_WATCH_S
            while time.monotonic() < watch_until:
                assert "released" not in log1, "pages released while the writer was unreachable"
                time.sleep(0.2)
                log1 = node1.read_text(errors="replace")
        _ip("-n", ns_b, "link", "set", dev_b, "up")
        out, _ = waiter.communicate(timeout=40)
        assert out.strip() and int(out.strip()) != 200
        if not unsafe:
            # released only now, after the link came back: the writer's late ack was the proof
            _wait_for(node1, "released (severed)", 30)
        status, st = _get(ns_a, url + "/status")
        assert status == 200
    finally:
        _stop(nodes, logs)
