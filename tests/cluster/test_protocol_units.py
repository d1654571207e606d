"""The protocol roles against a recording runtime, no processes: what a rank does with
messages that arrive late, early, twice or out of order."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pytest
import torch

from kvferry.cluster import messages as m
from kvferry.cluster import router as router_module
from kvferry.cluster.decode import DecodeRank, OwnerState
from kvferry.cluster.decode_path import DecodePath
from kvferry.cluster.faults import FaultPlan
from kvferry.cluster.metrics import ClusterMetrics
from kvferry.cluster.prefill import PrefillRank
from kvferry.cluster.rendezvous import RankCard
from kvferry.cluster.router import Router
from kvferry.cluster.topology import Topology
from kvferry.engine.admission import AdmissionRejected
from kvferry.engine.integrity import page_checksums
from kvferry.engine.models import ReplayConfig, ReplayModel
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol.owner import OwnerBook
from kvferry.engine.protocol.owner_driver import OwnerDriver
from kvferry.engine.protocol.words import Kind
from kvferry.engine.tokenizer import encode_array as tokenize


class _Done:
    """A batch that has settled."""

    def status(self):
        from kvferry.transfer import BatchStatus

        return BatchStatus.COMPLETED

    error = None


class RecordingRuntime:
    """What the roles call on RankRuntime, recorded; batches settle at once."""

    def __init__(self, rank: int, cards: dict[int, RankCard] | None = None) -> None:
        self.rank, self.cards, self.faults = rank, cards or {}, FaultPlan()
        self.store = None  # one torchrun group: no rendezvous store to read cards from
        self.sent: list[tuple[int, str, dict]] = []
        self.writes: list[tuple[int, np.ndarray]] = []
        self.handler = None
        self.on_send_failure = None
        self.deferred: list = []
        self.defer_at_once = False  # broken mode: deferred work runs inside the handler

    def set_handlers(self, handlers, role) -> None:
        self.handlers = handlers

    def deliver(self, kind, src: int, **fields) -> None:
        msg = kind.make(src=src, inc=1, seq=len(self.sent) + 1000, **fields)
        self.handlers[Kind(msg.kind)](msg)

    def deliver_prompt(self, rid: str, tokens: int, owner: int = 2, **fields) -> None:
        """The router's PREFILL of ``rid``: the prompt 0, 1, ... ``tokens - 1`` in one
        chunk, owned by ``owner`` (incarnation 1, unless ``fields`` say; ``share`` too)."""
        self.deliver(
            m.PREFILL,
            src=0,
            rid=rid,
            tokens=np.arange(tokens, dtype="<i4").tobytes(),
            offset=0,
            total=tokens,
            owner=owner,
            **{"owner_inc": 1, **fields},
        )

    def send(self, rank, kind, **fields):
        self.sent.append((rank, kind.name, fields))
        return _Done()

    notify = send

    def write(self, rank, local, pages, rid=None, incarnation=None):
        self.writes.append((rank, np.asarray(pages)))
        return _Done()

    def watch(self, batch, callback, rid=None) -> None:
        callback(batch)

    def run_for(self, rid, what, fn) -> None:
        fn()

    def defer(self, fn, rid=None) -> None:
        if self.defer_at_once:
            fn()
        else:
            self.deferred.append(fn)

    def pump(self) -> None:
        """What RankRuntime.pump does once the messages delivered so far are handled,
        repeated until no deferred work is left (work in slices defers itself again)."""
        for _ in range(10_000):
            if not self.deferred:
                return
            deferred, self.deferred = self.deferred, []
            for fn in deferred:
                fn()
        raise AssertionError("deferred work never ends")

    def pump_once(self) -> None:
        """One pump: the deferred work queued so far runs once (a sliced run's next
        slice, which may defer another)."""
        deferred, self.deferred = self.deferred, []
        for fn in deferred:
            fn()

    def call_later(self, delay, fn, rid=None):
        raise AssertionError("no timers expected here")

    def remote_segment(self, rank):
        raise AssertionError("no in-flight fault here")

    def kinds(self) -> list[str]:
        return [k for _, k, _ in self.sent]


# ---------------------------------------------------------------- I2 at a writer
def _writer(
    tombstones_kept: bool = True, runtime: type[RecordingRuntime] = RecordingRuntime
) -> tuple[PrefillRank, RecordingRuntime]:
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    pool = KVPool(model.pool_config(16, 64))
    rt = runtime(rank=1)
    writer = PrefillRank.serving(rt, model, pool, segment=None, head_range=(0, 2), router=0)
    if not tombstones_kept:  # the broken mode: a writer that forgets aborted requests
        writer.tombstones = _Forgetful()
    return writer, rt


class _Forgetful(dict):
    def __setitem__(self, key, value) -> None:
        pass


@pytest.mark.parametrize("tombstones_kept", [True, False])
def test_an_abort_that_overtakes_its_request_keeps_it_from_transfer(tombstones_kept):
    """ABORT arrives before PREFILL and PLAN (reordered control messages). The writer acks
    at once and never writes; a writer without tombstones would write the pages."""
    writer, rt = _writer(tombstones_kept)
    rt.deliver(m.ABORT, src=0, rid="r1", owner=2, writers=[1], source="client", reason="gone")
    assert rt.kinds() == ["RELEASED", "ABORT_ACK"]  # none of the router's reservation held
    rt.deliver(m.PLAN, src=2, rid="r1", offset=0, total=2, pages=[5, 6], generations=[1, 1])
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r1",
        tokens=np.arange(20, dtype="<i4").tobytes(),
        offset=0,
        total=20,
        owner=2,
        owner_inc=1,
    )
    rt.pump()
    if tombstones_kept:
        assert rt.writes == [] and "NOTICE" not in rt.kinds()
        assert writer.allocator.counts()["owned"] == 0
    else:
        assert rt.writes and "NOTICE" in rt.kinds()  # the test catches the broken writer


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "broken-at-once"])
def test_an_abort_that_arrives_during_the_prefill_keeps_it_from_transfer(deferred):
    """I2: the PLAN came early, the ABORT arrives while the writer computes the prefill.
    The writer's checksums and writes wait for the next pump, after that ABORT: nothing is
    posted, the ack goes at once, the source pages are freed. Broken mode (the sequel run
    inside the PREFILL handler) posts the aborted request's writes, and the test sees it."""
    writer, rt = _writer()
    rt.defer_at_once = not deferred
    rt.deliver(m.PLAN, src=2, rid="r3", offset=0, total=2, pages=[5, 6], generations=[1, 1])
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r3",
        tokens=np.arange(20, dtype="<i4").tobytes(),
        offset=0,
        total=20,
        owner=2,
        owner_inc=1,
    )
    rt.deliver(m.ABORT, src=0, rid="r3", owner=2, writers=[1], source="client", reason="gone")
    rt.pump()
    if deferred:
        assert rt.writes == [] and rt.kinds() == ["ABORT_ACK", "RELEASED"]
        assert writer.allocator.counts()["owned"] == 0
    else:
        assert rt.writes and "NOTICE" in rt.kinds()  # the test catches the broken order


