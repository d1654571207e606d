"""Abort-to-release time with healthy peers, through a real local cluster, two ways:

- by the owner (decode rank), from the abort's first sign there (its ABORT, or a writer's
  ack that overtook it) to its pages' release;
- from the router's ABORT to the owner's release (``from_router_*``), on one monotonic
  clock (every rank runs on this host). This one also counts the ABORT's way to the
  owner, and what the owner was doing when it arrived (a decode step, say).

Cluster cases, each with ``--requests`` client-cancelled requests sent one at a time:

- ``quarantined``: the writer holds its write before posting (an injected pause), so every
  abort finds the pages quarantined and waits for the writer's ABORT_ACK (which follows its
  flush): the protocol's round trip.
- ``random``: plain requests cancelled after a random 0-30 ms, wherever they are.

And the floor they are read against, ``relay``: the same exchange with none of the
protocol's work, ``--requests`` times. Three processes with the ranks' transfer engines:
the driver (in the router's place, asleep between aborts) sends a message to the writer
and one to the owner, the writer forwards one to the owner, and the owner takes the time
it arrived. Writer and owner poll, as ranks with a request in flight do.

The first few requests of each case warm the endpoints up and are not counted. Prints one
JSON line per case (keys: bench, case, count, p50_ms, p90_ms, p99_ms, max_ms, over_2ms;
the cluster cases also the same with ``from_router_`` in front, and quarantined_share),
then a ``ratio`` line: the quarantined case from the router over the relay, at p50 and
p99.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

from ..router import ABORT_RELEASE_WINDOW, latency_summary
from .faultsuite import post, start
from .localcluster import LocalCluster
from .workload import make_prompt

TAG = "~abort-bench~"


def _wait_idle(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """Until no rank holds pages. The first look comes after 20 ms: a status request sent
    the moment the client hangs up would compete with the abort exchange it measures."""
    deadline = time.monotonic() + timeout_s
    time.sleep(0.02)
    while cluster.held() and time.monotonic() < deadline:
        time.sleep(0.05)


WARMUP = 5


def _summary(values: list[float]) -> dict:
    return {**latency_summary(values), "over_2ms": sum(x > 2.0 for x in values)}


def run_case(cluster: LocalCluster, case: str, n: int, seed: int) -> tuple[dict, dict, dict]:
    """Samples after ``WARMUP`` requests (the first ones also open the endpoints): all
    owners' times, those that waited for acks, and the times from the router's ABORT."""
    rng = random.Random(seed)
    samples_before = router_before = 0
    for i in range(n + WARMUP):
        if i == WARMUP:
            st = cluster.status()
            samples_before = len(st["abort_release"]["recent"])
            router_before = len(st["abort_release"]["recent_from_router"])
        marker = "@" + f"{(seed * 31 + i) & 0xFFFFF:05x}" + "@"
        if case == "quarantined":
            prompt = TAG + make_prompt(marker, 256)
            cancel = 0.05
        else:
            prompt = make_prompt(marker, 256)
            cancel = rng.uniform(0.0, 0.03) + 0.001
        post(cluster, prompt, 256, cancel)
        _wait_idle(cluster)
    st = cluster.status()
    recent = st["abort_release"]["recent"][samples_before:]
    return (
        _summary([ms for _, ms in recent]),
        _summary([ms for how, ms in recent if how != "freed"]),
        _summary(st["abort_release"]["recent_from_router"][router_before:]),
    )


def _relay_child(role: str, transports: str | None, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Writer: forward every b"A" from the driver to the owner. Owner: answer the
    writer's forward with the time it arrived. Both poll, as ranks with work in flight."""
    from kvferry.transfer import TransferConfig, TransferEngine

    engine = TransferEngine(
        TransferConfig(transports=transports, name=f"relay-{role}", max_message_bytes=4 << 20)
    )
    outbox.put(engine.address)
    to = engine.connect(inbox.get())  # writer: the owner; owner: the driver
    received: list[bytes] = []
    engine.set_message_handler(lambda sender, payload: received.append(payload))
    while True:
        engine.progress(0.05, stay_awake=True)
        while received:
            payload = received.pop(0)
            if payload == b"stop":
                engine.shutdown()
                return
            if role == "writer" and payload[:1] == b"A":
                engine.send(to, b"K" + payload[1:])
            elif role == "owner" and payload[:1] == b"K":
                engine.send(to, time.monotonic_ns().to_bytes(8, "little"))


