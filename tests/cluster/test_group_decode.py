"""The llama model decoded by a decode group whose members each hold a share of the KV
heads (``cluster.group_decode``), against recording runtimes, no processes: the lead
steps, each member attends over its own pages for every layer, the router's combine sees
every member report the lead's tokens.

- every prefill TP x decode TP pair of {1, 2, 4}, heads that split evenly, unevenly and
  shared (more members than heads), page sizes and layouts that differ: every member's
  answer is the monolithic engine's, bit for bit;
- an abort at the lead while its step waits for its members keeps the request's pages
  until the step ended (the step writes their K/V at every layer); broken mode: a lead
  that lets its requests go between layers frees them under its own writes;
- a member that does not answer a layer fails the step's requests at the lead when its
  deadline passes, with the ranks and the layer; a member whose request was aborted names
  it, and the lead fails that request alone;
- an ATTEND from a rank that is not the request's lead writes nothing into the member's
  pages (broken mode: a member that takes it writes there);
- broken mode: members' shares combined out of head order give another answer, which the
  comparison with the monolithic engine catches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decode_groups import PAIRS, Group, _group, _monolithic, _serve_together

from kvferry.cluster import group_decode
from kvferry.cluster import messages as m
from kvferry.cluster.decode import OwnerState
from kvferry.engine.reshard import Order

GROUP_KINDS = {"MEMBER_READY", "ATTEND", "ATTENDED", "STEPPED"}


def _exchange(g: Group, seen: dict[int, int], hold: set[str] = frozenset()) -> int:
    """The group messages the owners sent each other since the last call, delivered
    (those of a kind in ``hold`` are dropped); how many."""
    delivered = 0
    for src, (_, ort) in g.owners.items():
        new, seen[src] = ort.sent[seen.get(src, 0) :], len(ort.sent)
        for to, kind, fields in new:
            if kind in GROUP_KINDS and kind not in hold:
                g.owners[to][1].deliver(getattr(m, kind), src=src, **fields)
                delivered += 1
    return delivered


def _work(g: Group) -> int:
    """Each owner's next step or share, run as the rank's stepper runs it; how many ran."""
    ran = 0
    for owner, _ in g.owners.values():
        if not owner.busy():
            continue
        work = owner.begin_step()
        if work is None:
            continue
        out, error = None, None
        try:
            out = owner.run_step(work)
        except Exception as exc:  # the stepper hands it to end_step
            error = exc
        owner.end_step(work, out, error)
        ran += 1
    return ran


def _decode(g: Group, seen: dict[int, int] | None = None, hold=frozenset(), rounds=2000) -> None:
    seen = {} if seen is None else seen
    for _ in range(rounds):
        if not (_exchange(g, seen, hold) + _work(g)):
            return
    raise AssertionError(f"the group still steps after {rounds} rounds")


def _tokens(g: Group, rids: dict[int, str]) -> list[list[int]]:
    return [
        [t for _, k, f in ort.sent if k == "TOKENS" and f["rid"] == rids[r] for t in f["tokens"]]
        for r, (_, ort) in g.owners.items()
    ]


def _done(g: Group, rank: int, rid: str) -> dict:
    return next(f for _, k, f in g.owners[rank][1].sent if k == "DONE" and f["rid"] == rid)


@pytest.mark.parametrize("tp, decode_tp", PAIRS)
@pytest.mark.parametrize("kv_heads", [4, 3, 2])
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (32, 16), (16, 64)])
def test_a_split_llama_group_answers_as_the_monolithic_engine(
    tp, decode_tp, kv_heads, src_page, dst_page
):
    g = _group(tp, decode_tp, kv_heads, src_page, dst_page, llama=True)
    rids = _serve_together(g)
    _decode(g)
    want = _monolithic(kv_heads)
    assert _tokens(g, rids) == [want] * decode_tp
    for rank, rid in rids.items():
        assert _done(g, rank, rid)["outcome"] == "finished"
        owner = g.owners[rank][0]
        assert owner.allocator.free_pages == owner.pool.num_pages  # every page back


H, N = Order.HND, Order.NHD


@pytest.mark.parametrize("tp, decode_tp", [(1, 2), (2, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("orders", [(H, N), (N, H), (N, N)], ids=["HND-NHD", "NHD-HND", "NHD-NHD"])
def test_a_split_llama_group_answers_as_the_monolithic_engine_across_layouts(tp, decode_tp, orders):
    g = _group(tp, decode_tp, 4, 32, 16, llama=True, orders=orders)
    rids = _serve_together(g)
    _decode(g)
    assert _tokens(g, rids) == [_monolithic(4)] * decode_tp


@pytest.mark.parametrize("decode_tp", [2, 4])
def test_broken_shares_combined_out_of_head_order_are_caught(monkeypatch, decode_tp):
    combine = group_decode.combine

    def swapped(shares, kv_heads):  # each member's heads given the next member's answer
        answers = [got for _, got in shares]
        return combine(
            [(held, got) for (held, _), got in zip(shares, answers[::-1], strict=True)], kv_heads
        )

    monkeypatch.setattr(group_decode, "combine", swapped)
    g = _group(2, decode_tp, 4, 16, 16, llama=True)
    rids = _serve_together(g)
    _decode(g)
    answers = _tokens(g, rids)
    assert answers[0] != _monolithic(4)  # what the test above compares


def _waiting_step(g: Group) -> tuple[dict[int, str], dict[int, int]]:
    """Served and verified; the lead's first step runs its first layer and asks its
    members, whose answers are not delivered yet."""
    rids = _serve_together(g)
    seen: dict[int, int] = {}
    _exchange(g, seen)  # MEMBER_READY
    lead = g.owners[g.topology.decode_groups[0][0]][0]
    work = lead.begin_step()
    assert isinstance(work, group_decode.GroupStep)
    lead.end_step(work, lead.run_step(work), None)
    assert lead.group_decode.waiting() and work.waiting
    return rids, seen


def _client_abort(g: Group, rank: int, rid: str) -> None:
    """The router's ABORT of ``rid`` (the client went away) reaches its owner ``rank``."""
    owner, rt = g.owners[rank]
    writers = owner.reqs[rid].writers
    rt.deliver(m.ABORT, src=0, rid=rid, owner=rank, writers=writers, source="client", reason="gone")