class _CountingLayers(ReplayModel):
    """The replay model, counting the prefill layers it computed."""

    def __init__(self, config: ReplayConfig) -> None:
        super().__init__(config)
        self.computed = 0

    def prefill_layers(self, *args, **kwargs):
        steps = super().prefill_layers(*args, **kwargs)
        while True:
            try:
                layer = next(steps)
            except StopIteration as end:
                return end.value  # the first token
            self.computed += 1
            yield layer


@pytest.mark.parametrize("slice_s", [0.0, float("inf")], ids=["between-layers", "broken-whole"])
def test_an_abort_during_a_long_prefill_stops_it_between_layers(slice_s):
    """A prefill yields to the loop between layers once its slice has passed (a zero
    slice here: after every layer), so an ABORT that arrives meanwhile stops it: the other
    layers are never computed, the ack goes at once, nothing is written. Broken mode (the
    whole prefill inside the PREFILL handler) computes all four layers before it looks at
    the ABORT, and the test sees it."""
    model = _CountingLayers(ReplayConfig(layers=4, kv_heads=2, head_dim=32, max_positions=4096))
    rt = RecordingRuntime(rank=1)
    writer = PrefillRank.serving(
        rt,
        model,
        KVPool(model.pool_config(16, 64)),
        segment=None,
        head_range=(0, 2),
        router=0,
        prefill_slice_s=slice_s,
    )
    rt.deliver(m.PLAN, src=2, rid="r8", offset=0, total=2, pages=[5, 6], generations=[1, 1])
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r8",
        tokens=np.arange(20, dtype="<i4").tobytes(),
        offset=0,
        total=20,
        owner=2,
        owner_inc=1,
    )
    rt.pump_once()  # the prefill's first slice
    rt.deliver(m.ABORT, src=0, rid="r8", owner=2, writers=[1], source="client", reason="gone")
    rt.pump()
    rt.pump()
    if slice_s == 0.0:
        assert model.computed == 1
        assert rt.writes == [] and rt.kinds() == ["ABORT_ACK", "RELEASED"]
        assert writer.allocator.counts()["owned"] == 0
    else:
        assert model.computed == 4  # the test catches the prefill that never yields


def test_a_prefill_that_yields_between_layers_still_runs_them_all_and_writes():
    model = _CountingLayers(ReplayConfig(layers=4, kv_heads=2, head_dim=32, max_positions=4096))
    rt = RecordingRuntime(rank=1)
    PrefillRank.serving(
        rt,
        model,
        KVPool(model.pool_config(16, 64)),
        segment=None,
        head_range=(0, 2),
        router=0,
        prefill_slice_s=0.0,
    )
    rt.deliver(m.PLAN, src=2, rid="r9", offset=0, total=2, pages=[5, 6], generations=[1, 1])
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r9",
        tokens=np.arange(3, 23, dtype="<i4").tobytes(),
        offset=0,
        total=20,
        owner=2,
        owner_inc=1,
    )
    for _ in range(5):
        rt.pump()
    assert model.computed == 4
    assert rt.writes and "NOTICE" in rt.kinds()
    notice = next(f for _, k, f in rt.sent if k == "NOTICE")
    assert notice["first_token"] == 3  # the replay's first answer token: the prompt's first


def test_a_writer_acks_again_when_the_owner_asks_again():
    _, rt = _writer()
    for _ in range(2):
        rt.deliver(m.ABORT, src=2, rid="r2", owner=2, writers=[1], source="transfer", reason="t")
    assert rt.kinds() == ["RELEASED", "ABORT_ACK", "ABORT_ACK"]


