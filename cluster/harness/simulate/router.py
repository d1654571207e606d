"""The simulated router: admission and placement on the simulated clock, around the same
router core the service's router hosts (:class:`kvferry.engine.protocol.routing.RouterCore`:
the ledger, the abort fan-out, the client's answer, forgetting on release, what a lost
rank aborts).

What is the simulator's own:

- admission (I1) with the real :func:`~kvferry.engine.admission.admit` against the largest
  healthy pool; a request that fits but finds no room waits ``admission_wait_s`` for a
  release, then is refused (503), as ``Router.submit`` does;
- placement as ``Router._pick``, vectorised over thousands of ranks: the decode rank with
  the most free pages (ties turn round robin), the prefill group whose fullest member has
  the most free pages; pages reserved in the core's ledger (a reservation ends only on that
  rank's RELEASED, so quarantined pages count as used);
- health: SEVERED and a send that failed mark the rank unhealthy for good (the core then
  aborts what it can still harm); a rank silent for ``HEARTBEAT_TIMEOUT_S`` is not routed
  to until it is heard again (its STATS are not simulated: the simulator knows when a rank
  stops and starts sending them).

Waiting requests retry in arrival order after each release; the first that still does
not fit ends the round (the real router wakes every waiter; with the sizes here the
order of the few that fit differs at most).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.cluster import messages as m
from kvferry.cluster.launch import STATS_INTERVAL_S
from kvferry.cluster.router import HEARTBEAT_TIMEOUT_S
from kvferry.engine.admission import AdmissionRejected, admit, pages_needed
from kvferry.engine.lifecycle import Request, RequestState
from kvferry.engine.protocol.routing import Ledger, Routed, RouterCore, RouterPorts
from kvferry.engine.protocol.words import AbortSource, Answer, Kind

from .ranks import SimRuntime

if TYPE_CHECKING:
    from .world import World

S = RequestState


class FastLedger(Ledger):
    """The router's ledger, with each rank's used pages kept as a running sum (the real
    one sums the rank's reservations on every look)."""

    def __init__(self, totals: dict[int, int], changed: Callable[[int, int], None]) -> None:
        super().__init__(totals)
        self.used = dict.fromkeys(totals, 0)
        self._changed = changed

    def free(self, rank: int) -> int:
        return self.totals[rank] - self.used[rank]

    def reserve(self, rank: int, rid: str, pages: int) -> None:
        self.used[rank] += pages - self.held[rank].get(rid, 0)
        super().reserve(rank, rid, pages)
        self._changed(rank, self.totals[rank] - self.used[rank])

    def release(self, rank: int, rid: str) -> bool:
        self.used[rank] -= self.held[rank].get(rid, 0)
        ok = super().release(rank, rid)
        self._changed(rank, self.totals[rank] - self.used[rank])
        return ok


@dataclass
class Waiting:
    rid: str
    prompt_len: int
    max_tokens: int
    submitted_at: float
    timer: Any = None


class SimRouter:
    def __init__(
        self,
        world: World,
        runtime: SimRuntime,
        *,
        context_length: int,
        request_timeout_s: float,
        admission_wait_s: float,
    ) -> None:
        self.world = world
        self.rt = runtime
        self.clock = world.clock
        topo = world.topology
        self.decode_ranks = topo.decode_ranks
        self.groups = topo.prefill_groups
        self.page_size = world.page_size
        self.context_length = context_length
        self.request_timeout_s = request_timeout_s
        self.admission_wait_s = admission_wait_s
        self._d_index = {r: i for i, r in enumerate(self.decode_ranks)}
        self._g_of = {r: gi for gi, g in enumerate(self.groups) for r in g}
        self.dfree = np.array([world.decode_pages] * len(self.decode_ranks), dtype=np.int64)
        self.gfree = np.array([world.prefill_pages] * len(self.groups), dtype=np.int64)
        self.pfree = {r: world.prefill_pages for g in self.groups for r in g}
        self.dok = np.ones(len(self.decode_ranks), dtype=bool)
        self.gok = np.ones(len(self.groups), dtype=bool)
        self._decode_arr = np.array(self.decode_ranks, dtype=np.int64)
        totals = {r: world.decode_pages for r in self.decode_ranks}
        totals.update({r: world.prefill_pages for g in self.groups for r in g})
        self.ledger = FastLedger(totals, self._free_changed)
        self.core: RouterCore[Routed] = RouterCore(
            RouterPorts(
                wire=self,
                client=self,
                timers=self,
                clock=self,
                capacity_changed=self._capacity_changed,
            ),
            self.ledger,
        )
        self.requests: dict[str, Routed] = self.core.requests
        self.answers: dict[str, Answer] = {}
        self.unhealthy: dict[int, str] = {}
        self.severed: set[int] = set()
        self.waiting: deque[Waiting] = deque()
        self._retry_armed = False
        self._turn = 0
        self.abort_from_router_ms: list[float] = []
        handlers = {
            Kind.SEVERED: self._on_severed_msg,
            Kind.RELEASED: self._on_released,
            Kind.TOKENS: self._on_tokens,
            Kind.DONE: self._on_done,
            Kind.ABORT: self._on_abort,
        }
        runtime.set_handlers(handlers, role="router")
        runtime.on_send_failure = lambda rank, exc: self._on_rank_lost(rank, f"unreachable: {exc}")

    # ------------------------------------------------------------------ books
    def _free_changed(self, rank: int, free: int) -> None:
        i = self._d_index.get(rank)
        if i is not None:
            self.dfree[i] = free
            return
        self.pfree[rank] = free
        gi = self._g_of[rank]
        self.gfree[gi] = min(self.pfree[r] for r in self.groups[gi])

    def _health_changed(self, rank: int) -> None:
        i = self._d_index.get(rank)
        if i is not None:
            self.dok[i] = rank not in self.unhealthy
        else:
            gi = self._g_of[rank]
            self.gok[gi] = not any(r in self.unhealthy for r in self.groups[gi])

    def _mark(self, rank: int, reason: str) -> None:
        self.unhealthy[rank] = reason
        self._health_changed(rank)

    # ------------------------------------------------------------------ admission
    def _pick(self, prompt_len: int, need_decode: int) -> tuple[int, list[int]] | None:
        need_prefill = pages_needed(prompt_len, 0, self.page_size)
        dmask = self.dok & (self.dfree >= need_decode)
        gmask = self.gok & (self.gfree >= need_prefill)
        n_dec = int(dmask.sum())
        if not n_dec or not gmask.any():
            return None
        turn = self._turn
        self._turn += 1
        dfree = np.where(dmask, self.dfree, -1)
        best = np.flatnonzero(dfree == dfree.max())
        ranks = self._decode_arr[best]
        owner = int(ranks[np.argmin((ranks + turn) % n_dec)])
        group = int(np.argmax(np.where(gmask, self.gfree, -1)))
        return owner, list(self.groups[group])

    def check_admission(self, rid: str, prompt_len: int, max_tokens: int) -> Answer | None:
        """I1, as Router.check_admission: None if it can fit, else the answer."""
        if not self.dok.any() or not self.gok.any():
            return Answer.UNAVAILABLE
        cap = self.world.decode_pages * self.page_size
        try:
            admit(rid, prompt_len, max_tokens, self.context_length, cap)
        except AdmissionRejected:
            return Answer.REJECTED
        if prompt_len > self.world.prefill_pages * self.page_size:
            return Answer.REJECTED
        return None

    def submit(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        now = self.clock.now
        refused = self.check_admission(rid, prompt_len, max_tokens)
        if refused is not None:
            self._answer(rid, refused)
            return
        w = Waiting(rid, prompt_len, max_tokens, now)
        if not self._place(w):
            w.timer = self.clock.after(self.admission_wait_s, self._give_up, w)
            self.waiting.append(w)

    def _give_up(self, w: Waiting) -> None:
        try:
            self.waiting.remove(w)
        except ValueError:
            return
        self._answer(w.rid, Answer.UNAVAILABLE)

    def _retry_waiting(self) -> None:
        self._retry_armed = False
        while self.waiting:
            w = self.waiting[0]
            if not self._place(w):
                return
            self.waiting.popleft()
            w.timer.cancel()

    def _capacity_changed(self) -> None:
        if self.waiting and not self._retry_armed:
            self._retry_armed = True
            self.clock.at(self.clock.now, self._retry_waiting)

    def _place(self, w: Waiting) -> bool:
        need = pages_needed(w.prompt_len, w.max_tokens, self.page_size)
        placement = self._pick(w.prompt_len, need)
        if placement is None:
            return False
        owner, writers = placement
        req = Request(w.rid, [], w.max_tokens)
        req.transition(S.ADMITTED)
        routed = Routed(req, owner, writers, w.submitted_at)
        self.requests[w.rid] = routed
        self.ledger.reserve(owner, w.rid, need)
        for r in writers:
            self.ledger.reserve(r, w.rid, pages_needed(w.prompt_len, 0, self.page_size))
        req.transition(S.PREFILLING)
        routed.deadline = self.clock.after(
            self.request_timeout_s,
            self.abort,
            w.rid,
            AbortSource.DEADLINE,
            f"no answer within {self.request_timeout_s:.1f} s",
        )
        inc = self.world.cards[owner].incarnation
        for r in writers:
            self.rt.send(
                r,
                m.PREFILL,
                rid=w.rid,
                tokens=b"",
                offset=0,
                total=w.prompt_len,
                owner=owner,
                owner_inc=inc,
            )
        self.rt.send(
            owner,
            m.ASSIGN,
            rid=w.rid,
            prompt_len=w.prompt_len,
            max_tokens=w.max_tokens,
            writers=writers,
            last_token=0,
        )
        return True

    # ------------------------------------------------------------------ the core's ports
    def now(self) -> float:
        return self.clock.now

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Any:
        return self.clock.after(delay_s, fn)

    def send_abort(
        self, rank: int, rid: str, owner: int, writers: list[int], source: AbortSource, reason: str
    ) -> None:
        self.rt.send(
            rank, m.ABORT, rid=rid, owner=owner, writers=writers, source=source, reason=reason
        )

    def tokens(self, routed: Routed, chunk: list[int]) -> None:
        pass  # the simulator counts tokens (the core's ``placed``), it keeps none

    def done(self, routed: Routed, outcome: Answer, error: str | None) -> None:
        self._answer(routed.rid, outcome)

    # ------------------------------------------------------------------ outcomes
    def _answer(self, rid: str, outcome: Answer) -> None:
        self.answers[rid] = outcome
        self.world.on_answer(rid, outcome)

    def client_abort(self, rid: str) -> None:
        """The client went away: a waiting request just stops waiting."""
        for w in self.waiting:
            if w.rid == rid:
                self.waiting.remove(w)
                w.timer.cancel()
                self._answer(rid, Answer.ABORTED)
                return
        self.abort(rid, AbortSource.CLIENT, "client went away")

    def abort(self, rid: str, source: AbortSource, reason: str) -> None:
        self.core.abort(rid, source, reason)

    # ------------------------------------------------------------------ messages
    def _on_severed_msg(self, msg: Any) -> None:
        rank = msg.peer_rank
        if msg.incarnation != self.world.cards[rank].incarnation or rank in self.severed:
            return
        self.severed.add(rank)
        self.unhealthy.pop(rank, None)
        self._on_rank_lost(rank, f"severed by rank {msg.src}")

    def _on_released(self, msg: Any) -> None:
        released_at = msg.released_ns / 1e9 if msg.released_ns else None
        ms = self.core.on_released(msg.src, msg.rid, released_at)
        if ms is not None:
            self.abort_from_router_ms.append(ms)

    def _on_tokens(self, msg: Any) -> None:
        self.core.on_tokens(msg.src, msg.rid, msg.offset, msg.tokens)

    def _on_done(self, msg: Any) -> None:
        self.core.on_done(msg.src, msg.rid, msg.outcome, msg.count, msg.error)

    def _on_abort(self, msg: Any) -> None:
        self.core.on_abort(msg.src, msg.rid, msg.source, msg.reason)

    # ------------------------------------------------------------------ lost ranks
    def _on_rank_lost(self, rank: int, reason: str) -> None:
        if rank in self.unhealthy:
            return
        self._mark(rank, reason)
        self.core.rank_lost(rank, reason)

    def silent(self, rank: int, since: float) -> None:
        """``rank`` stopped sending STATS at ``since``: unhealthy once the heartbeat times
        out (it is then not routed to; nothing is aborted), as Router.check_heartbeats."""
        self.clock.at(since + HEARTBEAT_TIMEOUT_S, self._heartbeat_lost, rank, since)

    def _heartbeat_lost(self, rank: int, since: float) -> None:
        if self.world.silent_since.get(rank) != since or rank in self.unhealthy:
            return
        self._mark(rank, f"no heartbeat for {HEARTBEAT_TIMEOUT_S:.1f} s")

    def heard_again(self, rank: int) -> None:
        """``rank`` sends STATS again (``STATS_INTERVAL_S`` after it resumed)."""
        self.clock.after(STATS_INTERVAL_S, self._heard, rank)

    def _heard(self, rank: int) -> None:
        reason = self.unhealthy.get(rank, "")
        if rank not in self.severed and reason.startswith("no heartbeat"):
            del self.unhealthy[rank]
            self._health_changed(rank)
            self._capacity_changed()
