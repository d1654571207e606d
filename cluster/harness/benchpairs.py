"""The vLLM connector's data path between engines of different shapes, against the
homogeneous pair of the same bytes, over the real transfer engine, bytes checked.

For one request of ``--tokens`` tokens at a realistic shape (default 8 layers, 8 KV
heads, head size 128, bf16: a K|V row of 512 bytes, 1 GiB of KV at 16,384 tokens), per
(prefill shape -> decode shape) pair: every (prefill worker, decode worker) pair's runs
are planned (:func:`kvferry.cluster.vllm.reshape.plan_pair`: ``plan_ms``, the median of
``--reps``) and posted by the prefill's transfer engine into the decode's in batches of
``--batch-mib`` (the connector's ``max_batch_bytes``), all waited for: ``gbps``;
``pieces``: what those batches make on each side once contiguous neighbours are joined
(the cross-memory copy's cost is mostly per remote piece). The
homogeneous pair (the prefill's shape on both sides: whole blocks, one run per layer and
block) moves the same rows in the same run, timed in alternation (pair, homogeneous,
pair, ...; medians): ``homogeneous_gbps``, and ``ratio`` = gbps / homogeneous_gbps (issue
28's goal: >= 0.9). After the timed rounds, every decode worker's region checksums of what
landed are compared with the writers' of their sources (``bytes_checked``). Block tables
are random permutations; the prefill's buffers hold random bytes and every buffer is
written once before timing (pre-faulted). A pair
whose engines differ only in the order inside each layer's span (HND against NHD, one TP
size and block size: ``turned``) moves whole blocks as they lie at the prefill and the
decode turns them into its order, timed with the turn, as the connector does; so does a
fan-in whose decode kernel blocks are a whole number of the prefill's (``slotted``: each
prefill worker's layer spans whole into its slots of the decode's,
:func:`~kvferry.cluster.vllm.reshape.slot_of`). Those two go in
parts of about ``--part-kib`` per decode worker (the connector's ``part_bytes``;
``parts``), as the connector pipelines them: each part posted and waited for, then turned
on a thread of its own (the decode's, in the connector another process) while the next
part is posted; timed until the last part is turned. A pair moved as rows that lie
scattered at the prefill and contiguous at the decode (``staged``) is gathered into
staging memory batch by batch, the next batch's gather during each write, as the
connector does with ``staging_slots`` (``--staging-slots 0``: posted as they lie).
``checks_ms`` (and ``homogeneous_checks_ms``): the checksums the connector's hosts take
for I5, timed once after the rounds (:meth:`Move.checks`), not part of ``gbps``.

Two engines in this one process over ``--transports`` (default shm; the same path as
between two processes on one host: the kernel's cross-memory copy into the decode's
registered buffers, many runs per system call). Prints one JSON line per pair, after one with the
host's load. Run with ``python -m kvferry.cluster.harness.benchpairs`` or
``scripts/bench-pairs.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.engine.tools.bench_checksum import median_seconds
from kvferry.engine.tools.bench_reshard import alternate
from kvferry.transfer import Segment, TransferConfig, TransferEngine

from ..vllm import reshape
from ..vllm.layout import KVRegions
from ..vllm.reshape import EngineShape, PairRuns, pairs, plan_pair, region_checksums
from ..vllm.settings import Settings
from ..vllm.staging import Staging, worth_staging
from ..vllm.staging import pieces as joined_pieces


@dataclass(frozen=True)
class Side:
    tp: int
    block: int
    order: str  # "HND" or "NHD" (layer-outermost, as vLLM's LBHNC / LBNHC)

    def __str__(self) -> str:
        return f"tp{self.tp}/b{self.block}/{self.order}"


def default_pairs() -> list[tuple[Side, Side]]:
    """TP pairs both ways, the block-size and layout mismatches, and mixes of them."""
    return [
        (Side(1, 16, "NHD"), Side(2, 16, "NHD")),
        (Side(2, 16, "NHD"), Side(1, 16, "NHD")),
        (Side(2, 16, "NHD"), Side(4, 16, "NHD")),
        (Side(4, 16, "NHD"), Side(2, 16, "NHD")),
        (Side(1, 16, "HND"), Side(4, 16, "HND")),
        (Side(2, 16, "HND"), Side(2, 32, "HND")),
        (Side(2, 32, "HND"), Side(2, 16, "HND")),
        (Side(2, 16, "HND"), Side(2, 64, "HND")),
        (Side(2, 16, "NHD"), Side(2, 16, "HND")),
        (Side(2, 16, "HND"), Side(2, 16, "NHD")),
        (Side(4, 16, "HND"), Side(1, 64, "NHD")),
        (Side(2, 16, "NHD"), Side(1, 64, "HND")),
    ]


@dataclass
class Worker:
    regions: KVRegions
    segment: Segment
    blocks: list[int]
    first_head: int


class Workers:
    """One side's TP workers: each a buffer of exactly the request's blocks (in a random
    order) as vLLM lays it out, registered with this side's transfer engine."""

    def __init__(
        self,
        eng: TransferEngine,
        side: Side,
        layers: int,
        heads: int,
        width: int,
        tokens: int,
        rng: np.random.Generator,
        random: bool,
    ) -> None:
        self.side, self.shape = side, EngineShape(heads, side.tp)
        blocks = -(-tokens // side.block)
        self.workers: list[Worker] = []
        for rank in range(side.tp):
            lo, hi = self.shape.heads_of(rank)
            n = hi - lo
            page = n * side.block * width  # elements of one block of one layer
            raw = torch.zeros((layers * blocks * page,), dtype=torch.int16)
            if random:  # every row distinct: a row in another place fails the bytes check
                gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
                raw.random_(-(1 << 15), 1 << 15, generator=gen)
            views = {}
            for layer in range(layers):
                if side.order == "HND":
                    strides = (page, side.block * width, width, 1)
                else:
                    strides = (page, width, n * width, 1)
                views[f"layer.{layer}"] = raw.as_strided(
                    (blocks, n, side.block, width), strides, layer * blocks * page
                )
            regions = KVRegions.from_kv_caches(views, blocks, side.order)
            segment = eng.register(regions.buffers[0].tensor)
            self.workers.append(Worker(regions, segment, rng.permutation(blocks).tolist(), lo))


class Move:
    """One request's every (prefill worker, decode worker) pair: runs planned, and posted
    with the prefill's engine."""

    def __init__(
        self,
        src_eng: TransferEngine,
        dst_eng: TransferEngine,
        src: Workers,
        dst: Workers,
        tokens: int,
        batch_bytes: int,
        rows: bool = False,
        part_bytes: int = 0,
        staging_slots: int = 0,
    ) -> None:
        self.eng, self.src, self.dst, self.tokens = src_eng, src, dst, tokens
        self.batch_bytes, self.part_bytes = batch_bytes, part_bytes
        peer = src_eng.connect(dst_eng.address)
        self.rsegs = [
            src_eng.open_segment(peer, w.segment.descriptor().pack()) for w in dst.workers
        ]
        self.peer = peer
        self.assigned = pairs(src.shape, dst.shape)
        # whole blocks as they lie at the writer, turned by the owner (the connector's
        # path where only the order inside each layer's span differs)
        self.turned = not rows and all(
            p == d and reshape.turned_pair(src.workers[p].regions, dst.workers[d].regions)
            for p, d in self.assigned
        )
        # a fan-in of one block size: each writer's spans whole into its slot (the
        # connector's path for it), turned by each owner
        slots = {
            (p, d): reshape.slot_of(
                src.workers[p].regions, dst.workers[d].regions, src.shape, dst.shape, p, d
            )
            for p, d in self.assigned
        }
        self.slotted = not rows and not self.turned and all(s is not None for s in slots.values())
        # whole blocks checked as they lie: the homogeneous pair's and a turned pair's
        self.whole_blocks = self.turned or all(
            p == d and reshape.same_blocks(src.workers[p].regions, dst.workers[d].regions)
            for p, d in self.assigned
        )
        self.slots = slots if self.slotted else {}
        self.plans = self.rows()  # what each owner's rows must hold: the bytes check's
        self.blocks = self.whole() if self.turned else {}
        self.spans = self.slot_runs() if self.slotted else {}
        self.bytes = sum(p.bytes for p in self.plans.values())
        # what the decode turns goes in parts, each turned while the next lands
        self.parts = self.part_batches() if self.turned or self.slotted else []
        # rows scattered at the writer and contiguous at the decode: gathered first
        batches = self.batches()
        self.staging = (
            Staging(src_eng, batch_bytes, staging_slots)
            if staging_slots and not self.parts and batches and worth_staging(batches[0][2])
            else None
        )

    def plan(self) -> object:
        """What the connector plans for one request of this pair."""
        if self.turned:
            return self.whole()
        return self.slot_runs() if self.slotted else self.rows()

    def slot_runs(self) -> dict[tuple[int, int], PairRuns]:
        """Per (writer, owner): the writer's spans whole into its slot of the owner's."""
        out = {}
        for (p, d), slot in self.slots.items():
            s, t = self.src.workers[p], self.dst.workers[d]
            assert slot is not None
            out[(p, d)] = reshape.plan_slots(
                s.regions, t.regions, slot, s.blocks, t.blocks, self.tokens
            )
        return out

    def whole(self) -> dict[tuple[int, int], np.ndarray]:
        """Per (writer, owner): ``[n, 3]`` runs of whole blocks (one buffer a side)."""
        out = {}
        for p, d in self.assigned:
            s, t = self.src.workers[p], self.dst.workers[d]
            out[(p, d)] = s.regions.triples(0, s.blocks, t.regions, t.blocks)
        return out

    def batches(self) -> list[tuple[int, int, np.ndarray]]:
        """(writer, owner, runs) per batch of at most ``batch_bytes``."""
        out = []
        if not self.turned:
            plans = self.spans if self.slotted else self.plans
            for (p, d), runs in plans.items():
                out += [(p, d, triples) for _, _, triples in runs.batches(self.batch_bytes)]
            return out
        for (p, d), triples in self.blocks.items():
            out += self._split(p, d, triples)
        return out

    def _split(self, p: int, d: int, triples: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
        """Whole-block runs in batches of at most ``batch_bytes``."""
        per = max(1, self.batch_bytes // max(1, int(triples[:, 2].max())))
        return [(p, d, triples[i : i + per]) for i in range(0, len(triples), per)]

    def part_batches(self) -> list[tuple[int, int, list[tuple[int, int, np.ndarray]]]]:
        """Per part: its block range and the (writer, owner, runs) batches that write it,
        every writer's."""
        out = []
        blocks = len(self.dst.workers[0].blocks)  # every decode worker plans as many
        per_worker = self.bytes // len(self.dst.workers)
        for lo, hi in reshape.part_ranges(blocks, per_worker, self.part_bytes):
            batches: list[tuple[int, int, np.ndarray]] = []
            for p, d in self.assigned:
                s, t = self.src.workers[p], self.dst.workers[d]
                if self.turned:
                    triples = s.regions.triples(0, s.blocks[lo:hi], t.regions, t.blocks[lo:hi])
                    batches += self._split(p, d, triples)
                else:
                    keep = np.zeros(len(t.blocks), dtype=bool)
                    keep[lo:hi] = True
                    part = self.spans[(p, d)].within(keep)
                    batches += [(p, d, r) for _, _, r in part.batches(self.batch_bytes)]
            out.append((lo, hi, batches))
        return out

    def rows(self) -> dict[tuple[int, int], PairRuns]:
        out = {}
        for (p, d), heads in self.assigned.items():
            s, t = self.src.workers[p], self.dst.workers[d]
            out[(p, d)] = plan_pair(
                s.regions,
                t.regions,
                heads,
                s.first_head,
                t.first_head,
                s.blocks,
                t.blocks,
                self.tokens,
            )
        return out

    def run(self) -> None:
        if self.parts:
            self.run_parts()
            return
        if self.staging is not None:
            self.run_staged()
            return
        self.post(self.batches())

    def run_staged(self) -> None:
        """The connector's staged path (:mod:`kvferry.cluster.vllm.staging`): each batch
        gathered into a slot, the next one's gather started as it is posted, its slot
        given back once it landed."""
        staging = self.staging
        assert staging is not None
        batches = self.batches()
        assert all(staging.fits(b[2]) for b in batches), "a batch larger than a staging slot"
        ahead = None
        for k, (p, d, triples) in enumerate(batches):
            staged = ahead or staging.stage(self.src.workers[p].segment, triples)
            assert staged is not None
            staged.ready.result()
            ahead = None
            if k + 1 < len(batches):
                q, _, upcoming = batches[k + 1]
                ahead = staging.stage(self.src.workers[q].segment, upcoming)
            batch = self.eng.write(self.peer, staging.segment, self.rsegs[d], staged.runs)
            self.eng.wait(batch, 120.0)
            if batch.error is not None:
                raise RuntimeError(f"a batch failed: {batch.error}")
            staging.release(staged)

    def post(self, batches: list[tuple[int, int, np.ndarray]]) -> None:
        """Post ``batches`` and wait for all of them."""
        posted = [
            self.eng.write(self.peer, self.src.workers[p].segment, self.rsegs[d], triples)
            for p, d, triples in batches
        ]
        for b in posted:
            self.eng.wait(b, 120.0)
            if b.error is not None:
                raise RuntimeError(f"a batch failed: {b.error}")

    def run_parts(self) -> None:
        """The connector's pipelined path: each part posted and waited for (its
        NOTICE_PART follows), then turned by the decode's thread while the writer posts
        the next; done once the last part is turned."""
        with ThreadPoolExecutor(1, thread_name_prefix="decode") as decode:
            turns = []
            for lo, hi, batches in self.parts:
                self.post(batches)
                turns.append(decode.submit(self.turn, lo, hi))
            for t in turns:
                t.result()

    def turn(self, lo: int, hi: int) -> None:
        """Each decode worker turns its blocks ``[lo, hi)`` (their places in its plan)
        into its order: whole blocks as their writer laid them, or a fan-in's slots."""
        for p, d in self.blocks:
            t = self.dst.workers[d]
            reshape.turn_blocks(t.regions, self.src.workers[p].regions, t.blocks[lo:hi])
        if self.slotted:
            k = self.src.side.tp // self.dst.side.tp
            for d, t in enumerate(self.dst.workers):
                theirs = self.src.workers[d * k].regions
                reshape.turn_blocks(t.regions, theirs, t.blocks[lo:hi], writers=k)

    def checks(self) -> dict[str, float]:
        """The connector's I5 checksums for one request of this pair, in ms, as its hosts
        take them: ``handover`` (every prefill worker's blocks as vLLM hands them over),
        ``writer`` (rows and slots only: the blocks checked again against those, then
        each decode block's region), ``owner`` (what landed: whole blocks' checksums, or
        the regions each writer's runs wrote)."""
        t0 = time.perf_counter()
        for w in self.src.workers:
            reshape.block_checksums(w.regions, w.blocks)
        t1 = time.perf_counter()
        plans = {} if self.whole_blocks else (self.spans if self.slotted else self.plans)
        for (p, d), runs in plans.items():
            s = self.src.workers[p]
            reshape.block_checksums(s.regions, s.blocks)
            region_checksums(s.regions, runs, 0, len(self.dst.workers[d].blocks))
        t2 = time.perf_counter()
        for p, d in self.assigned:
            t = self.dst.workers[d]
            if self.whole_blocks:
                reshape.block_checksums(t.regions, t.blocks)
            else:
                region_checksums(t.regions, plans[(p, d)], 1, len(t.blocks))
        t3 = time.perf_counter()
        return {
            "handover": round((t1 - t0) * 1e3, 1),
            "writer": round((t2 - t1) * 1e3, 1),
            "owner": round((t3 - t2) * 1e3, 1),
        }

    def pieces(self) -> tuple[int, int]:
        """(local, remote): the pieces of the posted batches once each side's contiguous
        neighbours are joined, as the cross-memory copy joins them (a remote piece costs
        the kernel about 0.8 us besides its bytes, a scattered local one 0.2-0.6 us)."""
        local = remote = 0
        for _, _, triples in self.batches():
            local += joined_pieces(triples[:, 0], triples[:, 2])
            remote += joined_pieces(triples[:, 1], triples[:, 2])
        return local, remote

    def checked(self) -> bool:
        """Every decode worker's landed regions equal its writers' sources'."""
        for (p, d), runs in self.plans.items():
            n = len(self.dst.workers[d].blocks)
            want = region_checksums(self.src.workers[p].regions, runs, 0, n)
            got = region_checksums(self.dst.workers[d].regions, runs, 1, n)
            if not np.array_equal(want, got):
                return False
        return True


def run_pair(args: argparse.Namespace, src: Side, dst: Side, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    width = args.head_dim * 2  # K|V, in 2-byte elements
    config = TransferConfig(transports=args.transports, name="bench-pairs-prefill")
    a = TransferEngine(config)
    b = TransferEngine(TransferConfig(transports=args.transports, name="bench-pairs-decode"))
    try:
        shape = (args.layers, args.kv_heads, width, args.tokens, rng)
        prefill = Workers(a, src, *shape, random=True)
        decode = Workers(b, dst, *shape, random=False)
        like = Workers(b, src, *shape, random=False)
        move = Move(
            a,
            b,
            prefill,
            decode,
            args.tokens,
            args.batch_mib << 20,
            args.rows,
            args.part_kib << 10,
            args.staging_slots,
        )
        base = Move(a, b, prefill, like, args.tokens, args.batch_mib << 20)
        t_pair, t_base = alternate(move.run, base.run, args.reps)
        runs = sum(len(t) for _, _, t in move.batches())
        base_runs = sum(len(t) for _, _, t in base.batches())
        return {
            "bench": "vllm_pairs",
            "src": str(src),
            "dst": str(dst),
            "kv": [args.layers, args.kv_heads, args.head_dim, 2],
            "tokens": args.tokens,
            "bytes": move.bytes,
            "pairs": len(move.plans),
            "turned": move.turned,
            "slotted": move.slotted,
            "parts": len(move.parts) or None,
            "staged": move.staging is not None,
            "runs": runs,
            "mean_run_bytes": round(move.bytes / max(1, runs)),
            "pieces": dict(zip(("local", "remote"), move.pieces(), strict=True)),
            "plan_ms": round(median_seconds(move.plan, args.reps) * 1e3, 3),
            "gbps": round(move.bytes / t_pair / 1e9, 3),
            "homogeneous_runs": base_runs,
            "homogeneous_gbps": round(base.bytes / t_base / 1e9, 3),
            "ratio": round((move.bytes / t_pair) / (base.bytes / t_base), 3),
            "bytes_checked": move.checked() and base.checked(),
            "checks_ms": move.checks(),
            "homogeneous_checks_ms": base.checks(),
        }
    finally:
        a.shutdown()
        b.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch-mib", type=int, default=8, help="bytes per posted batch, MiB")
    ap.add_argument(
        "--part-kib",
        type=int,
        default=Settings.part_bytes >> 10,
        help="a pair the decode turns goes in parts of about this many KiB per decode worker, "
        "each turned while the next lands, as the connector's part_bytes (0: one part, turned "
        "after the whole load landed)",
    )
    ap.add_argument(
        "--staging-slots",
        type=int,
        default=Settings.staging_slots,
        help="a pair moved as rows scattered at the prefill and contiguous at the decode is "
        "gathered into this many staging slots of a batch each, the next gather during each "
        "write, as the connector's staging_slots (0: posted as the rows lie)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transports", default="shm")
    ap.add_argument("--only", default="", help="run the pairs whose 'src->dst' contains this")
    ap.add_argument(
        "--rows",
        action="store_true",
        help="move a pair that differs only inside each layer's span (HND against NHD), or a "
        "fan-in of one block size, as rows planned per request, not as whole blocks or spans "
        "the decode turns (to compare the two)",
    )
    args = ap.parse_args(argv)
    print(
        json.dumps(
            {
                "bench": "vllm_pairs",
                "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
                "note": "shared machine: figures are noisy",
            }
        ),
        flush=True,
    )
    for i, (src, dst) in enumerate(default_pairs()):
        if args.only and args.only not in f"{src}->{dst}":
            continue
        print(json.dumps(run_pair(args, src, dst, args.seed + i)), flush=True)


if __name__ == "__main__":
    main()
