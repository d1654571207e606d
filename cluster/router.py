"""The router: admission, placement, and the request's fate as the client sees it.

Upholds:
- I1: a request that can never fit (context length, or the smallest pool it will touch)
  is rejected with 400 before anything is sent to a rank. The router keeps a ledger of
  pages reserved per rank; a reservation ends only when that rank reports RELEASED, so
  pages quarantined on a decode rank stay counted as used until released: a request that
  fits the pool but not what quarantine leaves of it waits (``admission_wait_s``), then
  gets 503 with the numbers, since the quarantine ends on proof, not by the client's doing.
- I2: the request's life cycle is ``engine.lifecycle.Request``; once terminal, later
  TOKENS or DONE for it are ignored, and nothing is sent for it but ABORT.
- I6: every outcome is counted; a request is reported ok only after DONE(finished) with
  every token it announced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from kvferry.engine.admission import AdmissionRejected, admit, pages_needed
from kvferry.engine.lifecycle import Request, RequestState
from kvferry.engine.protocol.ports import Clock
from kvferry.engine.protocol.proof import is_justified
from kvferry.engine.protocol.routing import (
    GroupAnswer,
    Ledger,
    Routed,
    RouterCore,
    RouterPorts,
)
from kvferry.engine.protocol.words import AbortSource, Answer, Kind
from kvferry.engine.tokenizer import VOCAB_SIZE, token_count
from kvferry.engine.tokenizer import decode as detokenize
from kvferry.engine.tokenizer import encode_array as tokenize
from kvferry.transfer.wire import Message

from . import messages as m
from .chunks import TOKENS_PER_CHUNK, spans
from .clock import MonotonicClock
from .fencing import FencePolicy, fence_order, order_fence
from .metrics import ClusterMetrics
from .rendezvous import RankCard
from .runtime import RankRuntime
from .store import StoreError
from .topology import Role, Topology

log = logging.getLogger("kvferry.cluster")

S = RequestState
HEARTBEAT_TIMEOUT_S = 5.0
ABORT_RELEASE_WINDOW = 2000  # the owners' latest abort-to-release times kept for /status


def latency_summary(values_ms: list[float]) -> dict:
    """count, p50/p90/p99 and max of a list of milliseconds."""
    if not values_ms:
        return {"count": 0}
    v = sorted(values_ms)

    def pick(q: float) -> float:
        return round(v[min(len(v) - 1, int(q * len(v)))], 3)

    return {
        "count": len(v),
        "p50_ms": pick(0.5),
        "p90_ms": pick(0.9),
        "p99_ms": pick(0.99),
        "max_ms": round(v[-1], 3),
    }


class Unavailable(Exception):
    """No capacity or no healthy rank right now (HTTP 503)."""

    http_status = 503

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass
class RoutedRequest(Routed):
    """A routed request as the HTTP front door sees it: its answer's events (tokens,
    done) for the response, and the figures /metrics shows."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    transfer_ms: float | None = None
    prefill_ms: float | None = None
    landed_to_first_token_ms: float | None = None  # an owner on this host only

    @property
    def text(self) -> str:
        return detokenize(self.req.output_tokens)


def group_fields(routed: Routed) -> dict:
    """ASSIGN's fields naming the decode group of a request decoded by one (every
    member's request id and rank, in group order); none for a request decoded alone."""
    if routed.group is None:
        return {}
    members = routed.group.members
    return {"group_rids": [r.rid for r in members], "group_ranks": [r.owner for r in members]}


def share_of(routed: Routed, writer: int) -> str:
    """The request id ``writer`` holds ``routed``'s prompt under: the first member of its
    decode group that it writes into (where the router reserved its pages, once), or the
    request's own id."""
    members = routed.group.members if routed.group is not None else [routed]
    return next(m.rid for m in members if writer in m.writers)


@dataclass
class Rejoin:
    """A rank that came back with a new incarnation, not yet routed to: it is admitted
    once it has reported (STATS) and no healthy rank still waits on its old incarnation
    (every one has adopted its new card and lists no quarantine of the old one)."""

    old_incarnations: tuple[int, ...]  # every one since it was last admitted
    new_incarnation: int
    epoch: int  # the card epoch at which the router saw the new card
    since: float
    heard: bool = False

    def names(self, rank: int) -> set[str]:
        """The old incarnations as ranks list their quarantines ("rank:incarnation")."""
        return {f"{rank}:{inc:x}" for inc in self.old_incarnations}


