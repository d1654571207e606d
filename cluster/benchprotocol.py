"""The protocol's cost on transfer throughput, with no aborts, against the raw engine in the
same run.

Three processes: a driver (rank 0, in the router's place), a writer and an owner, each with
its own transfer engine; pools of a realistic page shape (``[pages, layers, 2, kv_heads,
page_size, head_dim]`` = [., 8, 2, 8, 16, 128] bf16: 512 KiB pages). Both cases move
requests of ``--pages`` pages between the same two engines, keeping ``--inflight`` requests
in flight: each one finished lets the next one in, as a serving cluster admits work.

- ``raw``: the writer's engine writes the request's pages and notifies; the owner answers
  the notice, which finishes the request.
- ``protocol``: the real PrefillRank and DecodeRank, run by the serving ranks' own loop,
  with the driver sending PREFILL and ASSIGN: allocation, PLAN, the write, the NOTICE after
  the writer's flush, decode of one token, and the request finishes with DONE and RELEASED
  from both ranks. Models are stubs (no compute) and integrity checks are off, so what
  remains is the protocol's own work.

gbps is the bytes of the requests after a warm-up over the time they took. Prints one JSON
line per case (keys: bench, case, requests, inflight, bytes_per_request, gbps, p50_ms: the
median request latency) and one with the ratio protocol/raw.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch

LAYERS, KV_HEADS, PAGE_SIZE, HEAD_DIM = 8, 8, 16, 128
POOL_PAGES = 160


class NullModel:
    """Prefill writes nothing, decode emits token 0: the bench measures the protocol."""

    layers, kv_heads, head_dim, stop_token = LAYERS, KV_HEADS, HEAD_DIM, None

    def prefill(self, kv, tokens, page_row, *, head_range=None) -> None:
        return None

    def decode_step(self, kv, page_table, positions, tokens, prompt_lens) -> torch.Tensor:
        return torch.zeros(len(positions), dtype=torch.int64)


def _pool_config():
    from kvferry.engine.pool import PoolConfig
    return PoolConfig(LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, POOL_PAGES, torch.bfloat16)


def _child(role: str, rank: int, inbox: mp.Queue, outbox: mp.Queue, rounds: int, pages: int,
           inflight: int) -> None:
    from kvferry.engine.pool import KVPool
    from kvferry.transfer import TransferConfig, TransferEngine

    from .decode import DecodeRank
    from .prefill import PrefillRank
    from .rendezvous import RankCard
    from .launch import run_worker
    from .runtime import RankRuntime, freeze_long_lived_objects

    engine = TransferEngine(TransferConfig(transports="shm", name=f"bench-{role}",
                                           max_message_bytes=4 << 20))
    pcfg = _pool_config()
    seg = engine.allocate(pcfg.total_bytes)
    pool = KVPool.from_buffer(pcfg, seg.as_torch())
    pool.kv.view(torch.uint8).view(-1)[:] = rank   # pre-faulted, known bytes
    outbox.put(RankCard(rank=rank, role=role, address=engine.address, incarnation=engine.incarnation,
                        segment=seg.descriptor().pack(), num_pages=pool.num_pages,
                        page_size=PAGE_SIZE, capacity_tokens=pool.capacity_tokens,
                        context_length=pool.capacity_tokens, host=socket.gethostname(),
                        pid=os.getpid()).pack())
    cards = {r: RankCard.unpack(b) for r, b in inbox.get().items()}
    # ---- raw
    received: list = []
    engine.set_message_handler(lambda sender, payload: received.append(
        payload if role == "writer" else (sender, payload)))
    if role == "writer":
        owner = engine.connect(cards[2].address)
        rseg = engine.open_segment(owner, cards[2].segment)
        pb = pool.page_bytes
        sets = []
        for k in range(inflight):
            idx = (np.arange(pages, dtype=np.int64) + k * pages) * pb
            sets.append(np.stack([idx, idx, np.full(pages, pb, dtype=np.int64)], axis=1))
        total, warm = (rounds + 2) * inflight, 2 * inflight
        posted = done = 0
        started: dict[int, float] = {}
        latencies: list[float] = []
        t0 = time.perf_counter()

        def post(i: int) -> None:
            started[i] = time.perf_counter()
            engine.write(owner, seg, rseg, sets[i % inflight])
            engine.notify(owner, i.to_bytes(8, "little"))

        while posted < inflight:
            post(posted)
            posted += 1
        while done < total:
            engine.progress(0.001, stay_awake=True)
            while received:
                i = int.from_bytes(received.pop(), "little")
                done += 1
                if done == warm:
                    t0 = time.perf_counter()
                if done > warm:
                    latencies.append(time.perf_counter() - started[i])
                if posted < total:
                    post(posted)
                    posted += 1
        outbox.put((time.perf_counter() - t0, latencies))
    else:
        deadline = time.monotonic() + 120
        done = 0
        peer = None
        while done < (rounds + 2) * inflight and time.monotonic() < deadline:
            engine.progress(0.001, stay_awake=True)
            while received:
                sender, payload = received.pop(0)
                peer = peer or engine.connect(sender)
                engine.send(peer, payload)     # the ack names the request
                done += 1
    inbox.get()                      # the driver says: protocol phase
    rt = RankRuntime(rank, engine, cards)
    freeze_long_lived_objects()   # as a serving rank does (launch.py)
    if role == "writer":
        worker = PrefillRank(rt, NullModel(), pool, seg, (0, KV_HEADS), router=0, integrity=False)
    else:
        worker = DecodeRank(rt, NullModel(), pool, router=0, transfer_timeout_s=30,
                            abort_deadline_s=5, integrity=False)
    stop = []
    handler = worker.on_message
    rt.set_handler(lambda msg: stop.append(1) if msg.kind == "SHUTDOWN" else handler(msg))
    rt.faults = rt.faults  # no fault hooks
    outbox.put("ready")
    run_worker(rt, worker, decode=(role == "owner"), stopped=lambda: bool(stop))
    engine.shutdown()


def _drive_protocol(rt, m, cards, tokens: bytes, args) -> tuple[float, list[float]]:
    """Keep ``args.inflight`` requests in the protocol: each one finished (DONE from the
    owner, RELEASED from both ranks) lets the next one in. Returns the time the requests
    after the warm-up took, and their latencies."""
    total, warm = (args.requests + 2) * args.inflight, 2 * args.inflight
    started: dict[str, float] = {}
    seen: dict[str, set] = {}
    latencies: list[float] = []
    posted = done = 0
    t0 = time.perf_counter()

    def on_message(msg) -> None:
        nonlocal done, posted, t0
        if msg.kind == "DONE" and msg.outcome != "finished":
            raise RuntimeError(f"request {msg.rid}: {msg.outcome} {msg.error}")
        if msg.kind not in ("DONE", "RELEASED") or msg.rid not in seen:
            return
        marks = seen[msg.rid]
        marks.add((msg.kind, msg.src))
        if len(marks) < 3:    # DONE from the owner, RELEASED from the writer and the owner
            return
        del seen[msg.rid]
        done += 1
        if done == warm:
            t0 = time.perf_counter()
        if done > warm:
            latencies.append(time.perf_counter() - started[msg.rid])
        if posted < total:
            post(posted)
            posted += 1

    def post(i: int) -> None:
        rid = f"bench-{i}"
        started[rid], seen[rid] = time.perf_counter(), set()
        rt.send(1, m.PREFILL, rid=rid, tokens=tokens, owner=2, owner_inc=cards[2].incarnation)
        rt.send(2, m.ASSIGN, rid=rid, prompt_len=args.pages * PAGE_SIZE, max_tokens=1,
                writers=[1], last_token=0)

    rt.set_handler(on_message)
    while posted < args.inflight:
        post(posted)
        posted += 1
    deadline = time.monotonic() + 60 + total
    while done < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{total - done} requests did not finish: {sorted(seen)[:5]}")
        rt.pump(0)                 # as the router's loop does (launch.serve_router)
        time.sleep(0.0005)
    return time.perf_counter() - t0, latencies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry bench-protocol", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--pages", type=int, default=32, help="pages per request (512 KiB each)")
    p.add_argument("--inflight", type=int, default=4,
                   help="requests kept in flight (raw: write + notify pairs)")
    args = p.parse_args(argv)
    from kvferry.transfer import TransferConfig, TransferEngine
    from . import messages as m
    from .rendezvous import RankCard
    from .runtime import RankRuntime

    ctx = mp.get_context("spawn")
    queues = {r: (ctx.Queue(), ctx.Queue()) for r in (1, 2)}
    procs = [ctx.Process(target=_child, args=(role, r, queues[r][0], queues[r][1], args.requests,
                                              args.pages, args.inflight))
             for role, r in (("writer", 1), ("owner", 2))]
    for proc in procs:
        proc.start()
    engine = TransferEngine(TransferConfig(transports="shm", name="bench-driver", max_message_bytes=4 << 20))
    cards = {0: RankCard(rank=0, role="router", address=engine.address, incarnation=engine.incarnation,
                         segment=None, num_pages=0, page_size=PAGE_SIZE, capacity_tokens=0,
                         context_length=0, host=socket.gethostname(), pid=os.getpid())}
    for r in (1, 2):
        cards[r] = RankCard.unpack(queues[r][1].get(timeout=120))
    packed = {r: c.pack() for r, c in cards.items()}
    for r in (1, 2):
        queues[r][0].put(packed)
    raw = queues[1][1].get(timeout=300)
    for r in (1, 2):
        queues[r][0].put("protocol")
    for r in (1, 2):
        assert queues[r][1].get(timeout=60) == "ready"
    rt = RankRuntime(0, engine, cards)
    tokens = np.zeros(args.pages * PAGE_SIZE, dtype="<i4").tobytes()
    proto = _drive_protocol(rt, m, cards, tokens, args)
    for r in (1, 2):
        rt.send(r, m.SHUTDOWN)
    for _ in range(100):
        rt.pump(0.01)
    for proc in procs:
        proc.join(timeout=20)
    engine.shutdown()
    request_bytes = args.pages * LAYERS * 2 * KV_HEADS * PAGE_SIZE * HEAD_DIM * 2
    rows = {}
    for case, (elapsed, latencies) in (("raw", raw), ("protocol", proto)):
        rows[case] = len(latencies) * request_bytes / elapsed / 1e9
        print(json.dumps({"bench": "protocol_cost", "case": case, "requests": len(latencies),
                          "inflight": args.inflight, "bytes_per_request": request_bytes,
                          "gbps": round(rows[case], 3),
                          "p50_ms": round(1e3 * statistics.median(latencies), 3)}), flush=True)
    print(json.dumps({"bench": "protocol_cost", "case": "ratio",
                      "protocol_over_raw": round(rows["protocol"] / rows["raw"], 4)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
