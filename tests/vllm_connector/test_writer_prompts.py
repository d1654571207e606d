"""A prefill worker's hold on a prompt's blocks across its jobs (one per decode worker that
plans from it), driven in process over a stub link: vLLM gets the blocks back once every
expected job ended, never after the first alone; a rejection's aborts end every job at
once; a worker whose heads others write ends on its plan of no heads; a plan that comes
after the hold ran out is refused and revives nothing. Each rule has a broken mode the
same check catches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
import torch

from kvferry.cluster.vllm import wire, writer_host
from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.loop import PollTimers, Tombstones
from kvferry.cluster.vllm.metrics import KvferryStats
from kvferry.cluster.vllm.parts import WorkerParts
from kvferry.cluster.vllm.settings import Settings
from kvferry.transfer import BatchStatus

BLOCKS, TOKENS = 8, 40


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


@dataclass
class Batch:
    error: Any = None

    def peek(self) -> BatchStatus:
        return BatchStatus.COMPLETED


@dataclass
class Peer:
    address: bytes
    incarnation: int
    name: str = "decode"


@dataclass
class Engine:
    writes: list[Any] = field(default_factory=list)

    def open_segment(self, peer: Peer, desc: Any) -> object:
        return object()

    def write(self, peer: Peer, seg: Any, rseg: Any, triples: Any) -> Batch:
        self.writes.append(triples)
        return Batch()

    def poll(self, batch: Batch) -> BatchStatus:
        return BatchStatus.COMPLETED


@dataclass
class Link:
    """Every message recorded as (address, decoded message); every batch settles."""

    engine: Engine = field(default_factory=Engine)
    sent: list[tuple[bytes, dict]] = field(default_factory=list)

    def peer(self, address: bytes) -> Peer:
        return Peer(address, incarnation=int.from_bytes(address[-2:], "little"))

    def send(self, peer: Peer | None, payload: bytes, rid: str) -> Batch | None:
        if peer is None:
            return None
        self.sent.append((peer.address, wire.decode(payload)))
        return Batch()

    notify = send

    def send_to(self, address: bytes, payload: bytes, rid: str) -> Batch:
        self.sent.append((address, wire.decode(payload)))
        return Batch()


@dataclass
class Msg:
    sender_address: bytes
    sender_incarnation: int
    sender_name: str = "decode"


class Descriptor:
    """The decode's segment descriptors, opaque here (the stub engine opens anything)."""

    @staticmethod
    def unpack(data: bytes) -> bytes:
        return data


@pytest.fixture(autouse=True)
def opaque_descriptors(monkeypatch):
    monkeypatch.setattr(writer_host, "SegmentDescriptor", Descriptor)


def host(
    tp: int,
    rank: int,
    kv_heads: int = 4,
    hold_s: float = 60.0,
    part_bytes: int = Settings.part_bytes,
):
    clock = Clock()
    link = Link()
    parts = WorkerParts(
        Settings(hold_timeout_s=hold_s, part_bytes=part_bytes),
        link,  # type: ignore[arg-type]
        KvferryStats(),
        Tombstones(clock),
        clock,
        rank,
        tp,
    )
    w = writer_host.WriterHost(parts, PollTimers(clock, on_error=lambda rid, exc: None))
    caches = h.kv_caches(h.kv_cache_config(BLOCKS, tp, h.BLOCK, kv_heads), "LBNHC")
    for v in caches.values():
        v.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(rank))
    w.attach(KVRegions.from_kv_caches(caches, BLOCKS, "LBNHC"), [object()], kv_heads)
    return w, link, clock


def decode_regions(tp: int, kv_heads: int = 4) -> dict:
    caches = h.kv_caches(h.kv_cache_config(BLOCKS, tp, h.BLOCK, kv_heads), "LBHNC")
    return KVRegions.from_kv_caches(caches, BLOCKS, "LBHNC").to_wire()