# ---------------------------------------------------------------- I4 at an owner
class _Timer:
    def __init__(self, delay: float, fn) -> None:
        self.delay, self.fn, self.cancelled = delay, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class TimedRuntime(RecordingRuntime):
    """An owner's runtime: the protocol's timers are recorded and fired by the test (the
    log line of a lasting quarantine, which moves nothing, is left out); no rank is
    severed."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.timers: list[_Timer] = []
        self.log_timers: list[_Timer] = []

    def call_later(self, delay, fn, rid=None):
        logs_only = getattr(getattr(fn, "func", None), "__name__", "") == "_log_quarantine"
        timers = self.log_timers if logs_only else self.timers
        timers.append(_Timer(delay, fn))
        return timers[-1]

    def is_severed(self, rank) -> bool:
        return False

    def write_path_closed(self, rank, incarnation=None):
        return None  # every writer alive: no proof it is gone


def _assign_and_notice_fields(owner: DecodeRank, rt: TimedRuntime, rid: str, checksums: bool):
    """ASSIGN ``rid`` (40 prompt tokens, writer 1) to ``owner``; returns the fields of
    writer 1's whole NOTICE for the 3 pages its plan gives it (with their checksums, or
    none: checks off)."""
    rt.deliver(m.ASSIGN, src=0, rid=rid, prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    plan = next(f for _, k, f in rt.sent if k == "PLAN")
    pages, gens = plan["pages"][:3], plan["generations"][:3]
    slice_bytes = owner.pool.kv[0].numel() * owner.pool.kv.element_size()
    sums = page_checksums(owner.pool.kv, pages).tolist() if checksums else []
    return dict(
        rid=rid,
        tokens=40,
        offset=0,
        total=3,
        pages=pages,
        generations=gens,
        checksums=sums,
        bytes=3 * slice_bytes,
    )


def _owner(
    integrity: bool = True, rt: TimedRuntime | None = None, abort_deadline_s: float = 1.0
) -> tuple[DecodeRank, TimedRuntime]:
    """Decode rank 2 over ``rt`` (default: a TimedRuntime of its own)."""
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    rt = rt or TimedRuntime(rank=2)
    owner = DecodeRank.serving(
        rt,
        model,
        KVPool(model.pool_config(16, 64)),
        router=0,
        transfer_timeout_s=5.0,
        abort_deadline_s=abort_deadline_s,
        integrity=integrity,
    )
    return owner, rt


@pytest.mark.parametrize("every_writer", [True, False], ids=["every-writer", "broken-first-ack"])
def test_acks_that_overtake_the_abort_release_only_once_every_writer_acked(
    every_writer, monkeypatch
):
    """The router tells the writers before the owner, so a writer's ack can reach the
    owner before the ABORT does. The owner treats the first ack as the abort: it
    quarantines the pages, leaves asking the other writer to its first retry (the router
    told it in the same fan-out), and releases them only once that writer acked too.
    Broken mode (an owner that counts one ack as all) releases the pages while writer 3
    may still write them, and the test sees it."""
    if not every_writer:
        monkeypatch.setattr(OwnerBook, "writers_done", lambda self: bool(self.acked))
    owner, rt = _owner()
    rt.deliver(m.ASSIGN, src=0, rid="r5", prompt_len=40, max_tokens=8, writers=[1, 3], last_token=7)
    assert owner.allocator.counts()["owned"] == 3
    rt.sent.clear()
    rt.deliver(m.ABORT_ACK, src=1, rid="r5")
    if not every_writer:
        assert "RELEASED" in rt.kinds()  # the test catches the early release
        return
    assert owner.reqs["r5"].state is OwnerState.QUARANTINED
    assert owner.allocator.counts()["quarantined"] == 3
    assert rt.sent == []
    retry = [t for t in rt.timers if t.delay < owner.abort_deadline_s and not t.cancelled]
    assert len(retry) == 1
    retry[0].fn()
    assert [(to, k) for to, k, _ in rt.sent] == [(3, "ABORT")]
    rt.deliver(m.ABORT_ACK, src=3, rid="r5")
    released = [f for _, k, f in rt.sent if k == "RELEASED"]
    assert [(f["pages"], f["how"]) for f in released] == [(3, "acked")]
    assert owner.allocator.counts()["quarantined"] == 0
    assert owner.allocator.counts()["free"] == 64
    rt.deliver(m.ABORT, src=0, rid="r5", owner=2, writers=[1, 3], source="client", reason="gone")
    assert [k for _, k, _ in rt.sent].count("RELEASED") == 1  # the late ABORT finds a tombstone


def test_an_ack_that_overtakes_the_abort_during_decode_stops_the_request():
    """Every writer noticed and decode runs; the writer's ack of the router's abort
    arrives first. The owner stops decoding and frees the pages at once ("freed": the
    notices, not the ack, proved the writes done)."""
    owner, rt = _owner(integrity=False)
    rt.deliver(m.NOTICE, src=1, **_assign_and_notice_fields(owner, rt, "r7", checksums=False))
    rt.pump()  # the checks run from the loop, in slices
    assert owner.busy() and owner.step()
    rt.sent.clear()
    rt.deliver(m.ABORT_ACK, src=1, rid="r7")
    assert not owner.busy() and not owner.step()
    assert [(k, f.get("how")) for _, k, f in rt.sent] == [("RELEASED", "freed")]
    assert owner.allocator.counts()["free"] == 64


@pytest.mark.parametrize("retries", [True, False], ids=["retries", "broken-no-retry"])
def test_the_owner_asks_writers_again_only_after_the_routers_abort_had_time(retries, monkeypatch):
    """The router's ABORT went to the writers too, so the owner does not repeat it at
    once; if the router's copy to a writer was lost, the owner's first retry asks it,
    well inside the abort deadline. Broken mode (an owner that leaves asking to the
    router alone, with no retry) keeps the pages quarantined until the deadline, and the
    test sees it."""
    if not retries:
        monkeypatch.setattr(OwnerDriver, "arm_retry", lambda self, req: None)
    owner, rt = _owner()
    rt.deliver(m.ASSIGN, src=0, rid="r6", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    rt.sent.clear()
    rt.deliver(m.ABORT, src=0, rid="r6", owner=2, writers=[1], source="client", reason="gone")
    assert rt.kinds() == [] and owner.reqs["r6"].state is OwnerState.QUARANTINED
    early = [t for t in rt.timers if t.delay < owner.abort_deadline_s and not t.cancelled]
    if not retries:
        assert early == []  # the test catches the missing retry
        assert owner.allocator.counts()["quarantined"] == 3
        return
    assert len(early) == 1
    early[0].fn()
    assert [(to, k) for to, k, _ in rt.sent] == [(1, "ABORT")]
    rt.deliver(m.ABORT_ACK, src=1, rid="r6")
    assert [f["how"] for _, k, f in rt.sent if k == "RELEASED"] == ["acked"]


class _ForgetsLiveRequests(dict):
    """BROKEN MODE: an owner's request table whose lookups never find a live request, as
    an owner that took every ASSIGN for a new request would."""

    def get(self, key, default=None):
        return default


@pytest.mark.parametrize("broken", [False, True], ids=["first-stands", "broken-reassigned"])
def test_a_second_assign_of_a_live_request_is_logged_and_the_first_stands(caplog, broken):
    """ASSIGN goes once per request, so a second one for a live request is the router's
    bug: the owner logs it as an error with both assignments' numbers and counts it, and
    the first assignment stands (its pages, its writers, nothing planned again). Broken
    mode: an owner that takes the second for a new request is caught."""
    owner, rt = _owner()
    rt.deliver(m.ASSIGN, src=0, rid="r30", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    first = owner.reqs["r30"]
    grants, sent, counts = list(first.grants), list(rt.sent), owner.allocator.counts()
    if broken:
        owner.reqs = _ForgetsLiveRequests(owner.reqs)
    with caplog.at_level(logging.DEBUG, logger="kvferry.cluster"):
        rt.deliver(
            m.ASSIGN, src=0, rid="r30", prompt_len=100, max_tokens=4, writers=[1, 3], last_token=7
        )
    stands = (
        owner.reqs["r30"] is first
        and first.grants == grants
        and first.writers == [1]
        and rt.sent == sent
        and owner.allocator.counts() == counts
    )
    if broken:
        assert not stands, "an owner that reassigns a live request was not caught"
        return
    assert stands
    assert owner.duplicate_assigns == 1 and owner.stats()["duplicate_assigns"] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "request r30" in errors[0]
    assert "first: prompt_len 40, max_tokens 8, writers [1];" in errors[0]
    assert "second: prompt_len 100, max_tokens 4, writers [1, 3]" in errors[0]


def test_a_decode_ranks_second_assigns_reach_metrics():
    """The decode rank's count of second ASSIGNs goes out in its STATS and reaches the
    router's /metrics as dropped messages of reason ``duplicate_assign``; a rank that
    sends no such count (a prefill rank) gets no such series."""
    owner, rt = _owner()
    for _ in range(2):
        rt.deliver(
            m.ASSIGN, src=0, rid="r32", prompt_len=40, max_tokens=8, writers=[1], last_token=7
        )
    count = owner.stats()["duplicate_assigns"]
    assert count == 1
    router, router_rt = _routed(decode=1)
    router_rt.deliver(m.STATS, src=2, **STATS, dropped_duplicate_assign=count)
    text = router.metrics.render()[0].decode()
    assert 'kvferry_dropped_messages{rank="2",reason="duplicate_assign"} 1.0' in text
    assert 'rank="1",reason="duplicate_assign"' not in text
    assert router.rank_stats[2]["dropped"]["duplicate_assign"] == 1


def test_an_assign_after_its_request_ended_is_dropped_quietly(caplog):
    """A late ASSIGN of a request its owner already released is the ordinary late message
    (I2): dropped at debug level, not counted as the router's bug, nothing allocated."""
    owner, rt = _owner()
    rt.deliver(m.ASSIGN, src=0, rid="r31", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    rt.deliver(m.ABORT, src=0, rid="r31", owner=2, writers=[1], source="client", reason="gone")
    rt.deliver(m.ABORT_ACK, src=1, rid="r31")
    assert "r31" in owner.tombstones and "r31" not in owner.reqs
    sent, counts = list(rt.sent), owner.allocator.counts()
    with caplog.at_level(logging.DEBUG, logger="kvferry.cluster"):
        rt.deliver(
            m.ASSIGN, src=0, rid="r31", prompt_len=40, max_tokens=8, writers=[1], last_token=7
        )
    assert "r31" not in owner.reqs and rt.sent == sent and owner.allocator.counts() == counts
    assert owner.duplicate_assigns == 0
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "r31" in caplog.records[0].getMessage()


# ---------------------------------------------------------------- I6 at the router
def _card(rank: int, role: str) -> RankCard:
    return RankCard(
        rank=rank,
        role=role,
        address=b"",
        incarnation=1,
        segment=None,
        num_pages=64,
        page_size=16,
        capacity_tokens=1024,
        context_length=1024,
        host="h",
        pid=rank,
    )


STATS = dict(
    free=64, owned=0, quarantined=0, capacity_tokens=1024, context_length=1024,
    bytes_written=0, batches=0, integrity_failures=0, severed=0, allocations=0,
    dropped_duplicate=0, dropped_stale=0, dropped_malformed=0,
)  # fmt: skip


def _routed(
    reports: Literal["stats", "assumed", "none"] = "stats",
    admission_wait_s: float = 1,
    *,
    decode: int = 1,
    runtime: Callable[..., Any] = RecordingRuntime,
    pid: int | None = None,
) -> tuple[Router, Any]:
    """The router (rank 0) of prefill rank 1 and ``decode`` decode ranks (2, 3, ...), over
    ``runtime(rank=0, cards=cards)``; every card's process is ``pid`` (default: its rank,
    none). ``reports``: "stats": every rank reports its pool (STATS on a recording
    runtime), "assumed": the router is told each has (a runtime the test delivers nothing
    on), "none": just started, admitting nothing yet."""
    roles = ["router", "prefill"] + ["decode"] * decode
    cards = {r: _card(r, role) for r, role in enumerate(roles)}
    if pid is not None:
        cards = {r: dataclasses.replace(card, pid=pid) for r, card in cards.items()}
    rt = runtime(rank=0, cards=cards)
    router = Router(
        rt,
        Topology(len(roles), 1, decode),
        cards,
        context_length=1024,
        request_timeout_s=30,
        admission_wait_s=admission_wait_s,
        metrics=ClusterMetrics(),
    )
    if reports == "stats":  # every rank reports: the router admits from now on
        for r in range(1, len(roles)):
            rt.deliver(m.STATS, src=r, **STATS)
    elif reports == "assumed":
        router.awaiting_reports.clear()
    return router, rt


class _Tokenized(AssertionError):
    """The prompt's tokens were made."""


@pytest.mark.parametrize("char", ["a", "\u00e9"], ids=["ascii", "two-byte"])
@pytest.mark.parametrize("early", [True, False], ids=["length-first", "broken-tokens-first"])
def test_an_over_long_prompt_is_refused_before_its_tokens_are_made(monkeypatch, char, early):
    """The router refuses a prompt past the context length on its length alone (a byte a
    token), with the numbers the tokens would give, before it spends four bytes a token
    on them; a prompt at the limit is admitted. Broken mode: a router that makes the
    tokens to learn their count calls the tokenizer for a prompt it then refuses."""
    if not early:
        monkeypatch.setattr(
            router_module, "token_count", lambda text: len(router_module.tokenize(text))
        )
    width = len(char.encode())
    long_prompt = char * (1024 // width)  # 1024 tokens: with max_tokens 1, one past 1024

    def refuse(text: str):
        raise _Tokenized(f"tokenizer called on a {len(text)}-character prompt")

    async def run():
        router, _ = _routed()
        monkeypatch.setattr(router_module, "tokenize", refuse)
        if not early:
            with pytest.raises(_Tokenized):
                await router.submit(long_prompt, 1)
            return  # the test catches the tokens made first
        with pytest.raises(AdmissionRejected) as refused:
            await router.submit(long_prompt, 1)
        assert refused.value.prompt_tokens == len(tokenize(long_prompt)) == 1024
        assert str(refused.value).endswith(
            "(prompt 1024 tokens + max_tokens 1 = 1025; context length 1024; "
            "pool capacity 1024 tokens)"
        )
        monkeypatch.setattr(router_module, "tokenize", tokenize)
        at_limit = long_prompt[:-1] + "a" * (width - 1)  # 1023 tokens + 1 = 1024
        routed = await router.submit(at_limit, 1)
        assert routed.req.prompt_len == 1023 and routed.req.live

    asyncio.run(run())


def _chunks(text: str, size: int) -> list[tuple[int, list[int]]]:
    codes = list(text.encode())
    return [(i, codes[i : i + size]) for i in range(0, len(codes), size)]


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_router_answers_the_tokens_in_their_place_whatever_the_arrival_order(order):
    async def run():
        router, rt = _routed()
        routed = await router.submit("the answer must come back in order", 34)
        chunks = _chunks("the answer must come back in order", 16)
        if order == "reversed":
            chunks.reverse()
        for offset, toks in chunks[:-1]:
            rt.deliver(m.TOKENS, src=2, rid=routed.rid, offset=offset, tokens=toks)
        rt.deliver(
            m.DONE,
            src=2,
            rid=routed.rid,
            outcome="finished",
            error=None,
            count=34,
            transfer_ms=None,
        )
        assert routed.outcome is None  # a chunk is still missing: no answer yet
        offset, toks = chunks[-1]
        rt.deliver(m.TOKENS, src=2, rid=routed.rid, offset=offset, tokens=toks)
        assert routed.outcome == "ok"
        assert routed.text == "the answer must come back in order"

    asyncio.run(run())


def test_router_fails_a_request_whose_tokens_never_all_arrive():
    async def run():
        router, rt = _routed()
        routed = await router.submit("abcdefghijklmnopqrstuvwxyz0123456789", 36)
        first = _chunks("abcdefghijklmnopqrstuvwxyz0123456789", 16)
        rt.deliver(m.TOKENS, src=2, rid=routed.rid, offset=0, tokens=first[0][1])
        rt.deliver(m.TOKENS, src=2, rid=routed.rid, offset=32, tokens=first[2][1])
        rt.deliver(
            m.DONE,
            src=2,
            rid=routed.rid,
            outcome="finished",
            error=None,
            count=36,
            transfer_ms=None,
        )
        event = await asyncio.wait_for(_until_done(routed), timeout=5)
        assert event[1] == "failed" and "36" in event[2]
        assert routed.outcome == "failed"  # never ok with a gap in the answer

    asyncio.run(run())


async def _until_done(routed):
    while True:
        event = await routed.events.get()
        if event[0] == "done":
            return event


@pytest.mark.parametrize("owner_host", ["h", "elsewhere"])
def test_router_times_an_abort_to_the_owners_release(owner_host):
    """On one host the owner's release time is read on the shared monotonic clock; an
    owner on another host is timed until its RELEASED arrives (an upper bound)."""

    async def run():
        router, rt = _routed()
        router.cards[2] = dataclasses.replace(router.cards[2], host=owner_host)
        routed = await router.submit("abort me", 8)
        router.abort(routed.rid, "client", "gone")
        released_ns = round(routed.aborted_at * 1e9) + 1_500_000  # the owner released 1.5 ms later
        rt.deliver(
            m.RELEASED, src=1, rid=routed.rid, pages=1, how="aborted", justification="own-flush"
        )
        rt.deliver(
            m.RELEASED,
            src=2,
            rid=routed.rid,
            pages=1,
            how="acked",
            justification="acked",
            abort_ms=0.4,
            released_ns=released_ns,
        )
        arrived_by_ms = (time.monotonic() - routed.aborted_at) * 1e3
        times = router.abort_release_summary()["recent_from_router"]
        assert len(times) == 1  # the owner's release, not the writer's
        if owner_host == "h":
            assert times == [1.5]
        else:  # until its RELEASED arrived here
            assert 0.0 <= times[0] <= arrived_by_ms + 1e-3

    asyncio.run(run())


@pytest.mark.parametrize("checked", [True, False], ids=["checked-at-read", "broken-arrival-only"])
def test_a_page_that_loses_its_owner_mid_decode_fails_the_request_at_the_next_step(
    checked, monkeypatch
):
    """I5 at every decode step: the request was verified on arrival and decodes; then one
    of its pages' canary names another request (an allocator or page-table bug). The next
    step fails the request with the integrity error and gives it no token. Broken mode
    (checks on arrival only) decodes on over the foreign page, and the test sees it."""
    from kvferry.engine.integrity import Canary, request_id_hash

    if not checked:
        monkeypatch.setattr(
            DecodePath, "still_owned", lambda self, batch, table: list(range(len(batch)))
        )
    owner, rt = _owner(integrity=True)
    notice = _assign_and_notice_fields(owner, rt, "r11", checksums=True)
    pages, gens = notice["pages"], notice["generations"]
    rt.deliver(m.NOTICE, src=1, **notice)
    rt.pump()
    assert owner.busy() and owner.step()  # verified, decoding
    owner.path.canaries.stamp([pages[1]], [Canary(request_id_hash("another"), gens[1], 1)])
    rt.sent.clear()
    owner.step()
    if not checked:
        assert "TOKENS" in rt.kinds() or owner.busy()  # the test catches the read
        return
    assert "TOKENS" not in rt.kinds() and not owner.busy()
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed" and "foreign request" in done["error"]
    assert owner.integrity_failures == 1 and owner.allocator.counts()["free"] == 64


# ---------------------------------------------------------------- the router's reservations
@pytest.mark.parametrize("reports", [True, False], ids=["reports", "broken-silent"])
def test_an_abort_before_its_assign_tells_the_router_nothing_is_held(reports):
    """The router reserved pages on the owner when it routed the request; an ABORT that
    reaches the owner before the ASSIGN (or instead of it) must end that reservation with
    RELEASED(0), once. Broken mode (an owner table that only tombstones) leaves the
    router counting the pages for ever, and the test sees it."""
    from kvferry.engine.protocol.owner import OwnerDo, OwnerEvent
    from kvferry.engine.protocol.table import Move, replace

    owner, rt = _owner()
    if not reports:
        owner.table = replace(
            owner.table,
            {
                (OwnerState.NEW, OwnerEvent.ABORT_FLUSHED): Move(
                    OwnerState.CLOSED, (OwnerDo.TOMBSTONE,)
                )
            },
        )
    for _ in range(2):
        rt.deliver(m.ABORT, src=0, rid="r20", owner=2, writers=[1], source="client", reason="gone")
    released = [f for _, k, f in rt.sent if k == "RELEASED"]
    if not reports:
        assert released == []  # the test catches the reservation never ended
        return
    assert [(f["pages"], f["how"]) for f in released] == [(0, "freed")]
    rt.deliver(m.ASSIGN, src=0, rid="r20", prompt_len=40, max_tokens=8, writers=[1], last_token=3)
    assert owner.allocator.counts()["owned"] == 0  # the late ASSIGN finds the tombstone


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "broken-flat"])
def test_the_transfer_timeout_grows_with_the_prompt(scaled, monkeypatch):
    """A million-token prompt's prefill, checksums and copy take time in proportion to it:
    the owner waits 16 x the base timeout for it (per 65,536 tokens), and the base for a
    short one. Broken mode (one flat timeout) times the long prompt out, and the test sees
    it."""
    from kvferry.engine.protocol import owner_driver

    if not scaled:
        monkeypatch.setattr(owner_driver, "TIMEOUT_TOKENS", 1 << 40)
    owner, _ = _owner()
    assert owner.transfer_timeout_for(40) == owner.transfer_timeout_s
    long_wait = owner.transfer_timeout_for(1 << 20)
    if not scaled:
        assert long_wait == owner.transfer_timeout_s  # the test catches the flat timeout
        return
    assert long_wait == 16 * owner.transfer_timeout_s


