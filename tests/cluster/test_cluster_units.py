"""Unit and property tests of the cluster's pieces that need no processes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster import messages as m
from kvferry.cluster.faults import FaultPlan, FaultSpecError
from kvferry.cluster.harness.workload import MARKER_RE, expected_replay, make_prompt
from kvferry.cluster.rendezvous import RankCard, RendezvousError
from kvferry.cluster.router import Ledger
from kvferry.cluster.runtime import RankRuntime
from kvferry.cluster.topology import (
    HeadSplit,
    Role,
    Topology,
    TopologyError,
)
from kvferry.engine.protocol.words import Kind
from kvferry.engine.tokenizer import encode as tokenize
from kvferry.transfer import BatchStatus, PeerFailedError, WireError


# ---------------------------------------------------------------- topology
def test_topology_roles_and_groups():
    t = Topology(world_size=6, prefill=4, decode=1, tp=2)
    assert [t.role(r) for r in range(6)] == [Role.ROUTER] + [Role.PREFILL] * 4 + [Role.DECODE]
    assert t.prefill_groups == [[1, 2], [3, 4]]
    assert t.group_of(4) == (1, 1)
    assert Topology.for_world(3, None).decode_ranks == [2]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=4, prefill=3, decode=1, tp=2),
        dict(world_size=5, prefill=2, decode=1),
        dict(world_size=2, prefill=1, decode=0),
    ],
)
def test_topology_refuses_bad_shapes(kwargs):
    with pytest.raises(TopologyError):
        Topology(**kwargs)


@pytest.mark.parametrize(
    "tp, kv_heads, writes",
    [
        (1, 2, [(0, 2)]),
        (2, 4, [(0, 2), (2, 4)]),
        (2, 3, [(0, 1), (1, 3)]),  # uneven: the last member takes one more
        (4, 2, [(0, 1), None, (1, 2), None]),  # replicated GQA: first holder writes
        (4, 3, [(0, 1), None, (1, 2), (2, 3)]),
        (4, 1, [(0, 1), None, None, None]),
    ],
)
def test_a_prefill_group_writes_every_head_into_one_decode_rank_once(tp, kv_heads, writes):
    split = HeadSplit(kv_heads, tp)
    assert _writes(split) == writes
    written = [h for lo_hi in writes if lo_hi for h in range(*lo_hi)]
    assert written == list(range(kv_heads))
    for position, lo_hi in enumerate(writes):  # a writer writes exactly what it holds
        assert lo_hi is None or lo_hi == split.writer_heads(position)
    assert split.writers_of(0) == [w for w, h in enumerate(writes) if h]


def _writes(split: HeadSplit) -> list[tuple[int, int] | None]:
    """Per prefill member, the heads it writes into decode member 0 (None: nothing)."""
    return [split.pairs.get((w, 0)) for w in range(split.tp)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 9))
def test_a_prefill_group_covers_every_head_once_for_any_pair(tp, kv_heads):
    writes = _writes(HeadSplit(kv_heads, tp))
    written = sorted(h for lo_hi in writes if lo_hi for h in range(*lo_hi))
    assert written == list(range(kv_heads))
    assert sum(w is not None for w in writes) == min(tp, kv_heads)


def test_topology_decode_groups():
    t = Topology(world_size=7, prefill=2, decode=4, tp=1, decode_tp=2)
    assert t.decode_groups == [[3, 4], [5, 6]]
    assert t.decode_member(6) == (1, 1)
    with pytest.raises(TopologyError, match="multiple of the decode tensor-parallel size"):
        Topology(world_size=6, prefill=2, decode=3, decode_tp=2)
    # the default prefill count leaves whole decode groups
    assert Topology.for_world(7, None, decode_tp=2).decode == 4
    assert Topology.for_world(6, None, tp=1, decode_tp=4).decode == 4
    assert Topology.for_world(8, None, tp=2, decode_tp=3).decode == 3


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [1, 2, 3, 4, 8])
def test_head_split_gives_every_owner_each_of_its_heads_from_one_writer(tp, decode_tp, kv_heads):
    split = HeadSplit(kv_heads, tp, decode_tp)
    for owner in range(decode_tp):
        lo, hi = split.owner_heads(owner)
        got = sorted(h for w in split.writers_of(owner) for h in range(*split.pairs[(w, owner)]))
        assert got == list(range(lo, hi))  # each head it holds, once
        for w in split.writers_of(owner):  # a writer writes only heads it holds
            wlo, whi = split.writer_heads(w)
            plo, phi = split.pairs[(w, owner)]
            assert wlo <= plo < phi <= whi
            llo, lhi = split.local_heads(w, owner)
            assert (llo, lhi) == (plo - lo, phi - lo) and 0 <= llo < lhi <= hi - lo
    assert {w for w in range(tp) if split.owners_of(w)} == {w for (w, _) in split.pairs}
    if decode_tp == 1:  # a decode rank of every head: each member's own heads, or none
        assert all(h is None or h == split.writer_heads(w) for w, h in enumerate(_writes(split)))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_replicated_kv_gives_each_owner_every_head_from_one_writer(tp, decode_tp):
    split = HeadSplit(1, tp, decode_tp, replicated=True)
    for owner in range(decode_tp):
        assert split.owner_heads(owner) == (0, 1)
        assert split.writers_of(owner) == [owner * tp // decode_tp]
        assert split.local_heads(owner * tp // decode_tp, owner) == (0, 1)
    assert all(split.writer_heads(w) == (0, 1) for w in range(tp))
    assert sum(len(split.owners_of(w)) for w in range(tp)) == decode_tp  # one copy each


# ---------------------------------------------------------------- wire
HEADER = dict(src=3, inc=(1 << 64) - 1, seq=7)


def test_every_message_kind_round_trips():
    samples = {
        "PREFILL": dict(
            rid="r", tokens=b"\x01\x00\x00\x00", offset=0, total=1, owner=2, owner_inc=5
        ),
        "ASSIGN": dict(
            rid="r",
            prompt_len=1,
            max_tokens=2,
            writers=[1, 2],
            last_token=65,
            group_rids=["r", "r.1"],
            group_ranks=[3, 4],
        ),
        "PLAN": dict(rid="r", offset=0, total=2, pages=[1, 2], generations=[3, 4]),
        "NOTICE": dict(
            rid="r",
            tokens=3,
            offset=0,
            total=1,
            pages=[1],
            generations=[2],
            checksums=[9],
            bytes=4,
            prefill_ms=2.5,
        ),
        "NOTICE_PART": dict(rid="r", offset=4, pages=[1, 2], generations=[2, 2], checksums=[9, 8]),
        "TOKENS": dict(rid="r", offset=0, tokens=[65, 66]),
        "DONE": dict(rid="r", outcome="finished", error=None, count=2, transfer_ms=1.5),
        "ABORT": dict(rid="r", owner=2, writers=[1], source="client", reason="gone"),
        "ABORT_ACK": dict(rid="r"),
        "RELEASED": dict(rid="r", pages=3, how="acked", justification="acked", abort_ms=0.5),
        "SEVERED": dict(peer_rank=1, incarnation=9, reason="no ack"),
        "SHUTDOWN": dict(),
        "MEMBER_READY": dict(rid="r", member=1),
        "ATTEND": dict(
            step=3, layer=1, rids=["r.1", "s.1"], positions=[40, 77], q=b"q" * 8, k=b"k", v=b"v"
        ),
        "ATTENDED": dict(
            step=3, layer=1, rids=["s.1", "s.2"], out=b"o" * 8, failed=["s.1"], error="s.1: aborted"
        ),
        "STEPPED": dict(rids=["r.1"], tokens=[66]),
    }
    for kind, fields in samples.items():
        msg = m.KINDS[kind].make(**HEADER, **fields)
        assert m.decode(m.encode(msg)) == msg
    assert set(samples) | {"STATS"} == set(m.KINDS)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoding_random_bytes_raises_only_wire_errors(data):
    try:
        m.decode(data)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=8),
            st.binary(max_size=8),
            st.none(),
            st.lists(st.integers(-(2**63), 2**63), max_size=4),
        ),
        max_size=8,
    ),
    st.sampled_from(sorted(m.KINDS)),
)
def test_decoding_mistyped_fields_is_refused_or_valid(fields, kind):
    data = msgpack.packb(["kvf.cluster", m.CODEC.version, kind, fields], use_bin_type=True)
    try:
        msg = m.decode(data)
    except WireError:
        return
    assert set(msg.fields) == set(m.KINDS[kind].fields)


def test_decoding_refuses_other_versions_and_oversize():
    good = m.encode(m.ABORT_ACK.make(**HEADER, rid="r"))
    obj = msgpack.unpackb(good)
    obj[1] = m.CODEC.version + 1
    with pytest.raises(WireError, match="version"):
        m.decode(msgpack.packb(obj))
    with pytest.raises(WireError):
        m.decode(b"\x00" * (m.CODEC.max_bytes + 1))
    with pytest.raises(WireError):
        m.encode(m.ABORT_ACK.make(**HEADER, rid="x" * (m.MAX_REQUEST_ID + 1)))


# ---------------------------------------------------------------- router ledger
def test_ledger_counts_pages_of_ended_requests_until_released():
    led = Ledger({1: 10, 2: 10})
    led.reserve(2, "a", 6)
    assert led.free(2) == 4 and led.reusable(2) == 10
    led.end("a", [2])  # aborted: pages may be quarantined
    assert led.free(2) == 4 and led.reusable(2) == 4
    assert led.release(2, "a") and led.free(2) == 10 and led.reusable(2) == 10
    assert not led.release(2, "a")  # a duplicate RELEASED changes nothing


# ---------------------------------------------------------------- faults
def test_fault_plan_parses_and_refuses():
    plan = FaultPlan.parse(
        [
            "drop:ABORT_ACK",
            "dup:NOTICE",
            "delay:PLAN:0.5",
            "corrupt-page:@x@",
            "at:mid-transfer:pause:@y@:2",
        ]
    )
    assert plan.on_send("ABORT_ACK", 1, b"p") == []
    assert plan.on_send("NOTICE", 1, b"p") == [(b"p", 0.0), (b"p", 0.0)]
    assert plan.on_send("PLAN", 1, b"p") == [(b"p", 0.5)]
    assert plan.corrupt_marker == "@x@" and plan.at("mid-transfer", "..@y@..") == ("pause", 2.0)
    assert plan.at("after-write", "..@y@..") is None
    assert FaultPlan().on_send("ABORT", 1, b"p") == [(b"p", 0.0)]
    for bad in (
        ["explode:X"],
        ["delay:PLAN"],
        ["at:mid-transfer:pause:@y@:soon"],
        ["at:nowhere:pause:@y@"],
        ["at:mid-transfer:explode:@y@"],
    ):
        with pytest.raises(FaultSpecError):
            FaultPlan.parse(bad)


def test_plan_first_waits_only_for_its_marker():
    plan = FaultPlan.parse(["plan-first:.mid-pipeline~"])
    tokens = np.asarray(tokenize("a ~client.mid-pipeline~ b"), dtype=np.int64)
    other = np.asarray(tokenize("a ~client.mid-transfer~ b"), dtype=np.int64)
    assert plan.enabled and plan.plan_first("r1", tokens) and not plan.plan_first("r2", other)
    assert not FaultPlan().plan_first("r1", tokens)


def test_prefill_chunk_tokens_reaches_the_replay_model_and_llama_refuses_it():
    from kvferry.cluster.config import ServeConfig
    from kvferry.cluster.models import build_model

    assert build_model(ServeConfig(prefill_chunk_tokens=64)).prefill_chunk_tokens == 64
    assert build_model(ServeConfig()).prefill_chunk_tokens == 1 << 16  # the model's own
    with pytest.raises(ValueError, match="--prefill-chunk-tokens 64: the llama model"):
        build_model(ServeConfig(model="llama", prefill_chunk_tokens=64))


def test_reorder_swaps_consecutive_messages():
    plan = FaultPlan.parse(["reorder:ABORT"])
    assert plan.on_send("ABORT", 1, b"first") == []
    assert plan.on_send("ABORT", 1, b"second") == [(b"second", 0.0), (b"first", 0.0)]


# ---------------------------------------------------------------- rendezvous
def test_rank_card_round_trip_and_refusals():
    card = RankCard(
        rank=1,
        role="prefill",
        address=b"a",
        incarnation=3,
        segment=None,
        num_pages=4,
        page_size=16,
        capacity_tokens=64,
        context_length=64,
        host="h",
        pid=1,
    )
    assert RankCard.unpack(card.pack()) == card
    with pytest.raises(RendezvousError):
        RankCard.unpack(b"\xc1")
    with pytest.raises(RendezvousError):
        RankCard.unpack(msgpack.packb({"v": 99}))


# ---------------------------------------------------------------- workload
@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=16, max_value=600), st.integers(min_value=0, max_value=580))
def test_every_page_of_a_prompt_holds_a_whole_marker(length, start):
    marker = "@1a2b3@"
    prompt = make_prompt(marker, length)
    assert len(prompt) == length and MARKER_RE.fullmatch(marker)
    window = prompt[min(start, length - 16) :][:16]
    assert marker in window


def test_expected_replay_cycles_through_the_prompt():
    assert expected_replay("abc", 7) == "abcabca"


# ---------------------------------------------------------------- sends that fail later
class _Sent:
    """A posted send whose outcome comes later, as over tcp."""

    def __init__(self) -> None:
        self.status, self.error = BatchStatus.PENDING, None

    def peek(self) -> BatchStatus:
        return self.status

    def fail(self, why: str) -> None:
        self.status, self.error = BatchStatus.FAILED, PeerFailedError("rank1", why)


class _Engine:
    """What RankRuntime calls on its transfer engine when it sends."""

    incarnation = 7

    def __init__(self) -> None:
        self.sent: list[_Sent] = []
        self.arriving: list[bytes] = []  # delivered by the next progress
        self.handler = None
        self.drains: list[int] = []  # each progress call's drain_us

    def set_message_handler(self, fn) -> None:
        self.handler = fn

    def connect(self, address: bytes, name: str = "") -> object:
        return object()

    def peer_alive(self, peer) -> bool:
        return True

    def send(self, peer, payload: bytes) -> _Sent:
        self.sent.append(_Sent())
        return self.sent[-1]

    def progress(self, timeout_s: float = 0, stay_awake: bool = False, drain_us: int = 0) -> int:
        self.drains.append(drain_us)
        arriving, self.arriving = self.arriving, []
        for payload in arriving:
            self.handler(b"rank1", payload)
        return len(arriving)


def _runtime(engine: _Engine) -> RankRuntime:
    cards = {
        r: RankCard(
            rank=r,
            role="decode",
            address=b"a%d" % r,
            incarnation=7,
            segment=None,
            num_pages=0,
            page_size=16,
            capacity_tokens=0,
            context_length=0,
            host="h",
            pid=1,
        )
        for r in (0, 1)
    }
    return RankRuntime(0, engine, cards)


def test_a_pump_drains_the_wire_only_when_back_from_a_step_of_compute(monkeypatch):
    """A rank with deferred work that was away from the wire for a step of compute
    (``DRAIN_AFTER_S`` or more) drains what keeps arriving; one that polls often, or has
    nothing deferred, makes one pass (draining there delays its own work)."""
    from kvferry.cluster import runtime as runtime_module

    now = [100.0]
    monkeypatch.setattr(runtime_module.time, "monotonic", lambda: now[0])
    engine = _Engine()
    rt = _runtime(engine)
    rt.pump(0)  # nothing deferred
    rt.defer(lambda: None)
    now[0] += runtime_module.DRAIN_AFTER_S / 10
    rt.pump(0)  # deferred, but polled a moment ago
    rt.defer(lambda: None)
    now[0] += runtime_module.DRAIN_AFTER_S * 6  # a 30 ms prefill step
    rt.pump(0)
    assert engine.drains == [0, 0, runtime_module.BUSY_DRAIN_US]


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "broken-unwatched"])
def test_a_send_that_fails_after_posting_is_reported(watched, monkeypatch):
    """I6: a control message posted fine and failed later (a tcp connection reset under a
    long partition) reaches on_send_failure; one that completes does not. Broken mode: the
    outcome of a posted send is never looked at, and the failure goes unseen."""
    if not watched:
        monkeypatch.setattr(RankRuntime, "_check_sent", lambda self, rank, kind, batch: None)
    engine = _Engine()
    rt = _runtime(engine)
    reported: list[tuple[int, str]] = []
    rt.on_send_failure = lambda rank, exc: reported.append((rank, str(exc)))
    rt.send(1, m.SHUTDOWN)
    rt.send(1, m.SHUTDOWN)
    rt.pump(0)
    assert reported == [] and rt.counters.send_failures == 0
    engine.sent[0].status = BatchStatus.COMPLETED
    engine.sent[1].fail("connection reset by peer")
    rt.pump(0)
    if not watched:
        assert reported == [] and rt.counters.send_failures == 0  # the test sees the miss
        return
    assert len(reported) == 1 and reported[0][0] == 1 and "connection reset" in reported[0][1]
    assert rt.counters.send_failures == 1
    rt.pump(0)
    assert len(reported) == 1, "reported once"


def test_deferred_work_runs_after_the_messages_that_arrived_meanwhile():
    """What a handler defers (a writer's checksums and writes after its prefill) runs only
    after the next progress has delivered what arrived during the handler (an ABORT)."""
    engine = _Engine()
    rt = _runtime(engine)
    order: list[str] = []

    def on_message(msg) -> None:
        order.append(msg.kind)
        if msg.kind == "PREFILL":  # a long step; an ABORT arrives during it
            rt.defer(lambda: order.append("sequel"))
            engine.arriving.append(
                rt.seal_to_self(
                    m.encode(
                        m.ABORT.make(
                            src=1,
                            inc=7,
                            seq=2,
                            rid="r",
                            owner=2,
                            writers=[1],
                            source="client",
                            reason="gone",
                        )
                    )
                )
            )

    rt.set_handlers({k: on_message for k in Kind}, role="test")
    engine.arriving.append(
        rt.seal_to_self(
            m.encode(
                m.PREFILL.make(
                    src=1,
                    inc=7,
                    seq=1,
                    rid="r",
                    tokens=b"\0" * 64,
                    offset=0,
                    total=16,
                    owner=2,
                    owner_inc=7,
                )
            )
        )
    )
    rt.pump(0)
    assert order == ["PREFILL"]
    rt.pump(0)
    assert order == ["PREFILL", "ABORT", "sequel"]
