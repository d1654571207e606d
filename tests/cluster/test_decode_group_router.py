"""The router with a decode group of two (``--decode-tp 2``), against a recording runtime:
one request becomes a member request per owner (``rid``, ``rid.1``), each with its own
pages and writers; the client gets token ``i`` once both members produced it, the same;
a member that fails or disagrees ends the other (ABORT to its owner and writers); a
writer into both members holds the prompt once, under the first member's id, so a prompt
over half a prefill pool is placed. Broken mode: a group whose failing member leaves its
sibling running is caught."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from test_protocol_units import STATS, RecordingRuntime, _card

from kvferry.cluster import messages as m
from kvferry.cluster import router as router_module
from kvferry.cluster.metrics import ClusterMetrics
from kvferry.cluster.router import Router
from kvferry.cluster.topology import Topology
from kvferry.engine.protocol.routing import RouterCore
from kvferry.engine.protocol.words import AbortSource, Answer

WRITER, OWNER_0, OWNER_1 = 1, 2, 3
TEXT = "a decode group answers once"


def _router() -> tuple[Router, RecordingRuntime]:
    cards = {0: _card(0, "router"), 1: _card(1, "prefill")}
    cards |= {r: _card(r, "decode") for r in (OWNER_0, OWNER_1)}
    rt = RecordingRuntime(rank=0, cards=cards)
    router = Router(
        rt,
        Topology(4, 1, 2, decode_tp=2),
        cards,
        context_length=1024,
        request_timeout_s=30,
        admission_wait_s=1,
        metrics=ClusterMetrics(),
        kv_heads=2,
    )
    for r in (WRITER, OWNER_0, OWNER_1):
        rt.deliver(m.STATS, src=r, **STATS)
    return router, rt


def _tokens(rt, owner: int, rid: str, text: str, offset: int = 0) -> None:
    rt.deliver(m.TOKENS, src=owner, rid=rid, offset=offset, tokens=list(text.encode()))


def _done(rt, owner: int, rid: str, count: int, outcome: str = "finished", error=None) -> None:
    rt.deliver(
        m.DONE, src=owner, rid=rid, outcome=outcome, error=error, count=count, transfer_ms=None
    )


def _aborts(rt) -> set[tuple[int, str]]:
    return {(rank, f["rid"]) for rank, k, f in rt.sent if k == "ABORT"}


def _submitted(
    then: Callable[[Router, RecordingRuntime, Any], None] = lambda router, rt, routed: None,
) -> tuple[Router, RecordingRuntime, Any]:
    """A fresh router with TEXT submitted; ``then(router, rt, routed)`` runs inside its
    event loop (the router's timers need one)."""

    async def run():
        router, rt = _router()
        routed = await router.submit(TEXT, len(TEXT))
        then(router, rt, routed)
        return router, rt, routed

    return asyncio.run(run())


def _every_member(rid: str) -> set[tuple[int, str]]:
    """ABORT to each member's owner and writer."""
    return {(OWNER_0, rid), (WRITER, rid), (OWNER_1, f"{rid}.1"), (WRITER, f"{rid}.1")}


def test_one_request_per_member_each_with_its_pages_and_writers():
    router, rt, routed = _submitted()
    assigns = {(rank, f["rid"]): f["writers"] for rank, k, f in rt.sent if k == "ASSIGN"}
    assert assigns == {(OWNER_0, routed.rid): [WRITER], (OWNER_1, f"{routed.rid}.1"): [WRITER]}
    prefills = {
        (rank, f["rid"], f["owner"], f["share"]) for rank, k, f in rt.sent if k == "PREFILL"
    }
    assert prefills == {
        (WRITER, routed.rid, OWNER_0, routed.rid),
        (WRITER, f"{routed.rid}.1", OWNER_1, routed.rid),  # held under the first member's
    }
    held = router.ledger.held
    assert set(held[WRITER]) == {routed.rid}  # its pages once, for both members
    assert set(held[OWNER_0]) == {routed.rid} and set(held[OWNER_1]) == {f"{routed.rid}.1"}


def _shares_reserved() -> bool:
    """Every id a writer is told to hold the prompt under is one the router reserved its
    pages under (so the writer's RELEASED under it ends that reservation)."""
    router, rt, _ = _submitted()
    shares = {f["share"] for rank, k, f in rt.sent if k == "PREFILL" and rank == WRITER}
    return shares <= set(router.ledger.held[WRITER])


def test_the_writer_holds_the_prompt_where_the_router_reserved_it():
    assert _shares_reserved()


def test_broken_a_share_named_after_each_member_is_caught(monkeypatch):
    """Broken mode: each member names itself; the second member's pages would be held,
    and reported released, under an id the router never reserved."""
    monkeypatch.setattr(router_module, "share_of", lambda routed, writer: routed.rid)
    assert not _shares_reserved()


@pytest.mark.parametrize("first", [OWNER_0, OWNER_1])
def test_the_client_gets_a_token_once_both_members_have_it(first):
    def then(router, rt, routed):
        rids = {OWNER_0: routed.rid, OWNER_1: f"{routed.rid}.1"}
        second = OWNER_1 if first == OWNER_0 else OWNER_0
        _tokens(rt, first, rids[first], TEXT)
        _done(rt, first, rids[first], len(TEXT))
        assert routed.text == "" and routed.events.empty()  # one member alone: nothing
        _tokens(rt, second, rids[second], TEXT[:10])
        assert routed.text == TEXT[:10]
        _tokens(rt, second, rids[second], TEXT[10:], offset=10)
        _done(rt, second, rids[second], len(TEXT))
        assert routed.outcome == Answer.OK and routed.text == TEXT
        assert _aborts(rt) == set()

    _submitted(then)


def test_members_that_disagree_fail_the_request_and_both_are_aborted():
    def then(router, rt, routed):
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _tokens(rt, OWNER_1, f"{routed.rid}.1", TEXT[:5] + "X" + TEXT[6:])

    _, rt, routed = _submitted(then)
    assert routed.outcome == Answer.FAILED
    assert "members disagree at token 5" in routed.error
    assert routed.text == ""  # nothing of a stretch the members disagree in
    assert _aborts(rt) == _every_member(routed.rid)


def _lead_finishes_then_the_other_disagrees():
    def then(router, rt, routed):
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _done(rt, OWNER_0, routed.rid, len(TEXT))
        _tokens(rt, OWNER_1, f"{routed.rid}.1", TEXT[:5] + "X" + TEXT[6:])
        _done(rt, OWNER_1, f"{routed.rid}.1", len(TEXT))

    return _submitted(then)


def test_a_disagreement_after_the_lead_finished_fails_the_request_as_one():
    _, rt, routed = _lead_finishes_then_the_other_disagrees()
    assert routed.outcome == Answer.FAILED
    assert "members disagree at token 5" in routed.error
    assert (OWNER_1, f"{routed.rid}.1") in _aborts(rt)


def test_broken_a_disagreement_left_to_the_lead_alone_is_caught(monkeypatch):
    """Broken mode: only a live lead is aborted on a disagreement (a lead that finished
    ok leaves it unsaid); the request then fails for the wrong reason."""

    def lead_only(self, group, reason):
        if self.live(group.lead.rid) is not None:
            self.abort(group.lead.rid, AbortSource.INTEGRITY, reason)

    monkeypatch.setattr(RouterCore, "_group_fails", lead_only)
    _, _, routed = _lead_finishes_then_the_other_disagrees()
    assert "members disagree" not in (routed.error or "")


def _one_member_fails() -> tuple[Router, RecordingRuntime, Any]:
    return _submitted(
        lambda router, rt, routed: _done(
            rt, OWNER_1, f"{routed.rid}.1", 0, outcome="failed", error="integrity: torn"
        )
    )


def test_a_failing_member_ends_the_other():
    router, rt, routed = _one_member_fails()
    assert routed.outcome == Answer.FAILED and "integrity: torn" in routed.error
    assert (OWNER_0, routed.rid) in _aborts(rt) and (WRITER, routed.rid) in _aborts(rt)
    assert not any(r.req.live for r in router.requests.values())


def test_broken_a_failing_member_that_leaves_its_sibling_running_is_caught(monkeypatch):
    def answer_only(self, routed, outcome, error):
        group = routed.group
        if outcome is not Answer.OK and not group.answered:
            self._answer_group(group, outcome, error, routed.abort_source)

    monkeypatch.setattr(RouterCore, "_member_ended", answer_only)
    router, rt, routed = _one_member_fails()
    assert routed.outcome == Answer.FAILED  # the client is answered ...
    assert (OWNER_0, routed.rid) not in _aborts(rt)  # ... but the lead's owner never told
    assert any(r.req.live for r in router.requests.values())


def test_the_clients_abort_reaches_every_member():
    _, rt, routed = _submitted(
        lambda router, rt, routed: router.abort(routed.rid, "client", "went away")
    )
    assert _aborts(rt) == _every_member(routed.rid)
    assert routed.outcome == Answer.ABORTED


def test_a_lead_that_finished_ok_answers_what_its_group_came_to():
    def then(router, rt, routed):
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _done(rt, OWNER_0, routed.rid, len(TEXT))
        _done(rt, OWNER_1, f"{routed.rid}.1", 0, outcome="failed", error="transfer: timeout")

    _, _, routed = _submitted(then)
    events = [routed.events.get_nowait() for _ in range(routed.events.qsize())]
    assert events[-1][:2] == ("done", Answer.FAILED)
    assert routed.outcome == Answer.FAILED and "transfer: timeout" in routed.error
    assert routed.text == ""  # nothing reached the client: the other member had none


def test_members_that_answer_different_counts_fail():
    def then(router, rt, routed):
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _done(rt, OWNER_0, routed.rid, len(TEXT))
        _tokens(rt, OWNER_1, f"{routed.rid}.1", TEXT[:8])
        _done(rt, OWNER_1, f"{routed.rid}.1", 8)

    _, _, routed = _submitted(then)
    assert routed.outcome == Answer.FAILED and "[8, 27]" in routed.error


def test_a_prompt_over_half_a_prefill_pool_is_placed_and_held_once():
    """33 pages of 16 tokens into pools of 64 pages: the prefill rank computes and holds the
    prompt once for both members, so it fits; the router reserves it once."""

    async def run():
        router, _ = _router()
        return router, await router.submit("x" * (33 * 16), 8)

    router, routed = asyncio.run(run())
    assert routed.req.live
    assert router.ledger.held[WRITER] == {routed.rid: 33}


def _lead_only(self, routed, source, reason) -> None:
    """BROKEN: the client's request aborted by its lead member's id alone."""
    self.abort(routed.rid, source, reason)


@pytest.mark.parametrize("broken", [False, True], ids=["whole-group", "broken-lead-only"])
def test_a_group_keeps_its_deadline_after_its_lead_finished(monkeypatch, broken):
    """The lead finishes ok, the other member's DONE never comes: the request's deadline
    still answers the client (and aborts that member). Broken mode: the deadline aborts
    the lead's id alone, which has ended; the client waits with no deadline."""
    if broken:
        monkeypatch.setattr(RouterCore, "abort_request", _lead_only)

    async def run():
        router, rt = _router()
        router.request_timeout_s = 0.05
        routed = await router.submit(TEXT, len(TEXT))
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _tokens(rt, OWNER_1, f"{routed.rid}.1", TEXT[:5])  # member 1 lags
        _done(rt, OWNER_0, routed.rid, len(TEXT))  # the lead finishes ok
        await asyncio.sleep(0.3)  # six deadlines
        return router, rt, routed

    router, rt, routed = asyncio.run(run())
    member = router.requests[f"{routed.rid}.1"]
    if broken:
        assert member.req.live and routed.group.answered is False  # the test catches it
        return
    assert routed.group.answered and routed.outcome is not Answer.OK
    assert "deadline" in routed.error and not member.req.live
    assert (OWNER_1, member.rid) in _aborts(rt)


@pytest.mark.parametrize("broken", [False, True], ids=["whole-group", "broken-lead-only"])
def test_a_client_gone_after_the_lead_finished_aborts_the_other_members(monkeypatch, broken):
    if broken:
        monkeypatch.setattr(RouterCore, "abort_request", _lead_only)

    def then(router, rt, routed):
        _tokens(rt, OWNER_0, routed.rid, TEXT)
        _done(rt, OWNER_0, routed.rid, len(TEXT))
        rt.sent.clear()
        router.abort_request(routed, AbortSource.CLIENT, "client disconnected")

    router, rt, routed = _submitted(then)
    member = router.requests[f"{routed.rid}.1"]
    assert member.req.live is broken
    assert ((OWNER_1, member.rid) in _aborts(rt)) is not broken
