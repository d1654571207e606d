"""A prefill worker's host (cluster/vllm/writer_host.py) over fakes: a transport that reads
a batch's local bytes only when the test completes (or fails) it, a side channel that
records what is sent, a clock the test moves. For the writer's tests; needs vLLM (the
connector's modules import it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from kvferry.cluster.vllm import wire, writer_host
from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.loop import PollTimers, Tombstones
from kvferry.cluster.vllm.metrics import KvferryStats
from kvferry.cluster.vllm.parts import WorkerParts
from kvferry.cluster.vllm.settings import Settings
from kvferry.cluster.vllm.staging import Staging
from kvferry.transfer import BatchStatus
from kvferry.transfer._native import ffi

BLOCKS, BLOCK, HEADS, WIDTH, LAYERS = 8, 16, 4, 64, 2  # fp16 K|V rows of 128 bytes
TOKENS = 4 * BLOCK


def caches(heads: int, seed: int | None) -> dict[str, torch.Tensor]:
    """NHD views ``[blocks, heads, tokens, K|V]`` per layer over one raw buffer."""
    page = heads * BLOCK * WIDTH
    raw = torch.zeros(LAYERS * BLOCKS * page, dtype=torch.float16)
    if seed is not None:
        raw.view(torch.int16).random_(generator=torch.Generator().manual_seed(seed))
    return {
        f"layer.{layer}": raw.as_strided(
            (BLOCKS, heads, BLOCK, WIDTH), (page, WIDTH, heads * WIDTH, 1), layer * BLOCKS * page
        )
        for layer in range(LAYERS)
    }


@dataclass
class HostSegment:
    """A host buffer's address, as a registered segment gives it."""

    base: int
    length: int
    is_cuda: bool = False
    registered: bool = True


def host_segment(t: torch.Tensor) -> HostSegment:
    return HostSegment(t.data_ptr(), t.numel() * t.element_size())


@dataclass
class LazyBatch:
    seg: HostSegment
    runs: np.ndarray
    rseg: bytes = b""
    done: bool = False
    failed: bool = False
    error: object = None
    outstanding: int = 0  # puts still in flight (a failed batch may have some)

    def peek(self) -> BatchStatus:
        if self.failed:
            return BatchStatus.FAILED
        return BatchStatus.COMPLETED if self.done else BatchStatus.PENDING


@dataclass
class LazyEngine:
    """A transport that reads a batch's local bytes only when it completes (as a
    zero-copy send may, any time before its completion): :meth:`finish` copies them."""

    targets: dict[bytes, torch.Tensor]  # by the owner's segment descriptor
    pending: list[LazyBatch] = field(default_factory=list)

    def register(self, t: torch.Tensor) -> HostSegment:
        return host_segment(t)

    def deregister(self, seg: HostSegment) -> None:
        pass

    def open_segment(self, peer: object, desc: bytes) -> bytes:
        return desc

    def write(self, peer: object, seg: HostSegment, rseg: bytes, runs: np.ndarray) -> LazyBatch:
        batch = LazyBatch(seg, np.array(runs), rseg)
        self.pending.append(batch)
        return batch

    def poll(self, batch: LazyBatch) -> BatchStatus:
        return batch.peek()

    def reading(self, batch: LazyBatch) -> bool:
        return batch.outstanding > 0

    def finish(self, i: int = 0, fail: bool = False, still_reading: int = 0) -> LazyBatch:
        """Complete the ``i``-th pending batch (its bytes land), or fail it (none do;
        ``still_reading``: puts of it left in flight, which the test ends by setting the
        batch's ``outstanding`` to 0)."""
        batch = self.pending.pop(i)
        if fail:
            batch.failed, batch.error = True, "injected failure"
            batch.outstanding = still_reading
            return batch
        data = torch.from_numpy(
            np.frombuffer(
                ffi.buffer(ffi.cast("char *", batch.seg.base), batch.seg.length), np.uint8
            )
        )
        out = self.targets[batch.rseg].view(torch.uint8)
        for lo, ro, n in batch.runs.tolist():
            out[ro : ro + n] = data[lo : lo + n]
        batch.done = True
        return batch


