"""Reshard benchmark on the CPU: one JSON line per shape pair (prefill -> decode).

For one request of ``--tokens`` tokens (default 32,768) at a realistic shape (default 8
layers, 8 KV heads, head dim 128, bf16: 1 GiB of KV), per pair of pool layouts:

- ``plan_ms``: :func:`kvferry.engine.reshard.plan` for the request (median of ``--reps``,
  after a warm-up), random page tables on every rank; ``runs``, ``pairs`` (writer, owner)
  and ``mean_run_bytes`` of the plan it makes;
- ``apply_gbps``: bytes per second of applying the runs with numpy slice copies in this
  one process (one copy per run, a Python loop: per-run overhead shows, as it does for a
  transfer engine's per-descriptor cost), pools of exactly the pages used;
- ``homogeneous_gbps``: the same for the homogeneous pair of the same total bytes (the
  prefill's TP and page size on both sides, HND -> HND, tokens scaled when the pair
  replicates heads), timed in alternation with the pair in the same run (pair, homogeneous,
  pair, ...; medians), and ``ratio`` = apply_gbps / homogeneous_gbps (the goal of issue 28
  is >= 0.9).

The first line gives the host's load: the figures are noisy on a shared machine.
Run with ``python -m kvferry.engine.tools.bench_reshard``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvferry.engine.reshard import KVShape, Order, PoolLayout, ReshardPlan, plan, rank_geometry
from kvferry.engine.tools.bench_checksum import median_seconds

HND, NHD = Order.HND, Order.NHD
MLA_DIM = 576  # DeepSeek-style latent: 512 + 64 rope dims, one replicated "head"


@dataclass(frozen=True)
class Pair:
    src: PoolLayout
    dst: PoolLayout
    replicated: bool = False


def default_pairs() -> list[Pair]:
    """All nine TP pairs, the page-size and order mismatches, one replicated (MLA) KV."""
    tps = [Pair(PoolLayout(p, 16), PoolLayout(d, 16)) for p in (1, 2, 4) for d in (1, 2, 4)]
    pages = [
        Pair(PoolLayout(2, s), PoolLayout(2, d))
        for s, d in ((16, 32), (32, 16), (16, 64), (64, 16))
    ]
    orders = [
        Pair(PoolLayout(2, 16, s), PoolLayout(2, 16, d))
        for s, d in ((HND, NHD), (NHD, HND), (NHD, NHD))
    ]
    mixed = [
        Pair(PoolLayout(4, 16, HND), PoolLayout(2, 64, HND)),
        Pair(PoolLayout(1, 64, HND), PoolLayout(4, 16, NHD)),
        Pair(PoolLayout(4, 16, HND), PoolLayout(2, 32, HND), replicated=True),
    ]
    return tps + pages + orders + mixed


def name(layout: PoolLayout) -> str:
    return f"tp{layout.tp}/p{layout.page_size}/{layout.order.value}"


def page_tables(layout: PoolLayout, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Per rank, its pages in a random order: a pool of exactly the pages used."""
    needed = -(-tokens // layout.page_size)
    return [rng.permutation(needed).tolist() for _ in range(layout.tp)]


class Request:
    """One planned request with its pools, ready to apply."""

    def __init__(self, shape: KVShape, pair: Pair, tokens: int, rng: np.random.Generator) -> None:
        self.shape, self.pair, self.tokens = shape, pair, tokens
        self.src_pages = page_tables(pair.src, tokens, rng)
        self.dst_pages = page_tables(pair.dst, tokens, rng)
        self.plan = self.make_plan()
        self.rows = {key: runs.tolist() for key, runs in self.plan.runs.items()}
        self.src_pools = {w: self._pool(pair.src, w, 1) for w, _ in self.plan.pairs()}
        self.dst_pools = {o: self._pool(pair.dst, o, 0) for _, o in self.plan.pairs()}

    def make_plan(self) -> ReshardPlan:
        return plan(
            self.shape, self.pair.src, self.pair.dst, self.tokens, self.src_pages, self.dst_pages
        )

    def _pool(self, layout: PoolLayout, rank: int, fill: int) -> np.ndarray:
        pages = -(-self.tokens // layout.page_size)
        size = pages * rank_geometry(self.shape, layout, rank).page_bytes
        return np.full(size, fill, dtype=np.uint8)  # written: pre-faulted

    def apply(self) -> None:
        for (w, o), rows in self.rows.items():
            src, dst = self.src_pools[w], self.dst_pools[o]
            for local, remote, n in rows:
                dst[remote : remote + n] = src[local : local + n]


def alternate(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, timed a, b, a, b, ... after one warm-up each."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(reps):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def run_pair(shape: KVShape, pair: Pair, tokens: int, reps: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    kv = shape
    if pair.replicated:
        kv = KVShape(shape.layers, 1, MLA_DIM, shape.element_size, replicated=True)
    req = Request(kv, pair, tokens, rng)
    plan_s = median_seconds(req.make_plan, reps)
    homogeneous = PoolLayout(pair.src.tp, pair.src.page_size)
    base_pair = Pair(homogeneous, homogeneous, pair.replicated)
    probe = Request(kv, base_pair, pair.src.page_size, rng)
    base_tokens = max(1, round(req.plan.total_bytes / probe.plan.total_bytes * pair.src.page_size))
    base = Request(kv, base_pair, base_tokens, rng)
    base_plan_s = median_seconds(base.make_plan, reps)
    t_pair, t_base = alternate(req.apply, base.apply, reps)
    gbps, base_gbps = req.plan.total_bytes / t_pair / 1e9, base.plan.total_bytes / t_base / 1e9
    return {
        "bench": "reshard",
        "src": name(pair.src),
        "dst": name(pair.dst),
        "replicated": pair.replicated,
        "kv": [kv.layers, kv.kv_heads, kv.head_dim, kv.element_size],
        "tokens": tokens,
        "bytes": req.plan.total_bytes,
        "pairs": len(req.plan.pairs()),
        "runs": req.plan.run_count,
        "mean_run_bytes": round(req.plan.total_bytes / req.plan.run_count),
        "plan_ms": round(plan_s * 1e3, 3),
        "apply_gbps": round(gbps, 3),
        "homogeneous": name(base_pair.src),
        "homogeneous_tokens": base_tokens,
        "homogeneous_bytes": base.plan.total_bytes,
        "homogeneous_runs": base.plan.run_count,
        "homogeneous_plan_ms": round(base_plan_s * 1e3, 3),
        "homogeneous_gbps": round(base_gbps, 3),
        "ratio": round(gbps / base_gbps, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--element-size", type=int, default=2, help="bytes per element (2: bf16)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="run the pairs whose 'src->dst' contains this")
    args = ap.parse_args(argv)
    shape = KVShape(args.layers, args.kv_heads, args.head_dim, args.element_size)
    print(
        json.dumps(
            {
                "bench": "reshard",
                "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                "note": "shared machine: figures are noisy",
            }
        ),
        flush=True,
    )
    for pair in default_pairs():
        label = f"{name(pair.src)}->{name(pair.dst)}"
        if args.only and args.only not in label:
            continue
        print(json.dumps(run_pair(shape, pair, args.tokens, args.reps, args.seed)), flush=True)


if __name__ == "__main__":
    main()