# ---------------------------------------------------------------- every release carries its proof
@pytest.mark.parametrize("table", ["safe", "broken-unsafe"])
def test_every_release_says_which_proof_made_it_safe(table):
    """I4: writer 1 acks, writer 3 is silent and then proven gone (its process exited).
    While quarantined, /status's line names the pages, whom they wait on and the proofs
    so far; the release records ``acked+process-gone`` in RELEASED (the router counts it
    in ``kvferry_releases_total{justification}``). Broken mode: the unsafe table frees
    at the abort, and its release says ``none``."""
    from kvferry.engine.protocol.owner import owner_table
    from kvferry.engine.protocol.proof import Proof, is_justified

    owner, rt = _owner()
    if table != "safe":
        owner.table = owner_table(unsafe=True)
    rt.deliver(m.ASSIGN, src=0, rid="r9", prompt_len=40, max_tokens=8, writers=[1, 3], last_token=7)
    rt.sent.clear()
    rt.deliver(m.ABORT, src=0, rid="r9", owner=2, writers=[1, 3], source="client", reason="gone")
    if table != "safe":
        released = [f for _, k, f in rt.sent if k == "RELEASED"]
        assert [f["justification"] for f in released] == ["none"]
        assert not is_justified(released[0]["justification"])
        return
    rt.deliver(m.ABORT_ACK, src=1, rid="r9")
    (line,) = owner.quarantines()
    assert line.startswith("r9 pages=3 state=quarantined") and "waiting=[3:" in line
    assert "proven=[1:acked]" in line
    rt.write_path_closed = lambda rank, inc=None: Proof.PROCESS_GONE if rank == 3 else None
    rt.sever = lambda rank, reason: rt.sent.append((rank, "(severed)", {}))
    rt.cards.update({r: _card(r, role) for r, role in ((1, "prefill"), (3, "prefill"))})
    retry = [t for t in rt.timers if t.delay < owner.abort_deadline_s and not t.cancelled]
    retry[0].fn()  # writer 3 is gone: fenced at once, then its proof is taken
    for t in [t for t in rt.timers if not t.cancelled and t not in retry]:
        t.fn()
    released = [f for _, k, f in rt.sent if k == "RELEASED"]
    assert [(f["pages"], f["justification"]) for f in released] == [(3, "acked+process-gone")]
    assert is_justified(released[0]["justification"]) and owner.quarantines() == []


