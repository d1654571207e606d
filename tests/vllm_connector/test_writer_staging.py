"""The prefill worker's rule for its staging slots (cluster/vllm/staging.py): a slot is
given back only once the batch posted from it settled. Over a transport that reads a
batch's bytes only as it completes, what lands is what the writer checksummed; a slot
given back early (the broken mode) lets the next gather overwrite bytes still on the
wire, which the owner's region checksums catch."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import torch

from kvferry.cluster.vllm import wire, writer_host
from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.loop import PollTimers, Tombstones
from kvferry.cluster.vllm.metrics import KvferryStats
from kvferry.cluster.vllm.parts import WorkerParts
from kvferry.cluster.vllm.reshape import region_checksums
from kvferry.cluster.vllm.settings import Settings
from kvferry.cluster.vllm.staging import Staging
from kvferry.transfer import BatchStatus
from kvferry.transfer._native import ffi

BLOCKS, BLOCK, HEADS, WIDTH, LAYERS = 8, 16, 4, 64, 2  # fp16 K|V rows of 128 bytes


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


def host_segment(t: torch.Tensor) -> HostSegment:
    return HostSegment(t.data_ptr(), t.numel() * t.element_size())


@dataclass
class LazyBatch:
    seg: HostSegment
    runs: np.ndarray
    rseg: bytes = b""
    done: bool = False
    error: object = None

    def peek(self) -> BatchStatus:
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

    def finish(self) -> None:
        batch = self.pending.pop(0)
        data = torch.from_numpy(
            np.frombuffer(
                ffi.buffer(ffi.cast("char *", batch.seg.base), batch.seg.length), np.uint8
            )
        )
        out = self.targets[batch.rseg].view(torch.uint8)
        for lo, ro, n in batch.runs.tolist():
            out[ro : ro + n] = data[lo : lo + n]
        batch.done = True


@dataclass
class Link:
    engine: LazyEngine
    sent: list[dict] = field(default_factory=list)

    def peer(self, address: bytes) -> object:
        incarnation = int.from_bytes(address[-2:], "little")
        return SimpleNamespace(address=address, incarnation=incarnation, name="decode")

    def send(self, peer: object, payload: bytes, rid: str) -> LazyBatch:
        self.sent.append(wire.decode(payload))
        return LazyBatch(HostSegment(0, 0), np.zeros((0, 3), np.int64), done=True)

    notify = send


class Clock:
    def now(self) -> float:
        return 1000.0


def gathered_early(monkeypatch) -> None:
    """BROKEN MODE: a staging slot is given back as soon as it is taken, so the next
    gather may overwrite a batch still on the wire."""
    stage = Staging.stage

    def stage_and_free(self, src, triples):
        staged = stage(self, src, triples)
        if staged is not None:
            self.free.append(staged.slot)
        return staged

    monkeypatch.setattr(Staging, "stage", stage_and_free)
    monkeypatch.setattr(Staging, "release", lambda self, staged: staged.ready.result())


def plan(d_rank: int, dst: KVRegions, tokens: int) -> dict:
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
        "heads": [2 * d_rank, 2 * d_rank + 1],
    }


@pytest.mark.parametrize("broken", [False, True], ids=["held-until-settled", "broken-early-reuse"])
def test_the_writer_reuses_a_slot_only_after_its_batch_settled(monkeypatch, broken):
    """A prefill worker (TP 1, NHD) writing rows into both decode workers of TP 2, in
    staged batches of 8 KiB with two slots (the second job waits for one while the first
    holds both), over a transport that reads each batch's bytes only as it completes,
    one at a time. Safe: what landed is what the writer checksummed. Broken: a slot
    given back while its batch is on the wire carries another batch's bytes into it, and
    the region checksums differ."""
    if broken:
        gathered_early(monkeypatch)
    monkeypatch.setattr(writer_host, "SegmentDescriptor", SimpleNamespace(unpack=lambda d: d))
    src = KVRegions.from_kv_caches(caches(HEADS, 5), BLOCKS, "NHD")
    dsts = [KVRegions.from_kv_caches(caches(HEADS // 2, None), BLOCKS, "NHD") for _ in range(2)]
    engine = LazyEngine({b"x%d" % d: r.buffers[0].tensor for d, r in enumerate(dsts)})
    link = Link(engine)
    settings = Settings(max_batch_bytes=8192, part_bytes=16384, staging_slots=2)
    parts = WorkerParts(
        settings,
        link,  # type: ignore[arg-type]
        KvferryStats(),
        Tombstones(Clock()),  # type: ignore[arg-type]
        Clock(),  # type: ignore[arg-type]
        0,
        1,
    )
    w = writer_host.WriterHost(parts, PollTimers(Clock(), on_error=lambda rid, exc: None))  # type: ignore[arg-type]
    staging = Staging(engine, 8192, 2)  # type: ignore[arg-type]
    w.attach(src, [host_segment(src.buffers[0].tensor)], HEADS, staging)
    tokens = 4 * BLOCK
    w.on_send("r", {"blocks": [5, 2, 7, 0], "tokens": tokens})
    for d in range(2):
        address = b"decode-%d" % d + d.to_bytes(2, "little")
        msg = SimpleNamespace(sender_address=address, sender_incarnation=d)
        w.on_plan(msg, plan(d, dsts[d], tokens))
    jobs = sorted(w.jobs.values(), key=lambda j: j.decode_rank)
    assert [j.staged for j in jobs] == [True, True]
    waited = bool(w.waiting_for_slot) or broken
    finished = 0
    while engine.pending:
        engine.finish()
        finished += 1
        w.settle()
    sent = [[int(c) for c in m["checksums"]] for m in link.sent if m["k"] is wire.NOTICE]
    assert waited and finished >= 8 and len(sent) == 2
    same = []
    for job, dst in zip(jobs, dsts, strict=True):
        assert job.runs is not None
        same.append(region_checksums(dst, job.runs, 1, 4).tolist() in sent)
    assert all(same) is not broken, same
    staging.close()
