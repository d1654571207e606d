"""Only a request's owner speaks for its answer: TOKENS or DONE that name a request from
any other rank (its writer, another decode rank) change nothing, are counted and logged
with the request id, and the client gets its owner's text. Broken mode: a router that
takes an answer from whichever rank names the request gives the client another rank's
tokens under 200, and the test catches it."""

from __future__ import annotations

import asyncio

import pytest
from test_protocol_units import STATS, RecordingRuntime, _card

from kvferry.cluster import messages as m
from kvferry.cluster import router as router_module
from kvferry.cluster.metrics import ClusterMetrics
from kvferry.cluster.router import Router
from kvferry.cluster.topology import Topology
from kvferry.engine.protocol.routing import RouterCore

WRITER, OWNER, OTHER_OWNER = 1, 2, 3
TEXT = "the owner's own answer"
FORGED = "another rank's answer!"
assert len(FORGED) == len(TEXT)


def _router() -> tuple[Router, RecordingRuntime]:
    cards = {0: _card(0, "router"), WRITER: _card(WRITER, "prefill")}
    cards |= {r: _card(r, "decode") for r in (OWNER, OTHER_OWNER)}
    rt = RecordingRuntime(rank=0, cards=cards)
    router = Router(
        rt,
        Topology(4, 1, 2),
        cards,
        context_length=1024,
        request_timeout_s=30,
        admission_wait_s=1,
        metrics=ClusterMetrics(),
    )
    for r in (WRITER, OWNER, OTHER_OWNER):
        rt.deliver(m.STATS, src=r, **STATS)
    return router, rt


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
        router, rt = _router()
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
        router, rt = _router()
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
