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