def run_relay(n: int, transports: str | None) -> dict:
    """The relay case (see the module's docstring): milliseconds from the driver's first
    send to the owner's receipt of the forward, on one monotonic clock."""
    from kvferry.transfer import TransferConfig, TransferEngine

    ctx = mp.get_context("spawn")
    queues = {role: (ctx.Queue(), ctx.Queue()) for role in ("writer", "owner")}
    procs = [
        ctx.Process(target=_relay_child, args=(role, transports, *queues[role]), daemon=True)
        for role in queues
    ]
    for proc in procs:
        proc.start()
    engine = TransferEngine(
        TransferConfig(
            transports=transports,
            name="relay-driver",
            max_message_bytes=4 << 20,
            spin_us=0,
            busy_poll_us=0,
        )
    )
    replies: list[bytes] = []
    engine.set_message_handler(lambda sender, payload: replies.append(payload))
    try:
        addresses = {role: q[1].get(timeout=60) for role, q in queues.items()}
        queues["writer"][0].put(addresses["owner"])
        queues["owner"][0].put(engine.address)
        writer, owner = engine.connect(addresses["writer"]), engine.connect(addresses["owner"])
        times: list[float] = []
        for i in range(n + WARMUP):
            time.sleep(0.02)  # as the cluster cases pace their requests
            t0 = time.monotonic_ns()
            engine.send(writer, b"A" + i.to_bytes(4, "little"))
            engine.send(owner, b"X")  # the owner's own ABORT
            deadline = time.monotonic() + 10
            while not replies:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relay: no answer to exchange {i} within 10 s")
                engine.progress(0.05)
            arrived = int.from_bytes(replies.pop(0), "little")
            if i >= WARMUP:
                times.append((arrived - t0) / 1e6)
        for peer in (writer, owner):
            engine.send(peer, b"stop")
        for _ in range(20):
            engine.progress(0.01)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        engine.shutdown()
    return _summary(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry bench-abort", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--transports", choices=["shm", "tcp"], default=None)
    p.add_argument("--log-dir")
    args = p.parse_args(argv)
    if not 0 < args.requests + WARMUP <= ABORT_RELEASE_WINDOW:
        p.error(
            f"--requests {args.requests}: the router keeps the latest "
            f"{ABORT_RELEASE_WINDOW} samples, {WARMUP} of them for the warm-up"
        )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-bench-abort-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--fault", f"at:before-write:pause:{TAG}:1.0"]
    if args.transports:
        extra += ["--transports", args.transports]
    transport = args.transports or "ucx-default"
    relay = run_relay(args.requests, args.transports)
    print(
        json.dumps({"bench": "abort_release", "case": "relay", "transport": transport, **relay}),
        flush=True,
    )
    quarantined_from_router: dict = {}
    for case in ("quarantined", "random"):
        cluster = start(3, extra, log_dir)  # a fresh cluster per case: samples are per case
        try:
            every, quarantined, from_router = run_case(cluster, case, args.requests, seed=7)
        finally:
            cluster.stop()
        s = quarantined if case == "quarantined" else every
        if case == "quarantined":
            quarantined_from_router = from_router
        print(
            json.dumps(
                {
                    "bench": "abort_release",
                    "case": case,
                    "transport": transport,
                    **s,
                    **{f"from_router_{k}": v for k, v in from_router.items()},
                    "quarantined_share": round(
                        quarantined.get("count", 0) / max(1, every.get("count", 0)), 3
                    ),
                }
            ),
            flush=True,
        )
    ratio = {
        f"quarantined_from_router_over_relay_{q}": round(
            quarantined_from_router[f"{q}_ms"] / max(relay[f"{q}_ms"], 1e-3), 2
        )
        for q in ("p50", "p99")
        if f"{q}_ms" in quarantined_from_router and f"{q}_ms" in relay
    }
    print(
        json.dumps({"bench": "abort_release", "case": "ratio", "transport": transport, **ratio}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