def _let_go_between_layers(monkeypatch) -> None:
    ask = group_decode.GroupDecode._ask

    def ask_and_unpin(self, gs):
        ask(self, gs)
        for r in gs.batch:
            self.owner.driver.unpin(r)

    monkeypatch.setattr(group_decode.GroupDecode, "_ask", ask_and_unpin)


@pytest.mark.parametrize("broken", [False, True], ids=["pinned", "broken-unpinned"])
def test_an_abort_while_the_leads_step_waits_keeps_its_pages_until_the_step_ends(
    monkeypatch, broken
):
    if broken:
        _let_go_between_layers(monkeypatch)
    g = _group(1, 2, 4, 16, 16, llama=True)
    _, seen = _waiting_step(g)
    lead_rank = g.topology.decode_groups[0][0]
    lead, lrt = g.owners[lead_rank]
    _client_abort(g, lead_rank, "r")
    held_while_waiting = lead.allocator.pages_of("r") if not broken else None
    freed_while_waiting = lead.allocator.free_pages == lead.pool.num_pages
    if broken:
        assert freed_while_waiting  # the broken mode frees them under the step's writes
        return
    assert not freed_while_waiting and held_while_waiting
    _decode(g, seen)  # the members answer; the step ends; the abort is carried out
    assert lead.allocator.free_pages == lead.pool.num_pages
    assert [f["how"] for _, k, f in lrt.sent if k == "RELEASED" and f["rid"] == "r"] == ["freed"]
    tokens = [f for _, k, f in lrt.sent if k == "TOKENS"]
    assert sum(len(f["tokens"]) for f in tokens) == 1  # the prefill's; the step's none