# ---------------------------------------------------------------- a router that is gone
@pytest.mark.parametrize("ends", [True, False], ids=["ends-them", "broken-decodes-on"])
def test_a_restarted_router_s_requests_end_at_once_through_the_protocol(ends, monkeypatch):
    """The router (rank 0, incarnation 1) dies and comes back as incarnation 2. A request
    its old incarnation assigned is decoding here with nobody to read its tokens: it ends
    when the rank adopts the new card (DONE failed, pages freed: every writer noticed),
    not after max_tokens steps of failed sends. Broken mode: a rank that ignores the
    router's restart keeps decoding it, and the test sees it."""
    if not ends:
        monkeypatch.setattr(DecodeRank, "_end_requests_of_router", lambda self, old, new: None)
    owner, rt = _owner(integrity=False)
    rt.cards.update({0: _card(0, "router"), 1: _card(1, "prefill"), 2: _card(2, "decode")})
    rt.deliver(m.NOTICE, src=1, **_assign_and_notice_fields(owner, rt, "r8", checksums=False))
    rt.pump()
    assert owner.busy() and owner.step()
    rt.sent.clear()
    old = rt.cards[0]
    rt.cards[0] = dataclasses.replace(old, incarnation=2, pid=7)
    owner._on_card_replaced(old, rt.cards[0])
    if not ends:
        assert owner.busy()  # the test catches the request decoding on
        return
    assert not owner.busy() and not owner.step()
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed" and "router rank 0 restarted" in done["error"]
    released = next(f for _, k, f in rt.sent if k == "RELEASED")
    assert released["pages"] == 3 and released["justification"] == "noticed"
    assert owner.allocator.counts()["free"] == 64


