"""Measures the service times of :mod:`.service` on this machine, from the real code:

- ``decode_step``: the real :meth:`DecodeRank.step` (the replay model, the KV pool and the
  integrity checks of a cluster with the fault suite's settings) for batches of 1 to 32
  requests of 256-token prompts; fitted as ``base + per_seq * batch`` (least squares on
  the medians), and the spread around that line as a log-normal sigma;
- ``prefill``: the real :meth:`PrefillPath.solo_steps` (the prefill and the
  checksums of one writer's heads) for prompts of 64 to 2,048 tokens; fitted as
  ``base + per_token * tokens``;
- ``message``: a rank's cost of one control message, by role: the real codec's encode of
  every message it sends and decode of the one it got, and the rank's real handler (the
  simulator's ranks run the service's handlers; the router's are :class:`SimRouter`'s,
  which keep :class:`Router`'s books), timed in a 2x2 simulator run; fitted as a
  log-normal (median, and sigma from the median and p90) with the share and mean of
  what lies past p99 as its tail;
- ``wake``: how long a process sleeping on a file descriptor (a rank idle on its
  engine's event fd, the router's asyncio loop with ``add_reader``) takes to run after
  another process wrote to it, on one monotonic clock.

``python -m kvferry.cluster.harness.simulate --calibrate`` prints one JSON line with the
fitted numbers; :data:`.service.MEASURED` holds the ones the simulator uses.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing as mp
import os
import select
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np


def _q(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def fit_lognormal(values_s: list[float]) -> dict[str, float]:
    """Median and sigma (from the median and p90) of the body; the share past p99 and
    its mean excess over the body's p99 as the tail, in microseconds."""
    med, p90, p99 = _q(values_s, 0.5), _q(values_s, 0.9), _q(values_s, 0.99)
    sigma = max(0.05, math.log(max(p90, med * 1.0001) / med) / 1.2816)
    tail = [v - p99 for v in values_s if v > p99]
    return {
        "median_us": round(med * 1e6, 2),
        "sigma": round(sigma, 3),
        "tail_p": round(len(tail) / len(values_s), 4),
        "tail_mean_us": round(1e6 * statistics.fmean(tail), 1) if tail else 0.0,
        "p99_us": round(p99 * 1e6, 1),
        "n": len(values_s),
    }


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    a = np.vstack([np.ones(len(xs)), np.asarray(xs, dtype=float)]).T
    (base, slope), *_ = np.linalg.lstsq(a, np.asarray(ys, dtype=float), rcond=None)
    return float(base), float(slope)


# ---------------------------------------------------------------------- the real ranks
class _StubRuntime:
    """What DecodeRank/PrefillRank need of a runtime to run a step off the network."""

    rank = 2

    def __init__(self) -> None:
        from kvferry.cluster.faults import FaultHooks

        self.faults = FaultHooks()
        self.cards: dict[int, Any] = {}
        self.sent = 0

    def set_handlers(self, handlers, role) -> None:
        return None

    def send(self, rank, kind, **fields) -> None:
        self.sent += 1

    def defer(self, fn, rid=None) -> None:
        fn()

    def run_for(self, rid, what, fn) -> None:
        fn()


def _cluster_parts():
    from kvferry.cluster.config import ServeConfig
    from kvferry.cluster.models import build_model, pool_config
    from kvferry.engine.pool import KVPool

    from ..faultsuite import CONTEXT
    from .scenarios import SUITE_POOL_TOKENS

    cfg = ServeConfig(context_length=CONTEXT, pool_tokens=SUITE_POOL_TOKENS)
    model = build_model(cfg)
    return cfg, model, KVPool(pool_config(cfg, model))