def test_a_member_that_does_not_answer_fails_the_step_at_its_deadline():
    g = _group(1, 2, 4, 16, 16, llama=True)
    _waiting_step(g)
    lead_rank, member_rank = g.topology.decode_groups[0]
    lead, lrt = g.owners[lead_rank]
    (timer,) = [t for t in lrt.timers if getattr(t.fn, "func", None) == lead.group_decode._expired]
    timer.fn()  # the member never answered
    done = _done(g, lead_rank, "r")
    assert done["outcome"] == "failed"
    assert f"member ranks [{member_rank}] sent no attention for layer 0 within" in done["error"]
    assert not lead.group_decode.waiting()
    assert lead.allocator.free_pages == lead.pool.num_pages


def _ready_pair() -> tuple[Group, dict[int, int]]:
    """A lead and one member (2 KV heads each of 4), served and verified, each member's
    MEMBER_READY delivered."""
    g = _group(1, 2, 4, 16, 16, llama=True)
    _serve_together(g)
    seen: dict[int, int] = {}
    _exchange(g, seen)
    return g, seen


def test_a_member_that_cannot_attend_a_request_fails_it_at_the_lead():
    g, seen = _ready_pair()
    lead_rank, member_rank = g.topology.decode_groups[0]
    member, _ = g.owners[member_rank]
    _client_abort(g, member_rank, "r.1")
    assert "r.1" not in member.reqs or member.reqs["r.1"].state is not OwnerState.DECODING
    _decode(g, seen)
    done = _done(g, lead_rank, "r")
    assert done["outcome"] == "failed"
    assert f"member rank {member_rank} could not attend r.1" in done["error"]
    assert "not decoding" in done["error"]


@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-any-sender"])
def test_an_attend_from_a_rank_that_is_not_the_lead_writes_nothing(monkeypatch, broken):
    if broken:
        monkeypatch.setattr(
            group_decode.GroupDecode,
            "_cannot_attend",
            lambda self, rid, lead, position, layer: None,
        )
    g, _ = _ready_pair()
    lead_rank, member_rank = g.topology.decode_groups[0]
    member, mrt = g.owners[member_rank]
    req = member.reqs["r.1"]
    before = member.pool.kv.clone()
    shape = (1, 4, 32)  # the member's 2 KV heads of 4, 2 query heads each
    stranger = 99
    forged = torch.full(shape, 7.0)
    mrt.deliver(
        m.ATTEND, src=stranger, step=1, layer=0, rids=["r.1"],
        positions=[req.prompt_len - 1 + len(req.generated)],
        q=forged.numpy().tobytes(), k=forged[:, :2].contiguous().numpy().tobytes(),
        v=forged[:, :2].contiguous().numpy().tobytes(),
    )  # fmt: skip
    while member.busy():
        work = member.begin_step()
        if work is None:
            break
        member.end_step(work, member.run_step(work), None)
    (reply,) = [f for to, k, f in mrt.sent if k == "ATTENDED" and to == stranger]
    if broken:
        assert not torch.equal(member.pool.kv, before)  # the stranger's K/V landed
        return
    assert reply["failed"] == ["r.1"] and f"its lead is rank {lead_rank}" in reply["error"]
    assert torch.equal(member.pool.kv, before)


def test_a_lead_steps_only_once_each_member_itself_said_it_is_ready():
    """A MEMBER_READY that arrives before the lead's ASSIGN counts only if it came from
    that member's rank; until the member's own arrives, the lead does not step."""
    g = _group(1, 2, 4, 16, 16, llama=True)
    lead_rank, member_rank = g.topology.decode_groups[0]
    lead, lrt = g.owners[lead_rank]
    lrt.deliver(m.MEMBER_READY, src=member_rank + 7, rid="r", member=1)  # not the member
    _serve_together(g)
    _exchange(g, {}, hold={"MEMBER_READY"})
    assert lead.reqs["r"].state is OwnerState.DECODING and not lead.busy()
    lrt.deliver(m.MEMBER_READY, src=member_rank, rid="r", member=1)
    assert lead.busy() and isinstance(lead.begin_step(), group_decode.GroupStep)