def test_a_writer_stops_the_requests_of_a_restarted_router():
    """The writer holds a plan-less request from router incarnation 1: the restart fails
    it here (nothing was posted: it acks and frees at once)."""
    writer, rt = _writer()
    rt.cards.update({0: _card(0, "router"), 2: _card(2, "decode")})
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r4",
        tokens=np.arange(20, dtype="<i4").tobytes(),
        offset=0,
        total=20,
        owner=2,
        owner_inc=1,
    )
    rt.pump()
    assert "r4" in writer.jobs
    old = rt.cards[0]
    writer._on_card_replaced(old, dataclasses.replace(old, incarnation=2))
    rt.pump()
    assert "r4" not in writer.jobs and writer.allocator.counts()["owned"] == 0
    assert "ABORT" in rt.kinds()


# ---------------------------------------------------------------- a restarted router
@pytest.mark.parametrize("gated", [True, False], ids=["waits-for-reports", "broken-admits-blind"])
def test_a_router_admits_nothing_until_every_live_rank_has_reported(gated, monkeypatch):
    """A restarted router knows nothing of what the pools hold for its old incarnation's
    requests (here the decode rank still holds 60 of its 64 pages, quarantined). Until
    every live rank has sent its STATS, nothing is admitted: a request waits, and gets 503
    naming the silent ranks if none report in time. Once both report, a request that
    fits in what is really free is placed; one that does not waits for room. Broken mode:
    a router that admits before the reports places a 40-page request on the decode
    rank's quarantined pages, and the test sees it."""
    from kvferry.cluster.router import Unavailable

    if not gated:
        monkeypatch.setattr(Router, "waiting_for_reports", lambda self: [])

    async def run():
        router, rt = _routed("none", admission_wait_s=0.05)
        prompt = "x" * (40 * 16 - 8)  # 40 pages of prompt and answer at the decode rank
        if not gated:
            routed = await router.submit(prompt, 8)
            assert routed.owner == 2  # the test catches the blind admission
            return
        with pytest.raises(Unavailable, match=r"ranks \[1, 2\] have not reported"):
            await router.submit(prompt, 8)
        assert router.status()["awaiting_reports"] == [1, 2]
        rt.deliver(m.STATS, src=1, **STATS)
        rt.deliver(m.STATS, src=2, **{**STATS, "free": 4, "quarantined": 60})
        assert router.waiting_for_reports() == [] and router.ledger.free(2) == 4
        with pytest.raises(Unavailable, match="no pool has room for 40 pages"):
            await router.submit(prompt, 8)
        small = await router.submit("tiny", 8)
        assert small.owner == 2

    asyncio.run(run())


