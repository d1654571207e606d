"""The router's rules, without I/O: the page ledger, the abort fan-out, the answer a client
gets, and when a request is forgotten.

The service's router (:class:`kvferry.cluster.router.Router`, an asyncio server) and the
simulator's (:class:`kvferry.cluster.harness.simulate.router.SimRouter`, on a simulated
clock) both host one :class:`RouterCore`: they turn what arrives (a client's request or
its disconnect, TOKENS, DONE, ABORT, RELEASED, a rank lost) into calls here, and supply
the ports through which its decisions leave (ABORT to ranks, the answer to the client,
a timer, the clock). What each host keeps for itself is what differs: HTTP, metrics and
logs in the service; vectorised placement and the world's books in the simulator.

Rules kept here:

- The ledger: pages reserved per rank per request, until that rank reports them released
  (RELEASED). A terminal request's reservations count as quarantined until then, so the
  router never places a request on pages a write may still reach (I4 seen from above).
- An abort reaches every writer, then the owner (the writers must stop, flush and ack; the
  owner waits for their acks), except the rank it came from.
- The answer (I6): ok once DONE(finished) and exactly that many tokens stand in order
  (late chunks get a grace, then the request fails rather than answer short); failed or
  aborted otherwise; a terminal request never changes its answer (I2). Only the
  request's owner speaks for its answer: TOKENS or DONE naming it from any other rank
  (a writer, another owner, a rank confused about what it holds) change nothing and are
  counted (``foreign_answers``), so no rank's tokens reach another request's client.
- A request is forgotten once it is terminal and no rank holds pages for it.
- A rank lost (severed, unreachable, exited) aborts the live requests it can still harm:
  those it owns, and those it writes that are not decoding yet.
- A request decoded by a TP group of owners is one member request per owner, each a
  protocol instance of its own (its writers, its pages, its quarantine, its acks), bound
  by a :class:`GroupAnswer`: the client gets token ``i`` once every member has produced
  it, the same; members that disagree fail the request; any member that ends without
  ok ends every other (an abort reaching one owner reaches them all, and through their
  fan-outs every writer); ok once every member finished ok with the same count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kvferry.engine.lifecycle import Request, RequestState

from .words import AbortSource, Answer, Outcome

S = RequestState
TOKENS_GRACE_S = 1.0  # how long a DONE(finished) waits for its overtaken TOKENS


class Ledger:
    """Pages reserved per rank, per request, until the rank reports them released."""

    def __init__(self, totals: dict[int, int]) -> None:
        self.totals = dict(totals)
        self.held: dict[int, dict[str, int]] = {r: {} for r in totals}
        self.orphaned: dict[int, set[str]] = {r: set() for r in totals}  # held by terminal requests
        # Pages a rank holds for requests this router never admitted: an earlier router's,
        # when this one is a restart. Taken from the rank's first STATS, then only lowered
        # as it reports them released (see inherit).
        self.inherited: dict[int, int] = {}

    def free(self, rank: int) -> int:
        return self.totals[rank] - sum(self.held[rank].values()) - self.inherited.get(rank, 0)

    def inherit(self, rank: int, used: int, other_routers: int | None = None) -> None:
        """What the rank holds for requests this router never knew. ``other_routers``,
        when the rank says it: its pages held for requests of other router incarnations,
        exactly. Else from ``used`` (pages owned or quarantined) less this router's
        reservations, only ever lowered: an estimate that a reservation not yet
        allocated there makes too low."""
        if other_routers is not None:
            self.inherited[rank] = max(0, other_routers)
            return
        unknown = max(0, used - sum(self.held[rank].values()))
        self.inherited[rank] = min(self.inherited.get(rank, unknown), unknown)

    def reusable(self, rank: int) -> int:
        """Pages that will be free once every live request ends: all but quarantined ones."""
        return (
            self.totals[rank]
            - sum(self.held[rank][rid] for rid in self.orphaned[rank])
            - self.inherited.get(rank, 0)
        )

    def reserve(self, rank: int, rid: str, pages: int) -> None:
        self.held[rank][rid] = pages

    def end(self, rid: str, ranks: list[int]) -> None:
        """The request is terminal: what it still holds counts as quarantined."""
        for r in ranks:
            if rid in self.held[r]:
                self.orphaned[r].add(rid)

    def release(self, rank: int, rid: str) -> bool:
        self.orphaned[rank].discard(rid)
        return self.held[rank].pop(rid, None) is not None

    def outstanding(self) -> dict[int, int]:
        return {r: sum(h.values()) for r, h in self.held.items()}


@dataclass
class Routed:
    """One request the router placed: its owner (the decode rank with its pages), its
    writers (the prefill group) and how its answer stands."""

    req: Request
    owner: int
    writers: list[int]
    submitted_at: float
    outcome: Answer | None = None  # OK, ABORTED or FAILED, once answered
    error: str | None = None
    abort_source: AbortSource | None = None  # who ended it, when it did not complete
    deadline: Any = None  # the host's timer for the request's deadline
    expected_count: int | None = None  # from DONE(finished)
    placed: int = 0  # tokens standing in order
    early: dict[int, list[int]] = field(default_factory=dict)  # chunks ahead of a gap
    aborted_at: float | None = None  # when this router fanned the abort out (its clock)
    group: GroupAnswer | None = None  # a member of a request decoded by a TP group
    member: int = 0  # its position in the group

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def ranks(self) -> list[int]:
        return [self.owner, *self.writers]


@dataclass
class GroupAnswer:
    """The one answer of a request decoded by a TP group: ``members`` in group order
    (``members[0]`` stands for the request towards the client), each member's tokens in
    order so far, and how many the client has."""

    members: list[Any]
    streams: list[list[int]] = field(default_factory=list)
    given: int = 0  # tokens the client has
    finished: set[int] = field(default_factory=set)  # members that finished ok
    answered: bool = False

    def __post_init__(self) -> None:
        self.streams = [[] for _ in self.members]
        for i, routed in enumerate(self.members):
            routed.group, routed.member = self, i

    @property
    def lead(self) -> Any:
        return self.members[0]


class RouterWire(Protocol):
    def send_abort(
        self, rank: int, rid: str, owner: int, writers: list[int], source: AbortSource, reason: str
    ) -> None: ...


class Client(Protocol):
    """Where a request's answer goes (an HTTP response, the simulator's world)."""

    def tokens(self, routed: Any, chunk: list[int]) -> None:
        """The next ``chunk`` of the answer, in order."""
        ...

    def done(self, routed: Any, outcome: Answer, error: str | None) -> None: ...


class RouterTimers(Protocol):
    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Any: ...


class RouterClock(Protocol):
    def now(self) -> float: ...


@dataclass
class RouterPorts:
    wire: RouterWire
    client: Client
    timers: RouterTimers
    clock: RouterClock
    capacity_changed: Callable[[], None] = lambda: None  # pages came back on some rank
    aborted: Callable[[Any, AbortSource], None] = lambda routed, source: None  # counted


R = TypeVar("R", bound=Routed)  # a host's record of a routed request


class RouterCore(Generic[R]):
    """The router's books and rules over ``ports`` (see the module's docstring)."""

    def __init__(self, ports: RouterPorts, ledger: Ledger) -> None:
        self.ports = ports
        self.ledger = ledger
        self.requests: dict[str, R] = {}
        self.foreign_answers = 0  # TOKENS or DONE from a rank not the request's owner

    def live(self, rid: str) -> R | None:
        """The live request ``rid`` names, or None (I2: none once terminal)."""
        routed = self.requests.get(rid)
        return routed if routed is not None and routed.req.live else None

    def answered_by(self, src: int, rid: str) -> R | None:
        """The live request ``rid`` names, when ``src`` is its owner, the one rank that
        speaks for its answer; None otherwise (a rank that is not its owner is counted
        in ``foreign_answers``)."""
        routed = self.live(rid)
        if routed is None:
            return None
        if src != routed.owner:
            self.foreign_answers += 1
            return None
        return routed

    # ------------------------------------------------------------------ answers
    def finish(self, routed: R, outcome: Answer, error: str | None) -> bool:
        """Answer ``routed`` (once: False if it was answered already)."""
        req = routed.req
        if not req.live:
            return False
        target = {Answer.OK: S.FINISHED, Answer.ABORTED: S.ABORTED, Answer.FAILED: S.FAILED}[
            outcome
        ]
        if target is S.FINISHED and req.state is S.PREFILLING:
            req.transition(S.DECODING)
        req.transition(target, error or "")
        routed.outcome, routed.error = outcome, error
        if routed.deadline is not None and routed.group is None:
            routed.deadline.cancel()  # a group's runs until the group is answered
        self.ledger.end(routed.rid, routed.ranks)
        if routed.group is None:
            self.ports.client.done(routed, outcome, error)
        else:
            self._member_ended(routed, outcome, error)
        self.forget_if_released(routed)
        return True

    # ------------------------------------------------------------------ decode groups
    def _member_ended(self, routed: R, outcome: Answer, error: str | None) -> None:
        """A member of a group answered: the group is ok once all are, with the same
        count; one that is not ends the others, and the client hears the first."""
        group = routed.group
        assert group is not None
        if outcome is Answer.OK:
            group.finished.add(routed.member)
            if len(group.finished) < len(group.members) or group.answered:
                return
            counts = sorted({len(s) for s in group.streams})
            if counts == [group.given]:
                self._answer_group(group, Answer.OK, None, None)
            else:
                error = f"the decode group's members answered {counts} tokens"
                self._answer_group(group, Answer.FAILED, error, None)
            return
        source = routed.abort_source or AbortSource.PEER
        reason = f"decode group member {routed.rid} (rank {routed.owner}) ended: {error}"
        if not group.answered:
            said = error if routed is group.lead else reason
            self._answer_group(group, outcome, said, routed.abort_source)
        for other in group.members:
            if other is not routed:
                self.abort(other.rid, source, reason)

    def _answer_group(
        self, group: GroupAnswer, outcome: Answer, error: str | None, source: AbortSource | None
    ) -> None:
        """The client's answer, once: on the lead's record, which the client holds (a
        lead that finished ok itself still answers what its group came to)."""
        group.answered = True
        lead = group.lead
        lead.outcome, lead.error, lead.abort_source = outcome, error, source
        if lead.deadline is not None:
            lead.deadline.cancel()
        self.ports.client.done(lead, outcome, error)

    def _give(self, routed: R, chunk: list[int]) -> None:
        """Tokens placed in order for ``routed``: to the client, or for a group member,
        into the group's combine (token ``i`` goes out once every member has it)."""
        group = routed.group
        if group is None:
            self.ports.client.tokens(routed, chunk)
            return
        group.streams[routed.member].extend(chunk)
        upto = min(len(s) for s in group.streams)
        if upto <= group.given or group.answered:
            return
        first = group.streams[0]
        for other, stream in zip(group.members[1:], group.streams[1:], strict=True):
            if stream[group.given : upto] != first[group.given : upto]:
                at = next(i for i in range(group.given, upto) if stream[i] != first[i])
                self._group_fails(
                    group,
                    f"decode group members disagree at token {at}: rank {group.lead.owner} "
                    f"has {first[at]}, rank {other.owner} has {stream[at]}",
                )
                return
        chunk, group.given = first[group.given : upto], upto
        self.ports.client.tokens(group.lead, chunk)

    def _group_fails(self, group: GroupAnswer, reason: str) -> None:
        """The members disagree: the client's answer fails with the reason (even when
        the lead itself already finished ok), and every live member is aborted."""
        if not group.answered:
            source = AbortSource.INTEGRITY
            self._answer_group(group, Answer.FAILED, f"{source}: {reason}", source)
        for member in group.members:
            self.abort(member.rid, AbortSource.INTEGRITY, reason)

    def abort(self, rid: str, source: AbortSource, reason: str) -> R | None:
        """Abort a live request: ABORT to its writers and owner, answered as the source
        says (the client's own, or the deadline's, or a failure)."""
        routed = self.live(rid)
        if routed is None:
            return None
        routed.abort_source = source
        self.ports.aborted(routed, source)
        self.fan_out_abort(routed, source, reason)
        self.finish(routed, AbortSource(source).answer, f"{source}: {reason}")
        return routed

    def abort_request(self, routed: R, source: AbortSource, reason: str) -> None:
        """Abort what ``routed`` stands for towards its client (its deadline, the client
        gone): the request, or, for a request decoded by a TP group, every member still
        live while the group is unanswered (its lead may have finished already, the
        others not: aborting the lead alone would end nothing)."""
        group = routed.group
        if group is None:
            self.abort(routed.rid, source, reason)
            return
        for member in list(group.members):
            if group.answered:  # the first member's abort answers it and ends the rest
                break
            if member.req.live:
                self.abort(member.rid, source, reason)

    def fan_out_abort(
        self, routed: R, source: AbortSource, reason: str, skip: int | None = None
    ) -> None:
        """ABORT to every writer, then the owner, except ``skip`` (the rank it came from)."""
        if routed.aborted_at is None:
            routed.aborted_at = self.ports.clock.now()
        for rank in [*routed.writers, routed.owner]:
            if rank != skip:
                self.ports.wire.send_abort(
                    rank, routed.rid, routed.owner, routed.writers, source, reason
                )

    def rank_lost(self, rank: int, reason: str) -> None:
        """Abort the live requests ``rank`` can still harm: those it owns, and those it
        writes whose pages may not all have arrived (one decoding has every notice)."""
        for routed in list(self.requests.values()):
            if not routed.req.live:
                continue
            if rank == routed.owner or (
                rank in routed.writers and routed.req.state is not S.DECODING
            ):
                self.abort(routed.rid, AbortSource.PEER, f"rank {rank} lost: {reason}")

    # ------------------------------------------------------------------ messages
    def on_abort(self, src: int, rid: str, source: AbortSource, reason: str) -> R | None:
        """A rank's ABORT: the request fails, and the abort reaches the other ranks."""
        routed = self.live(rid)
        if routed is None:
            return None
        routed.abort_source = source
        self.ports.aborted(routed, source)
        self.finish(routed, Answer.FAILED, f"{source}: {reason}")
        self.fan_out_abort(routed, source, reason, skip=src)
        return routed

    def on_tokens(self, src: int, rid: str, offset: int, tokens: list[int]) -> R | None:
        """Put a chunk from ``src`` where it belongs: chunks may arrive out of order, and
        only the contiguous answer so far is given to the client or counted. A chunk from
        a rank that is not the request's owner is refused (:meth:`answered_by`)."""
        routed = self.answered_by(src, rid)
        if routed is None:
            return None
        if routed.req.state is S.PREFILLING:
            routed.req.transition(S.DECODING)
        if offset < routed.placed or offset in routed.early:
            return routed  # already placed (a duplicate)
        routed.early[offset] = tokens
        while routed.placed in routed.early:
            chunk = routed.early.pop(routed.placed)
            routed.placed += len(chunk)
            self._give(routed, chunk)
            if not routed.req.live:
                return routed
        self.complete_if_whole(routed)
        return routed

    def on_done(
        self, src: int, rid: str, outcome: Outcome, count: int | None, error: str | None
    ) -> R | None:
        """The owner's DONE: finished (answered once every token stands in order, or
        failed after a grace for overtaken chunks), or failed or aborted there (the
        owner runs the abort protocol with the writers itself). A DONE from a rank that
        is not the request's owner is refused (:meth:`answered_by`)."""
        routed = self.answered_by(src, rid)
        if routed is None:
            return None
        if outcome is Outcome.FINISHED:
            routed.expected_count = count
            if not self.complete_if_whole(routed):

                def short() -> None:
                    self.finish(
                        routed,
                        Answer.FAILED,
                        f"decode reported {count} tokens, {routed.placed} arrived in order",
                    )

                self.ports.timers.call_later(TOKENS_GRACE_S, short)
        else:
            answer = Answer.FAILED if outcome is Outcome.FAILED else Answer.ABORTED
            self.finish(routed, answer, error)
        return routed

    def complete_if_whole(self, routed: R) -> bool:
        """After DONE(finished): ok once exactly ``count`` tokens stand in order."""
        count = routed.expected_count
        if count is None:
            return False
        if routed.placed == count and not routed.early:
            self.finish(routed, Answer.OK, None)
            return True
        if routed.placed > count or any(off + len(c) > count for off, c in routed.early.items()):
            self.finish(routed, Answer.FAILED, f"decode reported {count} tokens, more arrived")
            return True
        return False

    def on_released(self, src: int, rid: str, released_at: float | None) -> float | None:
        """``src`` released its pages of ``rid``. Returns the milliseconds from this
        router's ABORT to the owner's release (``released_at`` on this router's clock
        when the owner could say it, else now), when this was that release."""
        if self.ledger.release(src, rid):
            self.ports.capacity_changed()
        routed = self.requests.get(rid)
        if routed is None:
            return None
        timed = None
        if src == routed.owner and routed.aborted_at is not None:
            end = released_at if released_at is not None else self.ports.clock.now()
            timed = max(0.0, 1e3 * (end - routed.aborted_at))
        self.forget_if_released(routed)
        return timed

    def rank_gone(self, rank: int) -> None:
        """``rank``'s pool went with its process: nothing it held counts any more."""
        self.ledger.inherited[rank] = 0
        for rid in list(self.ledger.held[rank]):
            self.ledger.release(rank, rid)
            routed = self.requests.get(rid)
            if routed is not None:
                self.forget_if_released(routed)
        self.ports.capacity_changed()

    def forget_if_released(self, routed: R) -> None:
        if routed.req.live:
            return
        if all(routed.rid not in self.ledger.held[r] for r in routed.ranks):
            self.requests.pop(routed.rid, None)