@pytest.mark.parametrize("broken", [False, True], ids=["waits", "broken-closes-at-once"])
def test_a_deadline_that_passes_while_the_lead_computes_ends_the_step_after_it(monkeypatch, broken):
    """The lead computes its own share while its members compute theirs (on the step
    thread, at a long context): a member's deadline passing meanwhile fails the step
    once that part returned, not under it (it writes the new token's K/V into the
    requests' pages). Broken mode: a step closed at once frees the pages under it."""
    if broken:

        def fail_at_once(self, gs, error):
            self._close(gs)
            self.owner.fail_step(gs.batch, error)

        monkeypatch.setattr(group_decode.GroupDecode, "_fail", fail_at_once)
    g = _group(1, 2, 4, 16, 16, llama=True)
    _waiting_step(g)
    lead, lrt = g.owners[g.topology.decode_groups[0][0]]
    part = lead.begin_step()  # its own share of layer 0, handed to the step thread
    assert isinstance(part, group_decode.GroupStep) and part.own is None
    (timer,) = [t for t in lrt.timers if getattr(t.fn, "func", None) == lead.group_decode._expired]
    timer.fn()  # the member's deadline passes while the part computes
    freed = lead.allocator.free_pages == lead.pool.num_pages
    if broken:
        assert freed
        return
    assert not freed and not [f for _, k, f in lrt.sent if k == "DONE"]
    lead.end_step(part, lead.run_step(part), None)  # the part returns
    done = _done(g, lead.rt.rank, "r")
    assert done["outcome"] == "failed" and "sent no attention for layer 0" in done["error"]
    assert lead.allocator.free_pages == lead.pool.num_pages


@pytest.mark.parametrize("broken", [False, True], ids=["in-order", "broken-any-layer"])
def test_a_member_attends_a_steps_layers_only_in_order(monkeypatch, broken):
    """The pages are checked at a step's first layer only, so a member takes a layer
    only after the one before it at that position: an ATTEND for layer 1 first is
    refused and writes nothing. Broken mode: a member that takes any layer writes it."""
    if broken:
        cannot = group_decode.GroupDecode._cannot_attend
        monkeypatch.setattr(
            group_decode.GroupDecode,
            "_cannot_attend",
            lambda self, rid, lead, position, layer: cannot(self, rid, lead, position, 0),
        )
    g, _ = _ready_pair()
    lead_rank, member_rank = g.topology.decode_groups[0]
    member, mrt = g.owners[member_rank]
    req = member.reqs["r.1"]
    before = member.pool.kv.clone()
    share = torch.full((1, 4, 32), 3.0)
    mrt.deliver(
        m.ATTEND, src=lead_rank, step=1, layer=1, rids=["r.1"],
        positions=[req.prompt_len - 1 + len(req.generated)], q=share.numpy().tobytes(),
        k=share[:, :2].contiguous().numpy().tobytes(),
        v=share[:, :2].contiguous().numpy().tobytes(),
    )  # fmt: skip
    work = member.begin_step()
    if work is not None:
        member.end_step(work, member.run_step(work), None)
    (reply,) = [f for to, k, f in mrt.sent if k == "ATTENDED"]
    if broken:
        assert not torch.equal(member.pool.kv, before)
        return
    assert reply["failed"] == ["r.1"] and "expects layer 0" in reply["error"]
    assert torch.equal(member.pool.kv, before)