# ---------------------------------------------------------------- prefill groups sharing heads
@pytest.mark.parametrize(
    "kv_heads, tp, head_of",
    [
        (2, 4, {1: (0, 1), 3: (1, 2)}),  # replicated GQA: ranks 2 and 4 write nothing
        (3, 2, {1: (0, 1), 2: (1, 3)}),  # uneven: the second member writes two heads
    ],
    ids=["gqa-replicated", "uneven"],
)
@pytest.mark.parametrize("listed", ["writing-members", "broken-every-member", "broken-even-split"])
def test_an_owner_checks_each_writing_member_against_the_heads_it_writes(
    listed, kv_heads, tp, head_of, monkeypatch
):
    """A prefill group of 4 over 2 KV heads: members 0 and 1 share head 0, members 2 and
    3 head 1, and only the first holder of each writes it (ranks 1 and 3 of ranks 1-4);
    a group of 2 over 3 heads: the second member writes two. The owner checks each
    writer's notice against that writer's heads, and verifies. Broken modes: a router
    that lists every member as a writer (the owner would wait for notices that never
    come, and check heads against the wrong writers): the owner refuses the ASSIGN with
    the numbers before it allocates a page; an owner that splits the heads evenly over
    its writers (as before uneven groups): the uneven group's checks fail."""
    if listed == "broken-even-split":
        monkeypatch.setattr(
            DecodePath,
            "heads_of",
            lambda self, req, w: (
                req.writers.index(w) * (kv_heads // len(req.writers)),
                (req.writers.index(w) + 1) * (kv_heads // len(req.writers)),
            ),
        )
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=kv_heads, head_dim=32, max_positions=4096))
    rt = TimedRuntime(rank=5)
    owner = DecodeRank.serving(
        rt,
        model,
        KVPool(model.pool_config(16, 64)),
        router=0,
        transfer_timeout_s=5.0,
        abort_deadline_s=1.0,
        prefill_tp=tp,
    )
    writers = [1, 2, 3, 4] if listed == "broken-every-member" else sorted(head_of)
    rt.deliver(
        m.ASSIGN, src=0, rid="g1", prompt_len=40, max_tokens=8, writers=writers, last_token=7
    )
    if listed == "broken-every-member":
        assert "g1" not in owner.reqs and owner.allocator.counts()["owned"] == 0
        assert "PLAN" not in rt.kinds()
        done = next(f for _, k, f in rt.sent if k == "DONE")
        assert done["outcome"] == "failed"
        why = (
            f"4 writers [1, 2, 3, 4] listed, but a prefill group of {tp} has {len(head_of)} "
            "writing members"
        )
        assert why in done["error"]
        aborts = [(to, f["reason"]) for to, k, f in rt.sent if k == "ABORT"]
        assert [to for to, _ in aborts] == writers and all(why in r for _, r in aborts)
        return
    plan = next(f for _, k, f in rt.sent if k == "PLAN")
    pages, gens = plan["pages"][:3], plan["generations"][:3]
    kv = owner.pool.kv
    kv[pages] = torch.randn(len(pages), *kv.shape[1:]).to(kv.dtype)  # what landed
    for w in writers:
        lo, hi = head_of[w]
        view = kv[:, :, :, lo:hi]
        rt.deliver(
            m.NOTICE,
            src=w,
            rid="g1",
            tokens=40,
            offset=0,
            total=3,
            pages=pages,
            generations=gens,
            checksums=page_checksums(view, pages).tolist(),
            bytes=3 * view[0].numel() * view.element_size(),
        )
    rt.pump()
    if listed == "broken-even-split":
        evenly_split = kv_heads % len(writers) == 0
        assert (owner.reqs.get("g1") is not None) == evenly_split  # caught when uneven
        return
    assert owner.reqs["g1"].state is OwnerState.DECODING
