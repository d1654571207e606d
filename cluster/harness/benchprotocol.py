"""The protocol's cost on transfer throughput, with no aborts, against the raw engine in the
same run.

Three processes: a driver (rank 0, in the router's place), a writer and an owner, each with
its own transfer engine; pools of a realistic page shape (``[pages, layers, 2, kv_heads,
page_size, head_dim]`` = [., 8, 2, 8, 16, 128] bf16: 512 KiB pages). Both cases move
requests of ``--pages`` pages between the same two engines, keeping ``--inflight`` requests
in flight: each one finished lets the next one in, as a serving cluster admits work.

- ``raw``: the writer's engine writes the request's pages and notifies; the owner answers
  the notice, which finishes the request. Pages are taken as the ranks' allocators hand
  them out (the lowest free ones of each pool, held until the request finishes), so both
  cases move the same pages.
- ``protocol``: the real PrefillRank and DecodeRank, run by the serving ranks' own loop,
  with the driver sending PREFILL and ASSIGN: allocation, PLAN, the write, the NOTICE after
  the writer's flush, decode of one token, and the request finishes with DONE and RELEASED
  from both ranks. Models are stubs (no compute) and integrity checks are off, so what
  remains is the protocol's own work.

The cases alternate for ``--cycles`` cycles (raw, protocol, raw, ...), so that drift in the
machine's speed hits both alike. With two or more CPUs the writer runs on CPU 0 and the
owner and the driver on CPU 1, in both cases: ranks get cores of their own when deployed.
gbps is the bytes of a cycle's requests in its steady state (after a warm-up, before the
drain of the last ``--inflight``: :class:`Window`) over the time they took; each
case's line gives the median over cycles, and the ratio line the median of the per-cycle
ratios protocol/raw. Prints one JSON line per case (keys: bench, case, cycles, requests,
inflight, bytes_per_request, gbps, gbps_per_cycle, p50_ms: the median request latency)
and one with the ratio.

Every rank runs with a cluster secret (each control message MAC'd). ``--compare-mac`` adds
a third case to each cycle, ``protocol_unauthenticated``: the same ranks with a stand-in
trust that seals and checks nothing (it exists in this bench only, to price the MAC), and
a ``mac_cost`` line with the median per-cycle ratio protocol/protocol_unauthenticated.
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
from dataclasses import dataclass, field

import numpy as np
import torch

from kvferry.engine.protocol.words import Kind
from kvferry.engine.stepwise import PrefillByLayers

LAYERS, KV_HEADS, PAGE_SIZE, HEAD_DIM = 8, 8, 16, 128
PAGE_BYTES = LAYERS * 2 * KV_HEADS * PAGE_SIZE * HEAD_DIM * 2  # bf16: 512 KiB
# Each case's window moves at least this much (a 16 MiB request takes about 2 ms here:
# 60 of them would be a window of 0.15 s, at the mercy of one scheduling hiccup).
WINDOW_BYTES, MIN_REQUESTS = 4 << 30, 60
WRITER, OWNER = 1, 2


def _no_mac():
    """BENCH ONLY: a trust that adds no tag and checks none, to price the MAC against."""
    from ..trust import Trust

    class NoMac(Trust):
        def __init__(self) -> None:
            pass

        def seal(self, dst: int, dst_incarnation: int, data: bytes) -> bytes:
            return data

        def opener(self, dst: int, dst_incarnation: int):
            return bytes

    return NoMac()


def _use_trust(rt, trust) -> None:
    rt.trust, rt._open = trust, None  # the runtime derives its opener again at the next message


class NullModel(PrefillByLayers):
    """Prefill writes nothing and its first token is 0, decode emits token 0: the bench
    measures the protocol."""

    layers, kv_heads, head_dim, stop_token = LAYERS, KV_HEADS, HEAD_DIM, None
    prefill_chunk_tokens = None  # every layer written whole: no part to pipeline

    def prefill_layers(self, kv, tokens, page_row, *, head_range=None):
        yield from range(self.layers)
        return 0

    def decode_step(self, kv, page_table, positions, tokens, prompt_lens) -> torch.Tensor:
        return torch.zeros(len(positions), dtype=torch.int64)


@dataclass
class Window:
    """The steady state of a closed loop of ``total`` requests: the completions after the
    first ``warm`` and up to the ``last``-th, each of which let another request in.

    The ``total - last`` completions after it are the drain: no request follows them,
    and in the raw case the writer had copied those requests' bytes before they finished
    (its writes are done when posted), so they arrive for free; counted, they would
    credit the raw case with bytes it moved before the window opened."""

    warm: int
    last: int
    opened: float = 0.0
    closed: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def finished(self, done: int, latency: float) -> None:
        """The ``done``-th completion, ``latency`` seconds after its request started."""
        now = time.perf_counter()
        if done == self.warm:
            self.opened = now
        elif self.warm < done <= self.last:
            self.latencies.append(latency)
            if done == self.last:
                self.closed = now

    def result(self) -> tuple[float, list[float]]:
        """(seconds the window lasted, latencies of its requests)."""
        return self.closed - self.opened, self.latencies


def _pool_config(pages: int):
    from kvferry.engine.pool import PoolConfig

    return PoolConfig(LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, pages, torch.bfloat16)


def _pin(cpu: int) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {cpu})


def _raw_writer(
    engine,
    owner,
    seg,
    rseg,
    pool,
    received: list,
    total: int,
    window: Window,
    pages: int,
    inflight: int,
) -> tuple[float, list[float]]:
    from kvferry.engine.allocator import PageAllocator

    pb = pool.page_bytes
    src_pages, dst_pages = PageAllocator(pool.num_pages), PageAllocator(pool.num_pages)
    started: dict[int, float] = {}
    posted = done = 0

    def post(i: int) -> None:
        started[i] = time.perf_counter()
        src = np.array([g.page for g in src_pages.allocate(str(i), pages)], dtype=np.int64)
        dst = np.array([g.page for g in dst_pages.allocate(str(i), pages)], dtype=np.int64)
        triples = np.stack([src * pb, dst * pb, np.full(pages, pb, dtype=np.int64)], axis=1)
        engine.write(owner, seg, rseg, triples)
        engine.notify(owner, i.to_bytes(8, "little"))

    while posted < inflight:
        post(posted)
        posted += 1
    deadline = time.monotonic() + 60 + total
    while done < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"raw: {total - done} requests not acked")
        engine.progress(0.001, stay_awake=True)
        while received:
            i = int.from_bytes(received.pop(0), "little")
            src_pages.free(str(i))
            dst_pages.free(str(i))
            done += 1
            window.finished(done, time.perf_counter() - started[i])
            if posted < total:
                post(posted)
                posted += 1
    return window.result()


def _raw_owner(engine, received: list, total: int) -> None:
    peer = None
    done = 0
    deadline = time.monotonic() + 60 + total
    while done < total and time.monotonic() < deadline:
        engine.progress(0.001, stay_awake=True)
        while received:
            sender, payload = received.pop(0)
            peer = peer or engine.connect(sender)
            engine.send(peer, payload)  # the ack names the request
            done += 1


def _child(
    role: str,
    rank: int,
    inbox: mp.Queue,
    outbox: mp.Queue,
    pool_pages: int,
    inflight: int,
    secret: str,
) -> None:
    from kvferry.engine.pool import KVPool
    from kvferry.transfer import TransferConfig, TransferEngine

    from ..decode import DecodeRank
    from ..launch import freeze_long_lived_objects, run_worker
    from ..prefill import PrefillRank
    from ..rendezvous import RankCard
    from ..runtime import RankRuntime
    from ..topology import Role
    from ..trust import Trust

    _pin(0 if role == "writer" else 1)
    engine = TransferEngine(
        TransferConfig(transports="shm", name=f"bench-{role}", max_message_bytes=4 << 20)
    )
    pcfg = _pool_config(pool_pages)
    seg = engine.allocate(pcfg.total_bytes)
    pool = KVPool.from_buffer(pcfg, seg.as_torch())
    pool.kv.view(torch.uint8).view(-1)[:] = rank  # pre-faulted, known bytes
    outbox.put(
        RankCard(
            rank=rank,
            role=Role.PREFILL if role == "writer" else Role.DECODE,
            address=engine.address,
            incarnation=engine.incarnation,
            segment=seg.descriptor().pack(),
            num_pages=pool.num_pages,
            page_size=PAGE_SIZE,
            capacity_tokens=pool.capacity_tokens,
            context_length=pool.capacity_tokens,
            host=socket.gethostname(),
            pid=os.getpid(),
        ).pack()
    )
    cards = {r: RankCard.unpack(b) for r, b in inbox.get().items()}
    received: list = []

    def on_raw(sender: bytes, payload: bytes) -> None:
        received.append(payload if role == "writer" else (sender, payload))

    owner = rseg = None
    if role == "writer":
        owner = engine.connect(cards[OWNER].address)
        descriptor = cards[OWNER].segment
        assert descriptor is not None, "the owner publishes its pool segment"
        rseg = engine.open_segment(owner, descriptor)
    trust = Trust(secret.encode())
    rt = RankRuntime(rank, engine, cards, trust=trust)
    worker: PrefillRank | DecodeRank
    if role == "writer":
        worker = PrefillRank.serving(
            rt, NullModel(), pool, seg, (0, KV_HEADS), router=0, integrity=False
        )
    else:
        worker = DecodeRank.serving(
            rt,
            NullModel(),
            pool,
            router=0,
            transfer_timeout_s=30,
            abort_deadline_s=5,
            integrity=False,
        )
    stop: list = []
    rt.set_handlers({**worker.handlers, Kind.SHUTDOWN: lambda msg: stop.append(1)}, role=role)
    freeze_long_lived_objects()  # as a serving rank does (launch.py)
    while (cmd := inbox.get()) != "stop":
        case, pages, total, warm = cmd
        cpu0 = time.process_time()
        if case == "raw":
            engine.set_message_handler(on_raw)
            outbox.put("ready")
            if role == "writer":
                outbox.put(
                    _raw_writer(
                        engine,
                        owner,
                        seg,
                        rseg,
                        pool,
                        received,
                        total,
                        Window(warm, total - inflight),
                        pages,
                        inflight,
                    )
                )
            else:
                _raw_owner(engine, received, total)
        else:
            _use_trust(rt, _no_mac() if case == "protocol_unauthenticated" else trust)
            engine.set_message_handler(rt._on_payload)
            stop.clear()
            outbox.put("ready")
            run_worker(rt, worker, decode=(role == "owner"), stopped=lambda: bool(stop))
        outbox.put(time.process_time() - cpu0)
    engine.shutdown()


def _drive_protocol(
    rt,
    m,
    cards,
    tokens: bytes,
    total: int,
    window: Window,
    pages: int,
    inflight: int,
    phase_tag: str,
) -> tuple[float, list[float]]:
    """Keep ``inflight`` requests in the protocol: each one finished (DONE from the owner,
    RELEASED from both ranks) lets the next one in. Request ids carry ``phase_tag`` (ids
    never repeat across phases). Returns the time the window's requests took, and their
    latencies."""
    started: dict[str, float] = {}
    seen: dict[str, set] = {}
    failed: list[str] = []
    posted = done = 0

    def on_message(msg) -> None:
        nonlocal done, posted
        if msg.kind == "DONE" and msg.outcome != "finished":
            failed.append(f"request {msg.rid}: {msg.outcome} {msg.error}")
        if msg.kind not in ("DONE", "RELEASED") or msg.rid not in seen:
            return
        marks = seen[msg.rid]
        marks.add((msg.kind, msg.src))
        if len(marks) < 3:  # DONE from the owner, RELEASED from the writer and the owner
            return
        del seen[msg.rid]
        done += 1
        window.finished(done, time.perf_counter() - started[msg.rid])
        if posted < total:
            post(posted)
            posted += 1

    def post(i: int) -> None:
        rid = f"bench-{phase_tag}-{i}"
        started[rid], seen[rid] = time.perf_counter(), set()
        rt.send(
            WRITER,
            m.PREFILL,
            rid=rid,
            tokens=tokens,
            offset=0,
            total=len(tokens) // 4,
            owner=OWNER,
            owner_inc=cards[OWNER].incarnation,
        )
        rt.send(
            OWNER,
            m.ASSIGN,
            rid=rid,
            prompt_len=pages * PAGE_SIZE,
            max_tokens=1,
            writers=[WRITER],
            last_token=0,
        )

    rt.set_handlers({k: on_message for k in Kind}, role="router")
    while posted < inflight:
        post(posted)
        posted += 1
    deadline = time.monotonic() + 60 + total
    while done < total:
        if failed:
            raise RuntimeError(failed[0])
        if time.monotonic() > deadline:
            raise RuntimeError(f"{total - done} requests did not finish: {sorted(seen)[:5]}")
        rt.pump(0.05)
    return window.result()


def _report(
    results: dict[str, list[tuple[float, list[float]]]],
    cpu: dict[str, dict[str, list[float]]],
    pages: int,
    requests: int,
    args,
) -> None:
    request_bytes = pages * PAGE_BYTES
    rates: dict[str, list[float]] = {}
    for case, runs in results.items():
        rates[case] = [len(lat) * request_bytes / elapsed / 1e9 for elapsed, lat in runs]
        print(
            json.dumps(
                {
                    "bench": "protocol_cost",
                    "case": case,
                    "cycles": args.cycles,
                    "requests": requests,
                    "inflight": args.inflight,
                    "pages_per_request": pages,
                    "bytes_per_request": request_bytes,
                    "gbps": round(statistics.median(rates[case]), 3),
                    "gbps_per_cycle": [round(x, 3) for x in rates[case]],
                    "p50_ms": round(
                        1e3 * statistics.median([x for _, lat in runs for x in lat]), 3
                    ),
                    "cpu_ms_per_request": {
                        role: round(1e3 * statistics.median(v), 3) for role, v in cpu[case].items()
                    },
                }
            ),
            flush=True,
        )
    if "protocol_unauthenticated" in rates:
        costs = [
            pr / ur
            for pr, ur in zip(rates["protocol"], rates["protocol_unauthenticated"], strict=True)
        ]
        print(
            json.dumps(
                {
                    "bench": "protocol_cost",
                    "case": "mac_cost",
                    "pages_per_request": pages,
                    "protocol_over_unauthenticated": round(statistics.median(costs), 4),
                    "per_cycle": [round(x, 4) for x in costs],
                }
            ),
            flush=True,
        )
    ratios = [pr / rr for pr, rr in zip(rates["protocol"], rates["raw"], strict=True)]
    print(
        json.dumps(
            {
                "bench": "protocol_cost",
                "case": "ratio",
                "pages_per_request": pages,
                "bytes_per_request": request_bytes,
                "protocol_over_raw": round(statistics.median(ratios), 4),
                "per_cycle": [round(x, 4) for x in ratios],
            }
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry bench-protocol", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests measured per case and cycle, between the warm-up and the drain "
        "(default: enough for 4 GiB, at least 60)",
    )
    p.add_argument(
        "--pages",
        default="32,128,512",
        help="pages per request (512 KiB each), one comparison per value",
    )
    p.add_argument(
        "--inflight",
        type=int,
        default=4,
        help="requests kept in flight (raw: write + notify pairs)",
    )
    p.add_argument("--cycles", type=int, default=7, help="raw/protocol alternations")
    p.add_argument(
        "--compare-mac",
        action="store_true",
        help="also run the protocol with no message MAC in each cycle, and print its cost",
    )
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.pages.split(",")]
    pool_pages = (max(sizes) + 1) * args.inflight  # + the page decode writes into
    from kvferry.transfer import TransferConfig, TransferEngine

    from .. import messages as m
    from ..launch import freeze_long_lived_objects
    from ..rendezvous import RankCard
    from ..runtime import RankRuntime
    from ..topology import Role
    from ..trust import Trust, generate_secret

    secret = generate_secret()  # the bench's own cluster secret, as a serving cluster has
    warm = 2 * args.inflight
    ctx = mp.get_context("spawn")
    queues = {r: (ctx.Queue(), ctx.Queue()) for r in (WRITER, OWNER)}
    procs = [
        ctx.Process(
            target=_child,
            args=(
                role,
                r,
                queues[r][0],
                queues[r][1],
                pool_pages,
                args.inflight,
                secret,
            ),
        )
        for role, r in (("writer", WRITER), ("owner", OWNER))
    ]
    for proc in procs:
        proc.start()
    _pin(1)
    # The driver sleeps on its event fd between messages, as the router does (it never
    # polls): on two cores, polling here would take CPU from the owner beside it.
    engine = TransferEngine(
        TransferConfig(
            transports="shm",
            name="bench-driver",
            max_message_bytes=4 << 20,
            spin_us=0,
            busy_poll_us=0,
        )
    )
    cards = {
        0: RankCard(
            rank=0,
            role=Role.ROUTER,
            address=engine.address,
            incarnation=engine.incarnation,
            segment=None,
            num_pages=0,
            page_size=PAGE_SIZE,
            capacity_tokens=0,
            context_length=0,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
    }
    for r in (WRITER, OWNER):
        cards[r] = RankCard.unpack(queues[r][1].get(timeout=120))
    packed = {r: c.pack() for r, c in cards.items()}
    for r in (WRITER, OWNER):
        queues[r][0].put(packed)
    trust = Trust(secret.encode())
    rt = RankRuntime(0, engine, cards, trust=trust)
    freeze_long_lived_objects()  # as the router does (launch.py)

    def phase(cmd: tuple[str, int, int, int]) -> None:
        for r in (WRITER, OWNER):
            queues[r][0].put(cmd)
        for r in (WRITER, OWNER):
            if queues[r][1].get(timeout=120) != "ready":
                raise RuntimeError(f"rank {r} did not start the {cmd[0]} phase")

    for pages in sizes:
        requests = args.requests or max(MIN_REQUESTS, -(-WINDOW_BYTES // (pages * PAGE_BYTES)))
        total = warm + requests + args.inflight  # the last in flight: the drain
        tokens = np.zeros(pages * PAGE_SIZE, dtype="<i4").tobytes()
        results: dict[str, list[tuple[float, list[float]]]] = {"raw": [], "protocol": []}
        if args.compare_mac:
            results["protocol_unauthenticated"] = []
        cpu: dict[str, dict[str, list[float]]] = {
            case: {"writer": [], "owner": [], "driver": []} for case in results
        }

        def phase_cpu(case: str, driver_s: float, cpu: dict = cpu, total: int = total) -> None:
            for r, role in ((WRITER, "writer"), (OWNER, "owner")):
                cpu[case][role].append(queues[r][1].get(timeout=120) / total)
            cpu[case]["driver"].append(driver_s / total)

        for cycle in range(args.cycles):
            phase(("raw", pages, total, warm))
            results["raw"].append(queues[WRITER][1].get(timeout=600))
            phase_cpu("raw", 0.0)
            for case in [c for c in results if c != "raw"]:
                phase((case, pages, total, warm))
                _use_trust(rt, _no_mac() if case == "protocol_unauthenticated" else trust)
                c0 = time.process_time()
                results[case].append(
                    _drive_protocol(
                        rt,
                        m,
                        cards,
                        tokens,
                        total,
                        Window(warm, total - args.inflight),
                        pages,
                        args.inflight,
                        f"{pages}p-{cycle}-{case}",
                    )
                )
                driver_s = time.process_time() - c0
                for r in (WRITER, OWNER):
                    rt.send(r, m.SHUTDOWN)  # ends the phase's serving loop
                phase_cpu(case, driver_s)
        _report(results, cpu, pages, requests, args)
    for r in (WRITER, OWNER):
        queues[r][0].put("stop")
    for _ in range(50):
        rt.pump(0.01)
    for proc in procs:
        proc.join(timeout=20)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