@pytest.mark.parametrize("broken", [False, True], ids=["checked-again", "broken-checked-once"])
def test_a_share_queued_before_an_abort_writes_nothing_into_the_freed_pages(monkeypatch, broken):
    """A member accepts an ATTEND for layer 1 and queues it; before its share runs, the
    router's ABORT ends the request there (between layers a member's request is not
    pinned, so its pages are freed at once) and another request takes the pages. The
    share is refused when its job is taken: nothing is written, the lead is told.
    Broken mode: a share checked only when its ATTEND came writes the new token's K/V
    into pages that are now the other request's."""
    if broken:
        monkeypatch.setattr(
            group_decode.GroupDecode, "_still_attends", lambda self, job, row, req: True
        )
    g, seen = _ready_pair()
    lead_rank, member_rank = g.topology.decode_groups[0]
    lead, _ = g.owners[lead_rank]
    member, mrt = g.owners[member_rank]
    step = lead.begin_step()  # the model to layer 0's query, asked of the member
    lead.end_step(step, lead.run_step(step), None)
    _exchange(g, seen)
    _work(g)  # the member's layer 0 and the lead's own share
    _exchange(g, seen)
    step = lead.begin_step()
    assert isinstance(step, group_decode.GroupStep)
    lead.end_step(step, lead.run_step(step), None)  # joined; layer 1's query asked
    assert step.query is not None and step.query.layer == 1
    _exchange(g, seen)
    assert len(member.group_decode.jobs) == 1  # layer 1's share queued at the member
    _client_abort(g, member_rank, "r.1")
    assert "r.1" not in member.reqs
    assert member.allocator.free_pages == member.pool.num_pages
    taken = {grant.page for grant in member.allocator.allocate("next", member.pool.num_pages)}
    member.pool.kv[sorted(taken)] = 0.25  # the next request's KV (whatever r.1 left there)
    before = member.pool.kv.clone()
    while member.busy():
        work = member.begin_step()
        if work is None:
            break
        member.end_step(work, member.run_step(work), None)
    written = {int(p) for p in (member.pool.kv != before).nonzero()[:, 0].tolist()}
    if broken:
        assert written & taken  # the aborted request's K/V landed in the next one's pages
        return
    assert not written
    (reply,) = [f for to, k, f in mrt.sent if k == "ATTENDED" and f["layer"] == 1]
    assert reply["failed"] == ["r.1"]
    assert "r.1 ended on rank" in reply["error"] and "layer 1 of step" in reply["error"]


@pytest.mark.parametrize("broken", [False, True], ids=["named", "broken-step-and-layer-only"])
def test_an_answer_naming_other_requests_is_not_taken_for_the_steps(monkeypatch, broken):
    """Step numbers start again with each lead process, so an ATTENDED of the same step,
    layer and member may answer an earlier lead's step (a share that ran late). The
    answer names the requests of its ATTEND; one naming others is ignored, the member's
    own answer is taken and the group answers as the monolithic engine. Broken mode:
    matched by step, layer and sender alone, the stray answer is taken and every
    member reports the same wrong tokens (no disagreement shows it)."""
    if broken:
        real = group_decode.GroupDecode._on_attended

        def by_number_only(self, msg):
            gs = self.step
            if gs is not None and gs.query is not None:
                p = gs.batch[0].group.ranks.index(msg.src)
                asked = [r.group.rids[p] for r in gs.batch]
                msg = dataclasses.replace(msg, fields={**msg.fields, "rids": asked})
            real(self, msg)

        monkeypatch.setattr(group_decode.GroupDecode, "_on_attended", by_number_only)
    g = _group(1, 2, 4, 16, 16, llama=True)
    rids, seen = _waiting_step(g)
    lead_rank, member_rank = g.topology.decode_groups[0]
    lead, lrt = g.owners[lead_rank]
    gs = lead.group_decode.step
    # 1 request, the member's 2 KV heads x 2 query heads: another step's attention
    stray = torch.randn((1, 4, 32), generator=torch.Generator().manual_seed(3)) * 50
    lrt.deliver(
        m.ATTENDED, src=member_rank, step=gs.number, layer=0, rids=["an-earlier-lead's.1"],
        out=stray.numpy().tobytes(), failed=[], error=None,
    )  # fmt: skip
    assert (1 in gs.replies) is broken
    _decode(g, seen)
    got = _tokens(g, rids)
    if broken:
        assert got[0] == got[1] != _monolithic(4)
        return
    assert got == [_monolithic(4)] * 2


class _HandClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


