"""The answer's first token comes from the writers' prefill, in their notices: the owner
sends it to the router once the pages are verified, before any decode step, and fails
a request whose writers disagree on it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_protocol_units import _assign_and_notice_fields, _owner, _routed

from kvferry.cluster import decode_path
from kvferry.cluster import messages as m
from kvferry.cluster.decode import OwnerState
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol.table import Move, replace


def _tokens_sent(rt) -> list[tuple[int, list[int]]]:
    return [(f["offset"], list(f["tokens"])) for _, k, f in rt.sent if k == "TOKENS"]


def test_the_first_token_leaves_on_verify_before_any_step():
    """Verified pages: TOKENS(offset 0) with the prefill's token goes out at once; the
    first step then runs at position ``prompt_len`` with that token as its input, and
    DONE says when the last notice arrived (the router times the handover from it)."""
    owner, rt = _owner(integrity=True)
    notice = _assign_and_notice_fields(owner, rt, "f1", checksums=True)
    rt.sent.clear()
    rt.deliver(m.NOTICE, src=1, first_token=5, **notice)
    rt.pump()  # the checks run from the loop, in slices
    req = owner.reqs["f1"]
    assert req.state is OwnerState.DECODING
    assert _tokens_sent(rt) == [(0, [5])] and req.generated == [5]
    plan = owner.path.plan_step([req])
    assert plan is not None
    assert plan.positions.tolist() == [40] and plan.inputs.tolist() == [5]
    for _ in range(7):  # max_tokens 8: seven steps after the prefill's token
        owner.step()
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "finished" and done["count"] == 8
    assert done["landed_ns"] == int(req.noticed_at * 1e9) and req.noticed_at > 0
    assert owner.allocator.counts()["free"] == 64


def _notice_from(rt, owner, rid: str, writer: int, first_token: int, share: int = 1) -> None:
    """Writer ``writer``'s whole NOTICE of the 3 pages its plan gives it (checks off; its
    bytes ``1 / share`` of the pages'), carrying ``first_token``."""
    plan = next(f for _, k, f in rt.sent if k == "PLAN" and f["rid"] == rid)
    rt.deliver(
        m.NOTICE,
        src=writer,
        rid=rid,
        tokens=40,
        offset=0,
        total=3,
        pages=plan["pages"][:3],
        generations=plan["generations"][:3],
        checksums=[],
        bytes=3 * owner.pool.kv[0].numel() * owner.pool.kv.element_size() // share,
        first_token=first_token,
    )


def test_a_one_token_answer_finishes_on_verify():
    owner, rt = _owner(integrity=False)
    rt.deliver(m.ASSIGN, src=0, rid="f2", prompt_len=40, max_tokens=1, writers=[1], last_token=7)
    _notice_from(rt, owner, "f2", 1, first_token=9)
    rt.pump()
    assert _tokens_sent(rt) == [(0, [9])]
    assert [f["outcome"] for _, k, f in rt.sent if k == "DONE"] == ["finished"]
    assert "f2" not in owner.reqs and owner.allocator.counts()["free"] == 64
    assert not owner.busy()


def test_without_a_first_token_the_first_step_reads_it_from_the_pages():
    owner, rt = _owner(integrity=False)
    notice = _assign_and_notice_fields(owner, rt, "f3", checksums=False)
    rt.sent.clear()
    rt.deliver(m.NOTICE, src=1, **notice)
    rt.pump()
    req = owner.reqs["f3"]
    assert req.state is OwnerState.DECODING and _tokens_sent(rt) == []
    plan = owner.path.plan_step([req])
    assert plan is not None
    assert plan.positions.tolist() == [39] and plan.inputs.tolist() == [7]  # the last prompt token


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-first-writer-wins"])
def test_writers_that_disagree_on_the_first_token_fail_the_request(checked, monkeypatch):
    """Two writers' prefills computed different first tokens (different prompts or
    models): the request fails as corrupt, with both ranks' tokens, and its pages are
    freed (every writer noticed). Broken mode (the first writer's token taken) answers
    with it, and the test sees it."""
    if not checked:
        monkeypatch.setattr(
            decode_path,
            "writers_first_token",
            lambda req: next(iter(req.notices.values())).first_token,
        )
    owner, rt = _owner(integrity=False)
    rt.deliver(m.ASSIGN, src=0, rid="f4", prompt_len=40, max_tokens=8, writers=[1, 3], last_token=7)
    for writer, first in ((1, 5), (3, 6)):
        _notice_from(rt, owner, "f4", writer, first_token=first, share=2)
    rt.pump()
    if not checked:
        assert _tokens_sent(rt) == [(0, [5])]  # the test catches the unchecked token
        return
    assert _tokens_sent(rt) == []
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed"
    assert "rank 1 computed 5, rank 3 computed 6" in done["error"]
    assert owner.integrity_failures == 1 and owner.allocator.counts()["free"] == 64


@pytest.mark.parametrize("owner_host", ["h", "elsewhere"])
def test_the_router_times_the_handover_on_one_host_only(owner_host):
    """DONE says when the owner's last notice arrived (its CLOCK_MONOTONIC): a router on
    the same host gives the time from then to the first token; one whose owner runs on
    another host has no clock to compare with, and gives none."""

    async def run():
        router, rt = _routed()
        router.cards[2] = dataclasses.replace(router.cards[2], host=owner_host)
        routed = await router.submit("hi", 2)
        rt.deliver(m.TOKENS, src=2, rid=routed.rid, offset=0, tokens=[104, 105])
        landed_ns = round(routed.first_token_at * 1e9) - 3_000_000  # 3 ms before
        rt.deliver(m.DONE, src=2, rid=routed.rid, outcome="finished", count=2, landed_ns=landed_ns)
        if owner_host == "h":
            assert routed.landed_to_first_token_ms == pytest.approx(3.0, abs=1e-3)
        else:
            assert routed.landed_to_first_token_ms is None

    asyncio.run(run())


@pytest.mark.parametrize("after_checks", [True, False], ids=["after-checks", "broken-early"])
def test_a_request_whose_pages_fail_the_checks_gets_no_first_token(after_checks):
    """I5: the prefill's token leaves only with VERIFIED, so pages that fail their
    checksums fail the request without a token. Broken mode (a table that gives the
    token when the last notice arrives, beside the checks) sends it for corrupt pages,
    and the test sees it."""
    owner, rt = _owner(integrity=True)
    if not after_checks:
        S, E, D = oc.OwnerState, oc.OwnerEvent, oc.OwnerDo
        early = Move(S.VERIFYING, (D.CANCEL_TIMER, D.VERIFY, D.START_DECODE))
        owner.driver.table = replace(owner.driver.table, {(S.AWAITING, E.ALL_NOTICED): early})
    notice = _assign_and_notice_fields(owner, rt, "f5", checksums=True)
    notice["checksums"][1] ^= 1  # page 1 landed other bytes than its writer checksummed
    rt.sent.clear()
    rt.deliver(m.NOTICE, src=1, first_token=5, **notice)
    rt.pump()
    if not after_checks:
        assert _tokens_sent(rt) == [(0, [5])]  # the test catches the early token
        return
    assert _tokens_sent(rt) == []
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed" and "checksum mismatch" in done["error"]
    assert owner.allocator.counts()["free"] == 64