class Router:
    HANDLES = frozenset(
        {Kind.STATS, Kind.SEVERED, Kind.RELEASED, Kind.TOKENS, Kind.DONE, Kind.ABORT}
    )

    def __init__(
        self,
        runtime: RankRuntime,
        topology: Topology,
        cards: dict[int, RankCard],
        *,
        context_length: int,
        request_timeout_s: float,
        admission_wait_s: float,
        metrics: ClusterMetrics,
        clock: Clock | None = None,
        fence_severed: FencePolicy = FencePolicy.RESTART,
        kv_heads: int | None = None,
        kv_replicated: bool = False,
    ) -> None:
        self.rt = runtime
        # who writes which heads into which decode member (None: every member of a
        # prefill group writes into a decode rank of every head)
        self.split = topology.split(kv_heads, kv_replicated) if kv_heads is not None else None
        self.fence_severed = fence_severed
        self.clock = clock or MonotonicClock()  # the time the router's rules read
        self.topology = topology
        self.cards = cards
        self.context_length = min(
            [context_length]
            + [c.context_length for c in cards.values() if c.role is not Role.ROUTER]
        )
        self.request_timeout_s = request_timeout_s
        self.admission_wait_s = admission_wait_s
        self.metrics = metrics
        self.page_size = cards[topology.decode_ranks[0]].page_size
        prefill_card = cards.get(topology.prefill_ranks[0])
        self.prefill_page_size = prefill_card.page_size if prefill_card else self.page_size
        self._capacity_changed = asyncio.Event()
        self.core: RouterCore[RoutedRequest] = RouterCore(
            RouterPorts(
                wire=self,
                client=self,
                timers=self,
                clock=self.clock,
                capacity_changed=self._capacity_changed.set,
                aborted=lambda routed, source: self.metrics.aborts.labels(source).inc(),
            ),
            Ledger({r: c.num_pages for r, c in cards.items() if c.role is not Role.ROUTER}),
        )
        self.ledger = self.core.ledger
        self.requests: dict[str, RoutedRequest] = self.core.requests
        self.rank_stats: dict[int, dict] = {}
        self.reports: dict[int, int] = {}  # STATS received per rank (/status: how fresh)
        self.last_seen: dict[int, float] = {r: self.clock.now() for r in self.ledger.totals}
        self.unhealthy: dict[int, str] = {}
        # Ranks an owner severed, with the incarnation severed: never routed to again
        # (a severed rank rejoins only with a new incarnation), whatever its heartbeat.
        self.severed: dict[int, int] = {}
        self.fences_ordered = 0  # severed incarnations whose launcher was told to kill them
        self.rejoining: dict[int, Rejoin] = {}
        self.rejoined = 0  # ranks admitted again with a new incarnation
        # Ranks that have not reported (STATS) to this router incarnation yet: until every
        # live one has, nothing is admitted. A restarted router cannot know what a pool
        # still holds for its old incarnation's requests before the rank says so.
        self.awaiting_reports: set[int] = set(self.ledger.totals)
        self._ids = itertools.count(1)
        # 64 random bits an incarnation: a restarted router never reissues an id that its
        # old incarnation's requests may still hold on a rank (TOKENS and DONE name the
        # request by id alone)
        self._prefix = secrets.token_hex(8)
        self.stopping: str | None = None  # why, once shutdown began: nothing is admitted
        self._rr = itertools.count()
        self.abort_release_ms: deque[tuple[str, float]] = deque(maxlen=ABORT_RELEASE_WINDOW)
        # From this router's ABORT to the owner's release (RouterCore.on_released).
        self.abort_from_router_ms: deque[float] = deque(maxlen=ABORT_RELEASE_WINDOW)
        metrics.context_length.set(self.context_length)
        self.handlers = {
            Kind.STATS: self._on_stats,
            Kind.SEVERED: self._on_severed_msg,
            Kind.RELEASED: self._on_released,
            Kind.TOKENS: self._on_tokens,
            Kind.DONE: self._on_done,
            Kind.ABORT: self._on_abort,
        }
        assert set(self.handlers) == self.HANDLES
        runtime.set_handlers(
            {k: self._heard_from(fn) for k, fn in self.handlers.items()}, role="router"
        )
        runtime.on_send_failure = self._on_send_failure
        runtime.on_card_replaced = self._on_card_replaced
        runtime.on_request_error = lambda rid, reason: self.abort(rid, AbortSource.INTERNAL, reason)

    # ------------------------------------------------------------------ admission
    def new_request_id(self) -> str:
        return f"req-{self._prefix}-{next(self._ids):06d}"

    def waiting_for_reports(self) -> list[int]:
        """The live ranks that have not reported to this router yet (admission waits)."""
        return sorted(self.awaiting_reports - set(self.unhealthy))

    def _pick(self, prompt_len: int, need_decode: int) -> list[tuple[int, list[int]]] | None:
        """A decode group and a prefill group with room: per member of the decode group,
        (its rank, the prefill ranks that write into it). A prefill rank that writes into
        several members computes and holds the prompt's pages once for all of them."""
        if self.waiting_for_reports():
            return None
        need_prefill = pages_needed(prompt_len, 0, self.prefill_page_size)
        decodes = [
            g
            for g in self.topology.decode_groups
            if not set(g) & set(self.unhealthy)
            and min(self.ledger.free(r) for r in g) >= need_decode
        ]
        groups = [
            g
            for g in self.topology.prefill_groups
            if not set(g) & set(self.unhealthy)
            and all(self.ledger.free(r) >= need_prefill for r in g)
        ]
        if not decodes or not groups:
            return None
        turn = next(self._rr)
        owners = max(
            decodes,
            key=lambda g: (min(self.ledger.free(r) for r in g), -((g[0] + turn) % len(decodes))),
        )
        group = max(
            groups, key=lambda g: (min(self.ledger.free(r) for r in g), -(turn % len(groups)))
        )
        if self.split is None:
            return [(owner, list(group)) for owner in owners]
        return [
            (owner, [group[w] for w in self.split.writers_of(position)])
            for position, owner in enumerate(owners)
        ]

    def check_admission(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        """I1: raise AdmissionRejected if this request can never fit anywhere."""
        healthy_decode = [
            r for g in self.topology.decode_groups if not set(g) & set(self.unhealthy) for r in g
        ]
        healthy_prefill = [
            g for g in self.topology.prefill_groups if not set(g) & set(self.unhealthy)
        ]
        if not healthy_decode or not healthy_prefill:
            raise Unavailable(
                rid,
                f"no healthy {'decode' if not healthy_decode else 'prefill'} "
                f"rank (unhealthy: {self.unhealthy})",
            )
        decode_cap = max(self.ledger.totals[r] for r in healthy_decode) * self.page_size
        prefill_cap = (
            max(min(self.ledger.totals[r] for r in g) for g in healthy_prefill)
            * self.prefill_page_size
        )
        admit(rid, prompt_len, max_tokens, self.context_length, decode_cap)
        if prompt_len > prefill_cap:
            raise AdmissionRejected(
                rid,
                prompt_len,
                max_tokens,
                self.context_length,
                prefill_cap,
                f"prompt needs {prompt_len} positions, more than a prefill "
                f"pool can hold ({prefill_cap} tokens)",
            )

    def _refuse_if_stopping(self, rid: str) -> None:
        if self.stopping is not None:
            self.metrics.requests.labels(Answer.UNAVAILABLE).inc()
            raise Unavailable(rid, f"the cluster is stopping ({self.stopping})")

    async def submit(self, prompt: str, max_tokens: int) -> RoutedRequest:
        """Admit and dispatch; raises AdmissionRejected (400) or Unavailable (503, also
        once :meth:`shutdown` began, whether the request arrived before or waits for room)."""
        rid = self.new_request_id()
        self._refuse_if_stopping(rid)
        arrived = self.clock.now()  # time to first token counts from here
        try:  # on the prompt's length, before its tokens are made (four bytes each)
            self.check_admission(rid, token_count(prompt), max_tokens)
        except AdmissionRejected as exc:
            self.metrics.requests.labels(Answer.REJECTED).inc()
            log.info("request %s rejected: %s", rid, exc)
            raise
        except Unavailable:
            self.metrics.requests.labels(Answer.UNAVAILABLE).inc()
            raise
        tokens = tokenize(prompt)
        req = Request(rid, cast(list[int], tokens), max_tokens)  # an array serves as one
        need = pages_needed(len(tokens), max_tokens, self.page_size)
        deadline = self.clock.now() + self.admission_wait_s
        while (placement := self._pick(len(tokens), need)) is None:
            remaining = deadline - self.clock.now()
            if remaining <= 0:
                self.metrics.requests.labels(Answer.UNAVAILABLE).inc()
                free = {r: self.ledger.free(r) for r in self.ledger.totals}
                quarantined = {
                    r: self.ledger.totals[r] - self.ledger.reusable(r)
                    for r in self.ledger.totals
                    if self.ledger.reusable(r) < self.ledger.totals[r]
                }
                if self.waiting_for_reports():
                    raise Unavailable(
                        rid,
                        f"ranks {self.waiting_for_reports()} have not reported what their "
                        f"pools hold to this router within {self.admission_wait_s:.1f} s",
                    )
                raise Unavailable(
                    rid,
                    f"no pool has room for {need} pages within "
                    f"{self.admission_wait_s:.1f} s (free pages by rank: {free}; "
                    f"held in quarantine: {quarantined})",
                )
            self._capacity_changed.clear()
            try:
                await asyncio.wait_for(self._capacity_changed.wait(), remaining)
            except TimeoutError:
                pass
            self._refuse_if_stopping(rid)
        self._refuse_if_stopping(rid)
        members = self._place(req, placement, arrived, len(tokens), need)
        routed = members[0]
        routed.deadline = asyncio.get_running_loop().call_later(
            self.request_timeout_s,
            lambda: self.abort_request(
                routed, AbortSource.DEADLINE, f"no answer within {self.request_timeout_s:.1f} s"
            ),
        )
        log.info(
            "request %s: %d prompt tokens, max_tokens %d -> %s",
            rid,
            len(tokens),
            max_tokens,
            "; ".join(
                f"{'' if member is routed else member.rid + ': '}prefill {member.writers}, "
                f"decode {member.owner}"
                for member in members
            ),
        )
        try:
            for member in members:
                self._dispatch(member, prompt, tokens, max_tokens)
        except Exception as exc:
            if self.rt.faults.swallow_errors:
                raise
            # Pages are reserved and some ranks may have heard of it: the abort protocol
            # undoes what was done, and the client gets the error with the request id.
            reason = f"dispatch failed: {type(exc).__name__}: {exc}"
            log.error("request %s: %s", rid, reason, exc_info=exc)
            self.abort(rid, AbortSource.INTERNAL, reason)
        return routed

    def _place(
        self,
        req: Request,
        placement: list[tuple[int, list[int]]],
        arrived: float,
        prompt_len: int,
        need: int,
    ) -> list[RoutedRequest]:
        """The routed request, one per owner: a decode group's members each get a request
        of their own (``rid.1``, ``rid.2``, ...; the first is ``rid`` itself, the client's),
        bound by one :class:`~kvferry.engine.protocol.routing.GroupAnswer`. Their pages are
        reserved here: each owner's for its member, each writer's once, for the first
        member it writes into (it holds the prompt's pages under that member's id for
        every member it writes into, and reports them released under it)."""
        members: list[RoutedRequest] = []
        reserved: set[int] = set()  # the writers whose pages are reserved (once each)
        for position, (owner, writers) in enumerate(placement):
            member_req = (
                req
                if position == 0
                else Request(f"{req.request_id}.{position}", req.prompt_tokens, req.max_tokens)
            )
            member_req.transition(S.ADMITTED)
            routed = RoutedRequest(member_req, owner, writers, arrived)
            self.requests[routed.rid] = routed
            self.ledger.reserve(owner, routed.rid, need)
            for w in set(writers) - reserved:
                reserved.add(w)
                self.ledger.reserve(
                    w, routed.rid, pages_needed(prompt_len, 0, self.prefill_page_size)
                )
            member_req.transition(S.PREFILLING)
            members.append(routed)
        if len(members) > 1:
            GroupAnswer(members)
        return members

    def _dispatch(
        self, routed: RoutedRequest, prompt: str, tokens: np.ndarray, max_tokens: int
    ) -> None:
        """ASSIGN to the owner, then PREFILL (the prompt in chunks) to every writer: the
        owner allocates and plans while the prompt travels, so a long prompt's plan is at
        its writers before their prefill makes the first part final."""
        rid, owner = routed.rid, routed.owner
        self.rt.faults.raise_at("router-dispatch", prompt)
        packed = np.asarray(tokens, dtype="<i4")
        owner_inc = self.cards[owner].incarnation
        self.rt.send(
            owner,
            m.ASSIGN,
            rid=rid,
            prompt_len=len(tokens),
            max_tokens=max_tokens,
            writers=routed.writers,
            last_token=int(tokens[-1]),
            **group_fields(routed),
        )
        for w in routed.writers:
            for lo, hi in spans(len(packed), TOKENS_PER_CHUNK):
                self.rt.send(
                    w,
                    m.PREFILL,
                    rid=rid,
                    tokens=packed[lo:hi].tobytes(),
                    offset=lo,
                    total=len(packed),
                    owner=owner,
                    owner_inc=owner_inc,
                    share=share_of(routed, w),
                )

    # ------------------------------------------------------------------ the core's ports
    def send_abort(
        self, rank: int, rid: str, owner: int, writers: list[int], source: AbortSource, reason: str
    ) -> None:
        self.rt.send(
            rank, m.ABORT, rid=rid, owner=owner, writers=writers, source=source, reason=reason
        )

    def call_later(self, delay_s: float, fn) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay_s, fn)

    def tokens(self, routed: RoutedRequest, chunk: list[int]) -> None:
        if routed.first_token_at is None:
            routed.first_token_at = self.clock.now()
            self.metrics.ttft.observe(routed.first_token_at - routed.submitted_at)
        routed.req.output_tokens.extend(chunk)
        routed.events.put_nowait(("tokens", chunk))

    def done(self, routed: RoutedRequest, outcome: Answer, error: str | None) -> None:
        self.metrics.requests.labels(outcome).inc()
        routed.events.put_nowait(("done", outcome, error))
        if outcome is not Answer.OK:
            log.warning("request %s %s: %s", routed.rid, outcome, error)

    # ------------------------------------------------------------------ outcomes
    def abort(self, rid: str, source: AbortSource, reason: str) -> None:
        """Abort a live request: fan ABORT out to its owner and every writer (step 2)."""
        self.core.abort(rid, source, reason)

    def abort_request(self, routed: RoutedRequest, source: AbortSource, reason: str) -> None:
        """Abort what the client holds: the request, or every live member of its decode
        group (:meth:`RouterCore.abort_request`)."""
        self.core.abort_request(routed, source, reason)

    def shutdown(self, reason: str) -> int:
        """Before the router stops: every live request ends now with an error (HTTP 503),
        rather than at its deadline, and its ranks are told. Returns how many ended."""
        self.stopping = reason
        self._capacity_changed.set()  # the requests waiting for room are refused now
        live = [r.rid for r in self.requests.values() if r.req.live]
        for rid in live:
            self.abort(rid, AbortSource.SHUTDOWN, reason)
        return len(live)

    # ------------------------------------------------------------------ messages
    def _heard_from(self, handler):
        """``handler``, after noting that its sender is alive (the heartbeat)."""

        def heard(msg: Message) -> None:
            self.last_seen[msg.src] = self.clock.now()
            handler(msg)

        return heard

    def _on_severed_msg(self, msg: Message) -> None:
        self._on_severed(msg.peer_rank, msg.incarnation, f"severed by rank {msg.src}: {msg.reason}")

    def _on_released(self, msg: Message) -> None:
        self.metrics.releases.labels(msg.justification).inc()
        if not is_justified(msg.justification):
            log.error(
                "request %s: rank %d released %d pages without proof (justification %r)",
                msg.rid,
                msg.src,
                msg.pages,
                msg.justification,
            )
        if msg.abort_ms is not None:
            self.abort_release_ms.append((msg.how, msg.abort_ms))
            self.metrics.abort_release.observe(msg.abort_ms / 1e3)
        routed = self.requests.get(msg.rid)
        released_at = None
        if routed is not None and msg.released_ns:
            # the owner's clock is this one when it runs on this host (one CLOCK_MONOTONIC);
            # else the release is timed until RELEASED arrived here (an upper bound)
            if self.cards[routed.owner].host == self.cards[self.rt.rank].host:
                released_at = msg.released_ns / 1e9
        ms = self.core.on_released(msg.src, msg.rid, released_at)
        if ms is not None:
            self.abort_from_router_ms.append(ms)
            self.metrics.abort_from_router.observe(ms / 1e3)

    def _owner_speaks(self, msg: Message) -> RoutedRequest | None:
        """The live request ``msg`` names, when its sender is the request's owner; a
        TOKENS or DONE from any other rank is dropped, logged with the request id."""
        routed = self.core.live(msg.rid)
        if routed is None:
            return None
        if msg.src != routed.owner:
            self.core.answered_by(msg.src, msg.rid)  # counts it
            log.error(
                "request %s: %s from rank %d dropped: its owner is rank %d, the one rank "
                "that speaks for its answer (%d such messages so far)",
                msg.rid,
                msg.kind,
                msg.src,
                routed.owner,
                self.core.foreign_answers,
            )
            return None
        return routed

    def _on_tokens(self, msg: Message) -> None:
        if self._owner_speaks(msg) is None:
            return
        tokens = list(msg.tokens)
        bad = [t for t in tokens if not 0 <= t < VOCAB_SIZE]
        if bad:  # no text can be made of it: the request fails, with the numbers
            at = msg.offset + tokens.index(bad[0])
            self.abort(
                msg.rid,
                AbortSource.INTERNAL,
                f"rank {msg.src} sent token {bad[0]} at offset {at}, outside the vocabulary "
                f"of {VOCAB_SIZE}",
            )
            return
        self.core.on_tokens(msg.src, msg.rid, msg.offset, tokens)

    def _on_done(self, msg: Message) -> None:
        routed = self._owner_speaks(msg)
        if routed is None:
            return
        if msg.transfer_ms is not None:
            routed.transfer_ms = msg.transfer_ms
            self.metrics.transfer_latency.observe(msg.transfer_ms / 1e3)
        routed.prefill_ms = msg.prefill_ms
        # the owner's clock is this one when it runs on this host (one CLOCK_MONOTONIC)
        if (
            msg.landed_ns is not None
            and routed.first_token_at is not None
            and self.cards[routed.owner].host == self.cards[self.rt.rank].host
        ):
            routed.landed_to_first_token_ms = 1e3 * (routed.first_token_at - msg.landed_ns / 1e9)
        self.core.on_done(msg.src, msg.rid, msg.outcome, msg.count, msg.error)

    def _on_abort(self, msg: Message) -> None:
        self.core.on_abort(msg.src, msg.rid, msg.source, msg.reason)

    def _on_stats(self, msg: Message) -> None:
        stats = dict(msg.fields)
        stats["dropped"] = {
            "duplicate": msg.dropped_duplicate,
            "stale": msg.dropped_stale,
            "malformed": msg.dropped_malformed,
            "unauthenticated": msg.dropped_unauthenticated or 0,
        }
        if msg.dropped_duplicate_assign is not None:  # a decode rank's count
            stats["dropped"]["duplicate_assign"] = msg.dropped_duplicate_assign
        self.rank_stats[msg.src] = stats
        self.reports[msg.src] = self.reports.get(msg.src, 0) + 1
        self.metrics.set_rank_stats(msg.src, self.cards[msg.src].role, stats)
        if msg.src in self.ledger.totals:
            before = self.ledger.inherited.get(msg.src, 0)
            self.ledger.inherit(msg.src, msg.owned + msg.quarantined, msg.other_routers)
            if self.ledger.inherited.get(msg.src, 0) < before:
                self._capacity_changed.set()
            if msg.src in self.awaiting_reports:
                self.awaiting_reports.discard(msg.src)
                self._capacity_changed.set()
                if not self.waiting_for_reports():
                    log.info("every live rank has reported: admitting requests")
        rejoin = self.rejoining.get(msg.src)
        if rejoin is not None:
            rejoin.heard = True  # only the new incarnation's messages get this far
            return
        why = self.unhealthy.get(msg.src)
        if (
            why is not None
            and msg.src not in self.severed
            and why.startswith(("no heartbeat", "unreachable"))
        ):
            log.info("rank %d is back (it was %s)", msg.src, why)
            del self.unhealthy[msg.src]
            self._abort_again_on(msg.src)

    def _abort_again_on(self, rank: int) -> None:
        """ABORT again, to a rank back from unreachable, every ended request whose pages
        the ledger still holds on it: what was sent to it meanwhile (the request, its
        ABORT) may be lost, and a rank that never heard of a request never reports it
        released. One that did hear of it takes the ABORT as a duplicate."""
        for rid in list(self.ledger.held.get(rank, {})):
            routed = self.requests.get(rid)
            if routed is None or routed.req.live:
                continue
            log.info("request %s: ABORT sent again to rank %d, back from unreachable", rid, rank)
            self.send_abort(
                rank,
                rid,
                routed.owner,
                routed.writers,
                routed.abort_source or AbortSource.INTERNAL,
                f"request {rid} ended while rank {rank} was unreachable",
            )

    def _on_send_failure(self, rank: int, exc: Exception) -> None:
        self._on_rank_lost(rank, f"unreachable: {exc}")

    def _on_severed(self, rank: int, incarnation: int, reason: str) -> None:
        """An owner severed ``rank``: it is never routed to again in this incarnation,
        even once its heartbeat comes back (the owner keeps refusing it), and /health says
        why. A rank already marked for a missed heartbeat is marked severed all the same."""
        if incarnation != self.cards[rank].incarnation or rank in self.severed:
            return
        self.severed[rank] = incarnation
        self.unhealthy.pop(rank, None)
        self._on_rank_lost(rank, reason)
        self._fence(rank, incarnation, reason)

    def _fence(self, rank: int, incarnation: int, reason: str) -> None:
        """Order ``rank``'s launcher to kill its severed incarnation (see .fencing): its
        exit record proves its writes stopped, and torchrun brings it back new. Without
        a store (one torchrun group) or with ``--fence-severed off`` it stays severed."""
        store = getattr(self.rt, "store", None)
        if self.fence_severed is not FencePolicy.RESTART or store is None:
            log.warning(
                "rank %d stays severed (incarnation %#x) until the cluster is stopped: %s",
                rank,
                incarnation,
                "fencing by restart is off" if store is not None else "no launcher",
            )
            return
        try:
            order_fence(store, fence_order(rank, incarnation, reason), self.rt.trust)
        except StoreError as exc:
            log.error("rank %d: cannot order its fence (it stays severed): %s", rank, exc)
            return
        self.fences_ordered += 1
        log.warning(
            "rank %d (incarnation %#x) severed: its launcher is ordered to restart it (%s)",
            rank,
            incarnation,
            reason,
        )

    def _on_rank_lost(self, rank: int, reason: str) -> None:
        """Route nothing more to ``rank`` and abort the live requests it can still harm:
        those it owns, and those it writes whose pages may not all have arrived (a
        request already decoding has every writer's notice, and goes on)."""
        if rank in self.unhealthy:
            return
        self.unhealthy[rank] = reason
        log.error("rank %d marked unhealthy: %s", rank, reason)
        self.core.rank_lost(rank, reason)

    # ------------------------------------------------------------------ failure domains
    def _on_rank_exited(self, rank: int, reason: str) -> None:
        """``rank``'s process is gone (its launcher said so, or /proc on this host): its
        live requests fail at once, it is routed nothing more, and what the ledger held
        on it is dropped, since its pool went with it."""
        if self.unhealthy.get(rank, "").startswith(("exited", "rejoining")):
            return
        self.unhealthy.pop(rank, None)
        self._on_rank_lost(rank, reason)
        self.unhealthy[rank] = reason
        self.core.rank_gone(rank)

    def _on_card_replaced(self, old: RankCard, new: RankCard) -> None:
        """``old.rank`` came back as ``new``: whatever its old incarnation held is gone,
        and it waits to be admitted (see :class:`Rejoin`)."""
        rank = old.rank
        self._on_rank_exited(
            rank, f"exited (pid {old.pid}, incarnation {old.incarnation:#x}; restarted)"
        )
        self.severed.pop(rank, None)
        # restarted again before it was admitted: ranks may still wait on every one
        before = self.rejoining.get(rank)
        olds = (*before.old_incarnations, old.incarnation) if before else (old.incarnation,)
        self.rejoining[rank] = Rejoin(olds, new.incarnation, self.rt.cards_epoch, self.clock.now())
        self.unhealthy[rank] = (
            f"rejoining as incarnation {new.incarnation:#x}: until no rank waits on "
            f"incarnation {', '.join(f'{inc:#x}' for inc in olds)}"
        )
        self.last_seen[rank] = self.clock.now()

    def _admit_rejoined(self) -> None:
        for rank, rejoin in list(self.rejoining.items()):
            if not rejoin.heard:
                continue
            olds = rejoin.names(rank)
            waiting = [
                r for r in self.ledger.totals if r != rank and self._waits_on(r, rejoin, olds)
            ]
            if waiting:
                continue
            del self.rejoining[rank]
            self.unhealthy.pop(rank, None)
            card = self.cards[rank]
            self.ledger.totals[rank] = card.num_pages
            self.ledger.held[rank], self.ledger.orphaned[rank] = {}, set()
            self.rejoined += 1
            self._capacity_changed.set()
            log.info(
                "rank %d rejoined as incarnation %#x (pid %d) %.1f s after it came back: "
                "no rank waits on its old incarnations %s any more",
                rank,
                card.incarnation,
                card.pid,
                self.clock.now() - rejoin.since,
                ", ".join(f"{inc:#x}" for inc in rejoin.old_incarnations),
            )

    def _waits_on(self, r: int, rejoin: Rejoin, olds: set[str]) -> bool:
        """Whether rank ``r`` may still wait on an old incarnation of a rejoining rank: it
        lists a quarantine of one in its last STATS, or (while healthy) has not adopted
        the new card yet. A rank gone (exited, or back as a new incarnation with a fresh
        pool) waits on nothing; one only late (no heartbeat) still holds what its last
        STATS said."""
        reason = self.unhealthy.get(r, "")
        if reason.startswith(("exited", "rejoining")):
            return False
        stats = self.rank_stats.get(r, {})
        if olds & set(stats.get("fenced") or ()):
            return True
        return not reason and (stats.get("cards_epoch") or 0) < rejoin.epoch

    def check_liveness(self) -> None:
        """With a rendezvous store (failure domains): adopt restarted ranks' cards, mark
        the ranks whose process exited (gone from /proc on this host; elsewhere, an exit
        record new in the store's exit log), admit rejoined ones."""
        if self.rt.store is None:
            return
        feed = getattr(self.rt.store, "feed", None)  # etcd: a watch on the records
        if feed is None or feed.due():
            self.rt.refresh_cards()
            self.rt.poll_exits()  # one store round trip unless someone exited
        for rank in self.ledger.totals:
            if rank in self.rejoining or self.unhealthy.get(rank, "").startswith("exited"):
                continue
            if self.rt.process_exited(rank):
                card = self.cards[rank]
                self._on_rank_exited(
                    rank,
                    f"exited (pid {card.pid} on {card.host}, incarnation {card.incarnation:#x})",
                )
        self._admit_rejoined()

    def store_problem(self) -> str | None:
        """Why the rendezvous store does not answer (``unreachable since 3.1 s: ...``), or
        None: it answers, or there is none (one torchrun group)."""
        problem = getattr(self.rt.store, "problem", None)
        return problem() if problem is not None else None

    def check_heartbeats(self) -> None:
        self.check_liveness()
        now = self.clock.now()
        for rank, seen in self.last_seen.items():
            if now - seen > HEARTBEAT_TIMEOUT_S and rank not in self.unhealthy:
                self.unhealthy[rank] = f"no heartbeat for {now - seen:.1f} s"
                log.error("rank %d marked unhealthy: no heartbeat for %.1f s", rank, now - seen)

    # ------------------------------------------------------------------ reports
    def capacity_table(self) -> list[dict]:
        """Every rank's measured pool capacity against the context length (I3)."""
        rows = []
        for rank, card in sorted(self.cards.items()):
            if card.role is Role.ROUTER:
                continue
            rows.append(
                {
                    "rank": rank,
                    "role": card.role,
                    "host": card.host,
                    "capacity_tokens": card.capacity_tokens,
                    "context_length": self.context_length,
                    "ok": card.capacity_tokens >= self.context_length,
                }
            )
        return rows

    def abort_release_summary(self) -> dict:
        """The latest ``ABORT_RELEASE_WINDOW`` abort-to-release times measured by the
        owners (all of them are in the ``kvferry_abort_release_seconds`` histogram): all,
        those that waited in quarantine for writers' acks, and each one."""
        return {
            "all": latency_summary([ms for _, ms in self.abort_release_ms]),
            "quarantined": latency_summary(
                [ms for how, ms in self.abort_release_ms if how != "freed"]
            ),
            "recent": [[how, round(ms, 3)] for how, ms in self.abort_release_ms],
            "from_router": latency_summary(list(self.abort_from_router_ms)),
            "recent_from_router": [round(ms, 3) for ms in self.abort_from_router_ms],
        }

    def status(self) -> dict:
        live = sum(1 for r in self.requests.values() if r.req.live)
        return {
            "live_requests": live,
            "held_pages": self.ledger.outstanding(),
            "awaiting_reports": self.waiting_for_reports(),
            "quarantined_requests": {r: sorted(s) for r, s in self.ledger.orphaned.items() if s},
            "unhealthy": self.unhealthy,
            "store": self.store_problem() or "ok",
            "severed": sorted(self.severed),
            "fences_ordered": self.fences_ordered,
            "rejoining": {r: f"{j.new_incarnation:#x}" for r, j in self.rejoining.items()},
            "rejoined": self.rejoined,
            "processes": {
                r: {"host": c.host, "pid": c.pid, "incarnation": f"{c.incarnation:#x}"}
                for r, c in sorted(self.cards.items())
            },
            "transports": {r: c.transports for r, c in sorted(self.cards.items())},
            "ranks": self.rank_stats,
            "reports": dict(self.reports),
            "abort_release": self.abort_release_summary(),
            "context_length": self.context_length,
            "router": self.own_counts(),
        }

    def own_counts(self) -> dict:
        """What the router's own runtime refused: messages dropped by reason (with
        ``foreign_answer``: TOKENS or DONE from a rank not the request's owner), and cards
        and exit records in the store that did not authenticate."""
        c = getattr(self.rt, "counters", None)
        if c is None:  # a stand-in runtime (tests)
            return {}
        return {
            # + TOKENS or DONE from a rank that is not the request's owner
            "dropped": {**self.rt.dropped(), "foreign_answer": self.core.foreign_answers},
            "cards_refused": c.cards_refused,
            "exit_records_refused": c.exit_records_refused + self.rt.exit_log.refused,
        }