@pytest.mark.parametrize("broken", [False, True], ids=["measured", "broken-fixed-at-ask"])
def test_a_members_deadline_grows_with_the_leads_own_share_of_the_layer(monkeypatch, broken):
    """A step's first layer is asked before the lead has timed anything of it (its first
    step: the deadline is --abort-deadline alone), and a member's share may be as long
    as the lead's own (a long context; the canaries of every page at that layer). Once
    the lead's own share is timed, the deadline becomes --abort-deadline plus four times
    it from the ask; the next step asks with that time at once. Broken mode: a deadline
    fixed when asking fails a member as slow as the lead at a long context."""
    if broken:
        monkeypatch.setattr(group_decode.GroupDecode, "_measured", lambda self, gs: None)
    g = _group(1, 2, 4, 16, 16, llama=True)
    lead, lrt = g.owners[g.topology.decode_groups[0][0]]
    clock = lead.clock = _HandClock()
    held = group_decode.attend_held

    def slow_share(*args, **kwargs):
        clock.t += 30.0  # the lead's own share of a long context's layer
        return held(*args, **kwargs)

    monkeypatch.setattr(group_decode, "attend_held", slow_share)
    _waiting_step(g)
    gd = lead.group_decode
    reply_s = gd.reply_s

    def deadlines() -> list[float]:
        return [t.delay for t in lrt.timers if getattr(t.fn, "func", None) == gd._expired]

    assert deadlines() == [reply_s]  # nothing of layer 0 timed yet
    part = lead.begin_step()  # the lead's own share of layer 0: 30 s
    lead.end_step(part, lead.run_step(part), None)
    if broken:
        assert deadlines() == [reply_s]
        return
    # reply_s + 4 x 30 s from the ask, of which 30 s have passed
    assert deadlines() == [reply_s, reply_s + 4 * 30.0 - 30.0]
    assert gd.own_s_by_layer[0] == 30.0


@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-any-stepped"])
def test_a_stepped_for_a_step_the_member_never_attended_fails_the_request(monkeypatch, broken):
    """A member reports a STEPPED token as its own only after it attended every layer of
    that step. A lead out of step with it (its STEPPED before any ATTEND) fails the
    request rather than have the member echo a token it never computed, which the
    router's comparison of the members' tokens cannot see. Broken mode: the member takes
    any STEPPED of its lead, and the token is reported."""
    if broken:
        monkeypatch.setattr(group_decode.GroupDecode, "_out_of_step", lambda self, r, lead: None)
    g, _ = _ready_pair()
    lead_rank, member_rank = g.topology.decode_groups[0]
    member, mrt = g.owners[member_rank]
    req = member.reqs["r.1"]
    generated = list(req.generated)
    assert req.group.next_layer == 0  # no layer of a step attended
    mrt.deliver(m.STEPPED, src=lead_rank, rids=["r.1"], tokens=[5])
    if broken:
        assert req.generated == [*generated, 5]
        return
    assert req.generated == generated
    done = _done(g, member_rank, "r.1")
    assert done["outcome"] == "failed"
    assert "attended 0 of the step's" in done["error"]


@pytest.mark.parametrize("broken", [False, True], ids=["step-only", "broken-any-name"])
def test_an_answer_failing_only_other_requests_is_no_share_of_zeros(monkeypatch, broken):
    """An ATTENDED that names as failed only requests outside the step, with no attention
    in it, is malformed: the step fails. Broken mode: every name counts, the reply is
    taken as the member's share of the layer, all zeros."""
    if broken:
        monkeypatch.setattr(
            group_decode.GroupDecode, "_failures_named", staticmethod(lambda f, mine: set(f))
        )
    g = _group(1, 2, 4, 16, 16, llama=True)
    rids, seen = _waiting_step(g)
    lead_rank, member_rank = g.topology.decode_groups[0]
    lead, lrt = g.owners[lead_rank]
    gs = lead.group_decode.step
    asked = [r.group.rids[1] for r in gs.batch]
    lrt.deliver(
        m.ATTENDED, src=member_rank, step=gs.number, layer=0, rids=asked,
        out=b"", failed=["not-in-this-step.1"], error="?",
    )  # fmt: skip
    if broken:
        assert not gs.replies[1].any()  # the member's heads of this layer taken as zeros
        return
    assert 1 not in gs.replies
    _decode(g, seen)
    assert _done(g, lead_rank, rids[lead_rank])["outcome"] == "failed"
    assert "member rank" in _done(g, lead_rank, rids[lead_rank])["error"]