def decode_steps(batches=(1, 2, 4, 8, 16, 32), rounds: int = 60) -> dict[str, Any]:
    from kvferry.cluster.decode import DecodeRank, OwnedRequest
    from kvferry.engine.integrity import expected_canaries
    from kvferry.engine.protocol.owner import OwnerState

    cfg, model, pool = _cluster_parts()
    per_batch: dict[int, list[float]] = {}
    for n in batches:
        rank = DecodeRank.serving(
            _StubRuntime(),  # type: ignore[arg-type]
            model,
            pool,
            0,
            transfer_timeout_s=1.0,
            abort_deadline_s=2.0,
        )
        for i in range(n):
            rid = f"cal-{n}-{i}"
            req = OwnedRequest(rid, 256, 10_000, [1], 7)
            req.grants = rank.allocator.allocate(rid, (256 + 256) // cfg.page_size)
            rank.path.canaries.stamp(req.pages, expected_canaries(rid, req.grants))  # type: ignore[attr-defined]
            model.prefill(pool.kv, list(range(256)), req.pages[: 256 // cfg.page_size])
            req.book.state = OwnerState.DECODING
            rank.reqs[rid] = req
        times = []
        for r in range(rounds + 5):
            t0 = time.perf_counter()
            rank.step()
            if r >= 5:
                times.append(time.perf_counter() - t0)
        per_batch[n] = times
    base, per_seq = fit_line(list(per_batch), [statistics.median(v) for v in per_batch.values()])
    ratios = [t / (base + per_seq * n) for n, v in per_batch.items() for t in v]
    return {
        "base_ms": round(base * 1e3, 4),
        "per_seq_ms": round(per_seq * 1e3, 4),
        "sigma": fit_lognormal(ratios)["sigma"],  # the spread around the fitted line
        "median_ms": {n: round(1e3 * statistics.median(v), 3) for n, v in per_batch.items()},
    }


def prefills(tokens=(64, 256, 1024, 2048), rounds: int = 40) -> dict[str, Any]:
    from kvferry.cluster.prefill import PrefillRank, WriteJob
    from kvferry.engine.protocol.writer import WriterState

    _, model, pool = _cluster_parts()
    per_len: dict[int, list[float]] = {}
    stub: Any = _StubRuntime()
    rank = PrefillRank.serving(
        stub, model, pool, stub, (0, model.kv_heads), 0
    )  # no segment is read
    for n in tokens:
        times = []
        for r in range(rounds + 3):
            job = WriteJob(f"cal-{n}-{r}")
            job.book.state = WriterState.COMPUTING
            job.tokens = (np.arange(n) % 500).astype(np.int32)
            job.src_pages = rank.allocator.allocate_pages(job.rid, -(-n // 16))
            t0 = time.perf_counter()
            for _ in rank.path.solo_steps(job):  # type: ignore[attr-defined]
                pass
            if r >= 3:
                times.append(time.perf_counter() - t0)
            rank.allocator.free(job.rid)
        per_len[n] = times
    base, per_token = fit_line(list(per_len), [statistics.median(v) for v in per_len.values()])
    return {
        "base_ms": round(base * 1e3, 4),
        "per_token_us": round(per_token * 1e6, 4),
        "median_ms": {n: round(1e3 * statistics.median(v), 3) for n, v in per_len.items()},
    }


# ---------------------------------------------------------------------- messages
def messages(requests: int = 300) -> dict[str, Any]:
    """Each role's cost of a message: codec and handler, timed in a simulator run (see
    SimRuntime's ``profile``)."""
    from .scenarios import build
    from .world import World, quiet_logs

    sc = build("steady", "10x10", requests=requests, seed=3, service=False)
    with quiet_logs():
        world = World(sc)
        world.profile = defaultdict(list)
        world.run()
    out = {}
    for role, values in sorted(world.profile.items()):
        out[role] = fit_lognormal(values)
    return out


# ---------------------------------------------------------------------- wake-ups
def _writer(fd: int, n: int, gap_s: float) -> None:
    for _ in range(n):
        time.sleep(gap_s)
        os.write(fd, time.monotonic_ns().to_bytes(8, "little"))


def _stamps(fd: int, n: int, wait) -> list[float]:
    out = []
    for _ in range(n):
        wait()
        data = os.read(fd, 8)
        out.append((time.monotonic_ns() - int.from_bytes(data, "little")) / 1e9)
    return out


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _asyncio_stamps(fd: int, n: int) -> list[float]:
    """As the router's loop waits (EngineWaker: add_reader on the engine's fd)."""
    lp = asyncio.get_running_loop()
    out = []
    for _ in range(n):
        fut: asyncio.Future[None] = lp.create_future()
        lp.add_reader(fd, _settle, fut)
        await fut
        lp.remove_reader(fd)
        data = os.read(fd, 8)
        out.append((time.monotonic_ns() - int.from_bytes(data, "little")) / 1e9)
    return out


def _wake(how: str, n: int, gap_s: float) -> list[float]:
    ctx = mp.get_context("fork")  # the child writes to the pipe it inherits
    r, w = os.pipe()
    proc = ctx.Process(target=_writer, args=(w, n, gap_s), daemon=True)
    proc.start()
    try:
        if how == "select":
            return _stamps(r, n, functools.partial(select.select, [r], [], []))
        return asyncio.run(_asyncio_stamps(r, n))
    finally:
        proc.join()
        os.close(r)
        os.close(w)


def wakeups(n: int = 300, gap_s: float = 0.005) -> dict[str, Any]:
    return {how: fit_lognormal(_wake(how, n, gap_s)[10:]) for how in ("select", "asyncio")}


def main() -> dict[str, Any]:
    import json

    out = {
        "bench": "simulate-calibrate",
        "decode_step": decode_steps(),
        "prefill": prefills(),
        "message": messages(),
        "wake": wakeups(),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