@dataclass
class Link:
    engine: LazyEngine
    sent: list[dict] = field(default_factory=list)

    def peer(self, address: bytes) -> object:
        incarnation = int.from_bytes(address[-2:], "little")
        return SimpleNamespace(address=address, incarnation=incarnation, name="decode")

    def send(self, peer: object, payload: bytes, rid: str) -> LazyBatch | None:
        if peer is None:
            return None
        self.sent.append(wire.decode(payload))
        return LazyBatch(HostSegment(0, 0), np.zeros((0, 3), np.int64), done=True)

    notify = send

    def of(self, kind: wire.Kind) -> list[dict]:
        return [m for m in self.sent if m["k"] is kind]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def plan(d_rank: int, dst: KVRegions, tokens: int, heads: list[int] | None = None) -> dict:
    """Decode worker ``d_rank``'s PLAN (of 2, HEADS // 2 heads each) for request "r"."""
    return {
        "k": wire.PLAN,
        "rid": "r",
        "orid": "d-r",
        "blocks": [1, 6, 3, 4],
        "gens": [1, 1, 1, 1],
        "tokens": tokens,
        "regions": dst.to_wire(),
        "descs": [b"x%d" % d_rank],
        "tp_rank": d_rank,
        "tp_size": 2,
        "kv_heads": HEADS,
        "heads": heads if heads is not None else [2 * d_rank, 2 * d_rank + 1],
    }


def abort(d_rank: int) -> dict:
    """Decode worker ``d_rank``'s ABORT of request "r"."""
    return {
        "k": wire.ABORT,
        "rid": "r",
        "orid": "d-r",
        "source": "decode",
        "reason": "the decode gave up",
        "tp_rank": d_rank,
        "tp_size": 2,
        "kv_heads": HEADS,
    }


def sender(d_rank: int) -> SimpleNamespace:
    """A message's sender: decode worker ``d_rank``."""
    address = b"decode-%d" % d_rank + d_rank.to_bytes(2, "little")
    return SimpleNamespace(
        sender_address=address, sender_incarnation=d_rank, sender_name=f"decode{d_rank}"
    )


@dataclass
class Writer:
    host: writer_host.WriterHost
    src: KVRegions
    dsts: list[KVRegions]
    engine: LazyEngine
    link: Link
    staging: Staging | None
    clock: Clock

    def hand_over(self) -> None:
        """vLLM hands request "r" over: 4 blocks of TOKENS tokens."""
        self.host.on_send("r", {"blocks": [5, 2, 7, 0], "tokens": TOKENS})

    def settle_all(self, rseg: bytes | None = None) -> None:
        """Complete every pending batch (of the owner whose segment is ``rseg``), settling
        after each, then settle the notices and acks that followed (each completes as it
        is sent) until none is left."""
        while True:
            idx = [i for i, b in enumerate(self.engine.pending) if rseg in (None, b.rseg)]
            if not idx:
                break
            self.engine.finish(idx[0])
            self.host.settle()
        for _ in range(8):
            settled = [
                batch
                for job in self.host.jobs.values()
                for batch, _ in job.inflight
                if batch.peek() is not BatchStatus.PENDING
            ]
            if not settled:
                return
            self.host.settle()
        raise AssertionError("notices or acks still unsettled after 8 polls")


def make_writer(
    monkeypatch, staging_slots: int = 2, part_bytes: int = 16384, max_batch: int = 8192
) -> Writer:
    """A TP 1 prefill worker (NHD, HEADS heads) whose requests go to a TP 2 decode."""
    monkeypatch.setattr(writer_host, "SegmentDescriptor", SimpleNamespace(unpack=lambda d: d))
    src = KVRegions.from_kv_caches(caches(HEADS, 5), BLOCKS, "NHD")
    dsts = [KVRegions.from_kv_caches(caches(HEADS // 2, None), BLOCKS, "NHD") for _ in range(2)]
    engine = LazyEngine({b"x%d" % d: r.buffers[0].tensor for d, r in enumerate(dsts)})
    link = Link(engine)
    clock = Clock()
    settings = Settings(
        max_batch_bytes=max_batch, part_bytes=part_bytes, staging_slots=staging_slots
    )
    parts = WorkerParts(
        settings,
        link,  # type: ignore[arg-type]
        KvferryStats(),
        Tombstones(clock),  # type: ignore[arg-type]
        clock,  # type: ignore[arg-type]
        0,
        1,
    )
    host = writer_host.WriterHost(parts, PollTimers(clock, on_error=lambda rid, exc: None))  # type: ignore[arg-type]
    staging = Staging(engine, max_batch, staging_slots) if staging_slots else None  # type: ignore[arg-type]
    host.attach(src, [host_segment(src.buffers[0].tensor)], HEADS, staging)
    return Writer(host, src, dsts, engine, link, staging, clock)