def plan(w, rid: str, d_rank: int, d_tp: int, heads: list[int], kv_heads: int = 4) -> None:
    """A PLAN from decode TP rank ``d_rank`` of ``d_tp`` asking for ``heads``."""
    address = b"decode-%d" % d_rank + d_rank.to_bytes(2, "little")
    m = {
        "k": wire.PLAN,
        "rid": rid,
        "orid": f"d-{rid}",
        "blocks": [4, 5, 6][: -(-TOKENS // h.BLOCK)],
        "gens": [1, 1, 1][: -(-TOKENS // h.BLOCK)],
        "tokens": TOKENS,
        "regions": decode_regions(d_tp, kv_heads),
        "descs": [b"x"],
        "tp_rank": d_rank,
        "tp_size": d_tp,
        "kv_heads": kv_heads,
        "heads": heads,
    }
    w.on_plan(Msg(address, d_rank), m)


def abort(w, rid: str, d_rank: int, d_tp: int, kv_heads: int = 4) -> None:
    address = b"decode-%d" % d_rank + d_rank.to_bytes(2, "little")
    m = {
        "k": wire.ABORT,
        "rid": rid,
        "orid": f"d-{rid}",
        "source": "decode",
        "reason": "rejected",
        "tp_rank": d_rank,
        "tp_size": d_tp,
        "kv_heads": kv_heads,
    }
    w.on_owner_abort(Msg(address, d_rank), m)


def settle(w) -> None:
    for _ in range(10):
        w.settle()


def any_job_ends_the_prompt(monkeypatch) -> None:
    """BROKEN MODE: the prompt's blocks go back when its first job ends."""
    monkeypatch.setattr(writer_host.Prompt, "all_ended", property(lambda p: bool(p.ended)))


def two_decode_workers(monkeypatch, broken: bool, step) -> tuple[Any, Any, bool]:
    """Prefill TP 1 into decode TP 2: a prompt handed over, then ``step(w, decode_rank)``
    for decode worker 0 and then 1. Returns the host, its link and whether the prompt
    went back after the first worker's step alone. Broken: any job's end hands it back."""
    if broken:
        any_job_ends_the_prompt(monkeypatch)
    w, link, _ = host(tp=1, rank=0)
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    step(w, 0)
    settle(w)
    after_first = "r" in w.finished_sending
    step(w, 1)
    settle(w)
    return w, link, after_first


@pytest.mark.parametrize("broken", [False, True])
def test_blocks_go_back_only_once_every_planning_decode_worker_ended(monkeypatch, broken):
    """Both decode workers plan from this one worker."""
    w, link, after_first = two_decode_workers(
        monkeypatch, broken, lambda w, d: plan(w, "r", d, 2, [2 * d, 2 * d + 1])
    )
    assert after_first is broken  # safe: held for the second decode worker's job
    if not broken:  # (broken: the second plan finds the prompt gone and is refused)
        notices = [m for _, m in link.sent if m["k"] is wire.NOTICE]
        assert len(notices) == 2 and "r" in w.finished_sending


@pytest.mark.parametrize("broken", [False, True])
def test_a_rejection_ends_every_job_at_once(monkeypatch, broken):
    """Both decode workers' aborts (nothing planned) free the prompt without the hold."""
    w, link, after_first = two_decode_workers(monkeypatch, broken, lambda w, d: abort(w, "r", d, 2))
    acks = [a for a, m in link.sent if m["k"] is wire.ABORT_ACK]
    assert sorted(acks) == [b"decode-0\x00\x00", b"decode-1\x01\x00"]
    assert "r" in w.finished_sending and not w.prompts
    assert after_first is broken


def test_a_worker_whose_heads_others_write_ends_on_its_plan_of_no_heads():
    """Prefill TP 4 over 2 heads (0, 0, 1, 1): worker 1 writes nothing; decode rank 0
    tells it so, and it gives its blocks back without a write or a notice."""
    w, link, _ = host(tp=4, rank=1, kv_heads=2)
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    plan(w, "r", 0, 1, [], kv_heads=2)
    settle(w)
    assert "r" in w.finished_sending and not link.engine.writes
    assert not [m for _, m in link.sent if m["k"] is wire.NOTICE]


def test_a_plan_after_the_hold_ran_out_is_refused_and_revives_nothing():
    w, link, clock = host(tp=1, rank=0, hold_s=5.0)
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    clock.t += 6.0
    w.timers.fire_due()
    assert "r" in w.finished_sending and not w.prompts
    plan(w, "r", 0, 1, [0, 1, 2, 3])
    settle(w)
    kinds = [m["k"] for _, m in link.sent]
    assert kinds == [wire.ABORT, wire.ABORT_ACK] and not w.prompts and not w.jobs
    assert not link.engine.writes


def test_a_plan_asking_for_heads_this_worker_does_not_write_is_refused():
    """Bad input: the heads a job writes follow from the two shapes; a plan naming
    others is refused with both lists, nothing is written, and the decode is told."""
    w, link, _ = host(tp=2, rank=0)
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    plan(w, "r", 0, 1, [2, 3])  # prefill worker 0 of 2 holds heads 0 and 1
    settle(w)
    aborts = [m for _, m in link.sent if m["k"] is wire.ABORT]
    assert len(aborts) == 1 and "asks for heads [2, 3]" in aborts[0]["reason"], aborts
    assert "writes it heads [0, 1]" in aborts[0]["reason"] and not link.engine.writes


def logged(link: Link) -> list[tuple[str, Any]]:
    """One list of what ``link`` carries, in order: ("write", the batch's remote
    offsets) and (kind, the message)."""
    log: list[tuple[str, Any]] = []
    write, send = link.engine.write, link.send

    def logged_write(peer, seg, rseg, triples):
        log.append(("write", [int(x) for x in triples[:, 1]]))
        return write(peer, seg, rseg, triples)

    def logged_send(peer, payload, rid):
        batch = send(peer, payload, rid)
        log.append((link.sent[-1][1]["k"], link.sent[-1][1]))
        return batch

    link.engine.write = logged_write  # type: ignore[method-assign]
    link.send = link.notify = logged_send  # type: ignore[method-assign]
    return log


@pytest.mark.parametrize("broken", [False, True], ids=["safe", "broken-notice-first"])
def test_a_load_in_parts_notices_each_part_after_its_writes(monkeypatch, broken):
    """``part_bytes`` of one block: each of the plan's blocks is a part. Every part but
    the last is posted, then its NOTICE_PART names it (offset, blocks, generations and
    the checksums the whole NOTICE repeats) after every write into its block and before
    any later one; the last part ends with the whole NOTICE. Broken: a writer that
    sends a part's notice as it posts the part, before its bytes landed."""
    if broken:
        post_part = writer_host.WriterHost.post_part

        def notice_first(self, job):
            self.link.notify(job.peer, self.part_notice(job, job.parts[0]), job.rid)
            post_part(self, job)

        def next_only(self, job):  # its notice went already: the next part
            self._next_part(job)

        monkeypatch.setattr(writer_host.WriterHost, "post_part", notice_first)
        monkeypatch.setattr(writer_host.WriterHost, "send_part", next_only)
    w, link, _ = host(tp=1, rank=0, part_bytes=1)
    log = logged(link)
    src = [0, 1, 2]
    w.on_send("r", {"blocks": src, "tokens": TOKENS})
    plan(w, "r", 0, 1, [0, 1, 2, 3])
    settle(w)
    kinds = [k for k, _ in log]
    notice = [m for k, m in log if k is wire.NOTICE]
    parts = [m for k, m in log if k is wire.NOTICE_PART]
    assert len(notice) == 1 and [p["offset"] for p in parts] == [0, 1], kinds
    for p in parts:  # the blocks and checksums the whole notice gives at that place
        at = p["offset"]
        assert p["blocks"] == notice[0]["blocks"][at : at + 1], p
        assert p["checksums"] == notice[0]["checksums"][at : at + 1], p
    # the remote offsets of each planned block's writes
    dst = KVRegions.from_wire(decode_regions(1))
    offsets = {
        b: {
            int(x)
            for i in range(len(w.regions.buffers))
            for x in w.regions.triples(i, [s], dst, [b])[:, 1]
        }
        for s, b in zip(src, notice[0]["blocks"], strict=True)
    }
    in_order = True
    for i, (k, m) in enumerate(log):
        if k is wire.NOTICE_PART:
            mine = offsets[m["blocks"][0]]
            before = {x for kk, xs in log[:i] if kk == "write" for x in xs}
            after = {x for kk, xs in log[i + 1 :] if kk == "write" for x in xs}
            in_order &= mine <= before and not (mine & after)
    assert in_order is not broken, kinds
    assert kinds[-1] is wire.NOTICE and "r" in w.finished_sending


def test_an_abort_between_parts_stops_the_writes_and_acks():
    """An owner's ABORT after the first part landed: nothing more is posted, the ack
    follows, the prompt goes back."""
    w, link, _ = host(tp=1, rank=0, part_bytes=1)
    log = logged(link)
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    plan(w, "r", 0, 1, [0, 1, 2, 3])
    w.settle()  # the first part landed: its notice out, the second part posted
    abort(w, "r", 0, 1)
    settle(w)
    kinds = [k for k, _ in log]
    writes_after = [k for k in kinds[kinds.index(wire.ABORT_ACK) :] if k == "write"]
    assert wire.NOTICE_PART in kinds and wire.NOTICE not in kinds, kinds
    assert kinds.count("write") < 3 * len(w.regions.buffers) * 8 and not writes_after, kinds
    assert "r" in w.finished_sending and not w.jobs


@pytest.mark.parametrize("broken", [False, True], ids=["safe", "broken-unchecked-parts"])
def test_a_source_block_changed_between_parts_is_never_sent(monkeypatch, broken):
    """Rows of another shape (prefill TP 1 into decode TP 2), a part per block: a source
    block that changes after the first part was posted is found as its part is about to
    be posted, before any of its bytes go; the job fails and tells its owner why. Broken:
    a writer that checks no part's source blocks as it posts it (its region checksums,
    taken from the changed bytes, would agree with what lands)."""
    if broken:
        monkeypatch.setattr(writer_host, "source_blocks", lambda *a: (0, 0))
    w, link, _ = host(tp=1, rank=0, part_bytes=1)
    log = logged(link)
    src = [0, 1, 2]
    w.on_send("r", {"blocks": src, "tokens": TOKENS})
    plan(w, "r", 0, 2, [0, 1])
    assert w.jobs and next(iter(w.jobs.values())).runs is not None  # the rows path
    posted = len([k for k, _ in log if k == "write"])
    data = w.regions.block_bytes_of([1])
    data[0, 7] ^= 0x5A
    w.regions.write_block_bytes([1], data)  # the second part's source block
    settle(w)
    kinds = [k for k, _ in log]
    writes_after = kinds.count("write") - posted
    reasons = [str(m.get("reason", "")) for k, m in log if k is wire.ABORT]
    if broken:
        assert wire.NOTICE in kinds and writes_after > 0, kinds
    else:
        assert writes_after == 0 and wire.NOTICE not in kinds, kinds
        assert any("changed since vLLM handed them over" in r for r in reasons), log


@pytest.mark.parametrize("broken", [False, True], ids=["bounded", "broken-no-timer"])
def test_a_plan_for_a_request_vllm_never_handed_over_expires(monkeypatch, broken):
    """A PLAN naming a request id vLLM never hands over (client-named ids) makes a prompt
    and a job with no KV: after the transfer timeout both end (the decode is told and
    acked, nothing written) and the ids are tombstoned, so a late hand-over gets its
    blocks back at once. Broken mode: no such timer; the record is still held after it,
    which the same check sees."""
    if broken:
        monkeypatch.setattr(writer_host.WriterHost, "_unclaimed", lambda self, prompt: None)
    w, link, clock = host(tp=1, rank=0)
    plan(w, "ghost", 0, 1, [0, 1, 2, 3])
    timeout = w.settings.transfer_timeout_s
    clock.t += timeout - 1.0
    w.timers.fire_due()
    settle(w)
    assert "ghost" in w.prompts and not link.sent  # not early
    clock.t += 2.0
    w.timers.fire_due()
    settle(w)
    held = "ghost" in w.prompts or bool(w.jobs)
    assert held is broken  # the test catches a record that is never bounded
    if broken:
        return
    kinds = [m["k"] for _, m in link.sent]
    assert kinds == [wire.ABORT, wire.ABORT_ACK] and not link.engine.writes
    assert "transfer timeout" in link.sent[0][1]["reason"]
    assert w.timers.pending() == 0 and "ghost" not in w.finished_sending
    w.on_send("ghost", {"blocks": [0, 1, 2], "tokens": TOKENS})  # a late hand-over
    assert "ghost" in w.finished_sending and not w.prompts


def test_a_handed_over_prompt_keeps_no_unclaimed_timer():
    """The hand-over ends the unclaimed timeout: a plan that came first, then the KV,
    lands however long past the transfer timeout the hold lets it."""
    w, link, clock = host(tp=1, rank=0, hold_s=600.0)
    plan(w, "r", 0, 1, [0, 1, 2, 3])
    w.on_send("r", {"blocks": [0, 1, 2], "tokens": TOKENS})
    clock.t += w.settings.transfer_timeout_s + 1.0
    w.timers.fire_due()
    settle(w)
    kinds = [m["k"] for _, m in link.sent]
    assert kinds == [wire.NOTICE] and "r" in w.finished_sending
