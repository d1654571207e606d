"""Only a request's owner speaks for its answer: TOKENS or DONE that name a request from
any other rank (its writer, another decode rank) change nothing, are counted and logged
with the request id, and the client gets its owner's text. Broken mode: a router that
takes an answer from whichever rank names the request gives the client another rank's
tokens under 200, and the test catches it."""

from __future__ import annotations

import asyncio

import pytest
from test_protocol_units import STATS, RecordingRuntime, _routed

from kvferry.cluster import messages as m
from kvferry.cluster import router as router_module
from kvferry.cluster.router import Router
from kvferry.engine.protocol.routing import RouterCore

WRITER, OWNER, OTHER_OWNER = 1, 2, 3
TEXT = "the owner's own answer"
FORGED = "another rank's answer!"
assert len(FORGED) == len(TEXT)


def _answer(rt: RecordingRuntime, src: int, rid: str, text: str) -> None:
    rt.deliver(m.TOKENS, src=src, rid=rid, offset=0, tokens=list(text.encode()))
    rt.deliver(
        m.DONE,
        src=src,
        rid=rid,
        outcome="finished",
        error=None,
        count=len(text),
        transfer_ms=None,
    )


def _break(monkeypatch) -> None:
    """BROKEN: whichever rank names a live request speaks for its answer."""
    monkeypatch.setattr(RouterCore, "answered_by", lambda self, src, rid: self.live(rid))
    monkeypatch.setattr(
        router_module.Router, "_owner_speaks", lambda self, msg: self.core.live(msg.rid)
    )


@pytest.mark.parametrize("broken", [False, True], ids=["owner-only", "broken-any-rank"])
@pytest.mark.parametrize("forger", ["writer", "other-owner"])
def test_only_the_owner_s_tokens_and_done_reach_the_client(monkeypatch, broken, forger):
    if broken:
        _break(monkeypatch)

    async def run():
        router, rt = _routed(decode=2)
        routed = await router.submit(TEXT, len(TEXT))
        owner = routed.owner
        other = {"writer": routed.writers[0], "other-owner": ({OWNER, OTHER_OWNER} - {owner}).pop()}
        _answer(rt, other[forger], routed.rid, FORGED)
        if broken:
            assert routed.outcome == "ok" and routed.text == FORGED  # what the check prevents
            return
        assert routed.outcome is None and routed.placed == 0
        assert router.core.foreign_answers == 2  # the TOKENS and the DONE
        _answer(rt, owner, routed.rid, TEXT)
        assert routed.outcome == "ok"
        assert routed.text == TEXT

    asyncio.run(run())


def test_a_failure_reported_by_another_rank_does_not_end_the_request():
    async def run():
        router, rt = _routed(decode=2)
        routed = await router.submit(TEXT, len(TEXT))
        rt.deliver(
            m.DONE,
            src=routed.writers[0],
            rid=routed.rid,
            outcome="failed",
            error="not this rank's to say",
            count=None,
            transfer_ms=None,
        )
        assert routed.req.live and routed.outcome is None
        assert router.core.foreign_answers == 1

    asyncio.run(run())


def test_a_token_outside_the_vocabulary_fails_the_request():
    """No text can be made of it: the request fails with the numbers (and its ranks are
    told), rather than the front door failing mid-answer."""

    async def run():
        router, rt = _routed(decode=2)
        routed = await router.submit(TEXT, len(TEXT))
        rt.deliver(m.TOKENS, src=routed.owner, rid=routed.rid, offset=0, tokens=[104, 300])
        return routed, rt

    routed, rt = asyncio.run(run())
    assert routed.outcome == "failed" and "token 300 at offset 1" in routed.error
    assert {(rank, f["rid"]) for rank, k, f in rt.sent if k == "ABORT"} >= {
        (routed.owner, routed.rid)
    }


@pytest.mark.parametrize("stops", [True, False], ids=["contract", "broken-admits"])
def test_nothing_is_admitted_once_shutdown_began(monkeypatch, stops):
    """A request that arrives, or still waits for room, when the router shuts down gets
    503 at once, and no rank hears of it. Broken mode: it is dispatched to ranks already
    told to stop."""
    if not stops:
        monkeypatch.setattr(Router, "_refuse_if_stopping", lambda self, rid: None)

    async def run():
        router, rt = _routed(decode=2)
        router.shutdown("the cluster is being stopped")
        try:
            await router.submit(TEXT, len(TEXT))
        except router_module.Unavailable as exc:
            return exc, rt
        return None, rt

    refused, rt = asyncio.run(run())
    dispatched = [k for _, k, _ in rt.sent if k in ("PREFILL", "ASSIGN")]
    if not stops:
        assert refused is None and dispatched  # what the refusal prevents
        return
    assert refused is not None and "stopping" in str(refused) and not dispatched


def test_request_ids_carry_64_random_bits_an_incarnation():
    """A restarted router never reissues an id its old incarnation's requests may still
    hold on a rank (TOKENS and DONE name a request by id alone)."""
    import re

    a, _ = _routed(decode=2)
    b, _ = _routed(decode=2)
    ida, idb = a.new_request_id(), b.new_request_id()
    assert re.fullmatch(r"req-[0-9a-f]{16}-000001", ida), ida
    assert ida != idb


class _Partitioned(RecordingRuntime):
    """Sends to the ranks in ``down`` are lost (the runtime reports it, as a failed send)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.down: set[int] = set()

    def send(self, rank, kind, **fields):
        if rank in self.down:
            self.on_send_failure(rank, ConnectionError("link down"))
            return None
        return super().send(rank, kind, **fields)


@pytest.mark.parametrize("again", [True, False], ids=["contract", "broken-forgets"])
def test_a_rank_back_from_unreachable_is_told_again_of_ended_requests(monkeypatch, again):
    """A writer's link drops: its PREFILL and then the request's ABORT are lost, so it
    never hears of the request and never reports its pages released. Once it reports
    again, the router sends it the ABORT again, and its answer (nothing held) returns the
    reservation. Broken mode: the reservation is held for good (a capacity leak)."""
    if not again:
        monkeypatch.setattr(Router, "_abort_again_on", lambda self, rank: None)

    def released(rt, src: int, rid: str) -> None:
        rt.deliver(
            m.RELEASED, src=src, rid=rid, pages=0, how="freed", justification="nothing-posted"
        )

    async def run():
        router, rt = _routed(decode=2, runtime=_Partitioned)
        rt.down = {WRITER}
        routed = await router.submit("x" * 500, 10)
        assert routed.outcome == "failed"  # the writer was unreachable
        released(rt, routed.owner, routed.rid)
        rt.down = set()
        rt.sent.clear()
        rt.deliver(m.STATS, src=WRITER, **STATS)  # back
        resent = [f["rid"] for rank, k, f in rt.sent if k == "ABORT" and rank == WRITER]
        if resent:  # what the writer answers for a request it never heard of
            released(rt, WRITER, routed.rid)
        return router, routed, resent

    router, routed, resent = asyncio.run(run())
    assert router.unhealthy == {}
    if not again:
        assert router.ledger.held[WRITER] == {routed.rid: 32}  # what the resend prevents
        return
    assert resent == [routed.rid]
    assert router.ledger.held[WRITER] == {} and routed.rid not in router.requests
