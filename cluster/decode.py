"""The decode rank: the owner of the abort protocol.

Allocates a request's pages, tells every writer where to write, and treats the pages as
the request's own only after a completion notice from every writer (each sent after that
writer's flush). Then it verifies and decodes.

Upholds:
- I2: terminal request ids are tombstoned; a late ASSIGN or NOTICE never reaches decode.
- I4, owner side: at an abort the pages of a request whose writers have not all finished
  are quarantined, not freed. They are released when every writer in the request's writer
  set has acked (or noticed: a notice also follows a flush). At the abort deadline every
  writer that did not ack is severed (no more plans, its endpoint closed, the router told),
  but the pages are released only once each severed writer either acks after all or its
  process is gone: severing alone is not proof (see :meth:`RankRuntime.sever`).
  Quarantined pages count as used (the router's ledger keeps them reserved until RELEASED).
- I5: before decoding, the transferred length of every writer equals the prompt length,
  the pages and generations each writer names are this request's, the canary table agrees,
  and each writer's checksums match the bytes that landed. Any mismatch fails the request;
  it never produces tokens. With integrity checks on, every decode step checks again that
  each page it is about to read still carries the request's canary (id, generation,
  index), so an allocator or page-table bug is caught at the read, not only on arrival.
- I6: every failure is counted, logged with the request id and reported to the router.

What to do on each input in each state is the owner's table
(:mod:`kvferry.engine.protocol.owner`); this class turns messages, timers and the results
of its checks into the table's events and carries out the effects it lists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvferry.engine.admission import pages_needed
from kvferry.engine.allocator import OutOfPages, PageAllocator, PageGrant
from kvferry.engine.integrity import (
    request_id_hash,
)
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol import owner as core
from kvferry.engine.protocol.driver import Clock
from kvferry.engine.protocol.owner import OwnerBook, OwnerEvent, OwnerState
from kvferry.engine.protocol.owner_driver import (
    ABORT_EVENTS,
    HELD,
    OwnerDriver,
    OwnerPorts,
    OwnerTimes,
)
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import AbortSource, Kind, Outcome, Release
from kvferry.transfer.wire import Message

from . import messages as m
from .books import RankBooks
from .chunks import PAGES_PER_CHUNK, Reassembly
from .clock import MonotonicClock
from .decode_path import DecodePath, ReadPath, StepPlan
from .group_decode import AttendJob, Group, GroupDecode, GroupStep
from .ports import RankOwnerWire
from .runtime import RankRuntime
from .topology import HeadSplit

log = logging.getLogger("kvferry.cluster")

OWNER_RECEIVES = frozenset({Kind.ASSIGN, Kind.NOTICE, Kind.NOTICE_PART, Kind.ABORT, Kind.ABORT_ACK})
GROUP_RECEIVES = frozenset({Kind.MEMBER_READY, Kind.ATTEND, Kind.ATTENDED, Kind.STEPPED})


@dataclass(frozen=True)
class Notice:
    """One writer's whole completion notice, rebuilt from its chunks."""

    tokens: int
    pages: np.ndarray  # int64, as the wire decodes them
    generations: np.ndarray
    checksums: np.ndarray  # empty: integrity checks off
    bytes: int
    prefill_ms: float | None
    first_token: int | None = None  # the answer's first, from the writer's prefill


@dataclass(frozen=True)
class NoticePart:
    """A writer's NOTICE_PART: pages ``[offset, offset + len(pages))`` of its notice, landed
    (the part's flush), to be checked before the rest arrives."""

    writer: int
    offset: int
    pages: np.ndarray  # int64, as the wire decodes them
    generations: np.ndarray
    checksums: np.ndarray


@dataclass
class OwnedRequest:
    """One request at its owner: its protocol book and what the data path needs."""

    rid: str
    prompt_len: int
    max_tokens: int
    writers: list[int]
    last_token: int
    grants: list[PageGrant] = field(default_factory=list)
    book: OwnerBook = field(init=False)
    notice_parts: dict[int, Reassembly] = field(default_factory=dict)
    notices: dict[int, Notice] = field(default_factory=dict)  # whole notices
    parts: list[NoticePart] = field(default_factory=list)  # arrived, not checked yet
    # writer -> (which pages of its notice a part checked, the checksums they had)
    part_checked: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    checking_parts: bool = False  # the parts' checks are running (in slices)
    # which of the prompt's pages were turned into the pool's order (writers of another)
    turned: np.ndarray | None = None
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    planned_at: float = 0.0  # when its plan went out (the rank's clock)
    timer: Any = None
    abort_started: float = 0.0
    abort_source: AbortSource = AbortSource.INTERNAL  # ASK_ACKS's words
    abort_reason: str = ""
    error: str = ""  # REPORT_FAILED's words
    transfer_ms: float | None = None
    prefill_ms: float | None = None  # the slowest writer's prefill compute
    first_token: int | None = None  # the writers' (None: the first step reads it)
    noticed_at: float = 0.0  # every notice whole: the last byte landed (the rank's clock)
    warned: bool = False
    # each writer's incarnation when the request was assigned: a notice or an ack from
    # another incarnation of that rank (restarted since) proves nothing for this request
    writer_incs: dict[int, int] = field(default_factory=dict)
    router_inc: int = 0  # the router incarnation that assigned it (0: not known)
    # its decode group, where the group splits the heads of a model mixing them (the lead
    # steps it: .group_decode); None: this rank decodes it alone
    group: Group | None = None

    def __post_init__(self) -> None:
        self.book = OwnerBook(self.rid, tuple(self.writers))

    @property
    def state(self) -> OwnerState:
        return self.book.state

    @property
    def pages(self) -> list[int]:
        return [g.page for g in self.grants]

    @functools.cached_property
    def planned_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Its pages and their generations (int64), in page-table order, built once (a
        million-token prompt's plan is 65,000 pages: the checks of each part and of the
        notice read these, as arrays, never a list each)."""
        pages = np.fromiter((g.page for g in self.grants), np.int64, len(self.grants))
        gens = np.fromiter((g.generation for g in self.grants), np.int64, len(self.grants))
        return pages, gens

    @property
    def next_position(self) -> int:
        """Where its next decode step writes the input token's K/V (the last prompt
        position, then one further for each token it generated)."""
        return self.prompt_len - 1 + len(self.generated)

    @functools.cached_property
    def page_row(self) -> np.ndarray:
        """The request's page table row (int32), built once."""
        return np.asarray(self.planned_rows[0], dtype=np.int32)

    @functools.cached_property
    def generation_row(self) -> torch.Tensor:
        """The generation of each of its pages, in page-table order (int64), built once."""
        return torch.from_numpy(self.planned_rows[1].copy())

    @functools.cached_property
    def rid_hash(self) -> int:
        return request_id_hash(self.rid)


QUARANTINE_LOGGED_AFTER_S = 0.05  # a quarantine still waiting then is logged (see quarantine)
QUARANTINES_SHOWN = 64  # quarantined requests a STATS lists by name (/status)


class DecodeRank(RankBooks):
    """Messages in, the owner's events out: the table's effects are the owner driver's
    (:mod:`kvferry.engine.protocol.owner_driver`), carried out through this rank's ports
    (its pages, what it knows of writers, its report to the router) and its data path
    (:mod:`.decode_path`: I5 on arrival and the decode steps, which return verdicts and
    tokens as events)."""

    def __init__(
        self,
        runtime: RankRuntime,
        path: ReadPath,
        pool: Any,
        router: int,
        *,
        transfer_timeout_s: float,
        abort_deadline_s: float,
        unsafe: bool = False,
        release_on_sever: bool = False,
        max_batch: int = 64,
        clock: Clock | None = None,
        allocator: PageAllocator | None = None,
    ) -> None:
        self.rt = runtime
        self.path = path
        self.clock = clock or MonotonicClock()
        # told of every release (rank's request, pages, how, ms since the abort): a report
        # port (the simulator's world counts them)
        self.on_release: Callable[[OwnedRequest, int, Release, float | None], None] = (
            lambda req, pages, how, abort_ms: None
        )
        # told of a request fenced long past its deadline with no proof yet (after the log)
        self.on_stuck: Callable[[OwnedRequest, float], None] = lambda req, waited_s: None
        self.pool = pool  # its page count and geometry (the path owns its data)
        self.router = router
        self.transfer_timeout_s = transfer_timeout_s
        self.abort_deadline_s = abort_deadline_s
        self.unsafe = unsafe
        self.max_batch = max_batch
        self.release_on_sever = release_on_sever
        self.allocator = allocator or PageAllocator(pool.num_pages, unsafe=unsafe)
        self.reqs: dict[str, OwnedRequest] = {}
        self._init_books()
        self._init_driver(core.owner_table(unsafe=unsafe, release_on_sever=release_on_sever))
        path.bind(self.driver)
        self.handlers = {
            Kind.ASSIGN: self._on_assign,
            Kind.NOTICE: self._on_notice,
            Kind.NOTICE_PART: self._on_notice_part,
            Kind.ABORT: self._on_abort,
            Kind.ABORT_ACK: self._on_ack,
            **{kind: self._on_group_message for kind in GROUP_RECEIVES},
        }
        assert set(self.handlers) == OWNER_RECEIVES | GROUP_RECEIVES
        # set by serving() where this rank is a member of a decode group that splits the
        # heads of a model mixing them
        self.group_decode: GroupDecode | None = None
        runtime.set_handlers(self.handlers, role="decode")
        runtime.on_request_error = self.fail_request
        runtime.on_card_replaced = self._on_card_replaced
        self.dropped_other_incarnation = 0
        self.duplicate_assigns = 0  # a live request assigned again (a router bug)

    @classmethod
    def serving(
        cls,
        runtime: RankRuntime,
        model,
        pool: KVPool,
        router: int,
        *,
        integrity: bool = True,
        clock: Clock | None = None,
        prefill_tp: int | None = None,
        decode_member: tuple[HeadSplit, int] | None = None,
        **options: Any,
    ) -> DecodeRank:
        """The service's decode rank: ``model`` decodes over ``pool``, whose pages the
        rank's writers (writing members of prefill groups of ``prefill_tp``) fill and whose
        canaries and checksums it checks (I5, unless ``integrity`` is off);
        ``decode_member`` is (the cluster's head split, this rank's position in its decode
        group): what it holds and who writes it; ``options`` are the rank's own
        (deadlines, the broken modes, the batch)."""
        clock = clock or MonotonicClock()
        unsafe = bool(options.get("unsafe", False))
        reply_s = float(options.pop("group_reply_s", options.get("abort_deadline_s", 5.0)))
        path = DecodePath(
            runtime,
            model,
            pool,
            router,
            clock=clock,
            integrity=integrity,
            unsafe=unsafe,
            prefill_tp=prefill_tp,
            member=decode_member,
        )
        rank = cls(runtime, path, pool, router, clock=clock, **options)
        if decode_member is not None:
            split, position = decode_member
            if split.decode_tp > 1 and not split.replicated and model.attention_mixes_heads:
                rank.group_decode = GroupDecode(rank, split, position, reply_s)
        return rank

    # -------------------------------------------------------------- the table
    def _init_driver(self, table: dict) -> None:
        """The owner's table, carried out by the owner's driver over this rank's ports
        (an event an effect produces, a failed check or a proof found, waits for the
        rest of its row: no re-entrant feed)."""
        ports = OwnerPorts(
            wire=RankOwnerWire(self.rt, self.router),
            pages=self,
            facts=self,
            data=self.path,
            report=self,
            tombstones=self,
            timers=self.rt,
            clock=self.clock,
            times=OwnerTimes(self.transfer_timeout_s, self.abort_deadline_s),
        )
        self.driver = OwnerDriver(ports, table, observe=self._observe)

    def _feed(self, req: OwnedRequest, event: OwnerEvent) -> None:
        """Move the request by the owner's table and carry out the effects it lists."""
        self.driver.feed(req, event)

    def _observe(self, req: OwnedRequest, event: OwnerEvent, before: OwnerState, move) -> None:
        """The abort's clock starts at its first sign (its pages' release is timed on
        it)."""
        if event in ABORT_EVENTS and before not in HELD:
            req.abort_started = req.abort_started or self.path.event_time()
        if (
            self.group_decode is not None
            and req.state is OwnerState.DECODING
            and before is not OwnerState.DECODING
        ):
            self.group_decode.decoding(req)
        self.path.moved(req, before)

    def _abort(
        self, req: OwnedRequest, event: OwnerEvent, source: AbortSource, reason: str
    ) -> None:
        self.driver.abort(req, event, source, reason)

    def transfer_timeout_for(self, prompt_len: int) -> float:
        return self.driver.ports.times.transfer_timeout_for(prompt_len)

    # -------------------------------------------------------------- pages (a port)
    def stamp_canaries(self, req: OwnedRequest) -> None:
        self.path.stamp(req)

    def free(self, rid: str) -> list[int]:
        return self.allocator.free(rid)

    def quarantine(self, req: OwnedRequest) -> None:
        """Quarantine ``req``'s pages. The log line waits ``QUARANTINE_LOGGED_AFTER_S``: most
        quarantines end within a millisecond, on their writers' acks, and their release
        line says how long after the abort and on what proof; an abort storm then costs
        one line per request, written after the release rather than on its way."""
        self.allocator.quarantine(req.rid)
        self.rt.call_later(
            QUARANTINE_LOGGED_AFTER_S, functools.partial(self._log_quarantine, req), rid=req.rid
        )

    def _log_quarantine(self, req: OwnedRequest) -> None:
        if self.reqs.get(req.rid) is not req or not self.quarantined(req.rid):
            return
        log.info(
            "request %s: %d pages quarantined on rank %d (aborted: %s) until writers %s "
            "ack after their flush or are proven gone",
            req.rid,
            len(req.grants),
            self.rt.rank,
            req.abort_reason,
            sorted(req.book.pending()),
        )

    def release(self, rid: str) -> list[int]:
        return self.allocator.release(rid)

    def quarantined(self, rid: str) -> bool:
        return bool(self.allocator.quarantined_pages_of(rid))

    # -------------------------------------------------------------- messages
    def _on_assign(self, msg: Message) -> None:
        rid = msg.rid
        if rid in self.tombstones:  # a late copy of an ended request's ASSIGN (I2)
            log.debug("request %s: ASSIGN after it ended dropped", rid)
            return
        first = self.reqs.get(rid)
        if first is not None:  # the router assigned a live request twice: its bug
            self.duplicate_assigns += 1
            log.error(
                "request %s: second ASSIGN dropped on decode rank %d, the first stands "
                "(first: prompt_len %d, max_tokens %d, writers %s; second: prompt_len %d, "
                "max_tokens %d, writers %s)",
                rid,
                self.rt.rank,
                first.prompt_len,
                first.max_tokens,
                first.writers,
                msg.prompt_len,
                msg.max_tokens,
                list(msg.writers),
            )
            return
        req = OwnedRequest(rid, msg.prompt_len, msg.max_tokens, list(msg.writers), msg.last_token)
        req.writer_incs = {
            w: self.rt.cards[w].incarnation for w in req.writers if w in self.rt.cards
        }
        req.router_inc = msg.inc
        mismatch = self.path.writers_mismatch(req)
        if mismatch is None and self.group_decode is not None:
            mismatch = self.group_decode.join(req, msg)
        if mismatch is not None:  # refused before any page is allocated
            req.error = f"request {rid} refused by decode rank {self.rt.rank}: {mismatch}"
            self._feed(req, core.on_assign(req.book, req.book.writers, granted=False))
            return
        need = pages_needed(msg.prompt_len, msg.max_tokens, self.pool.page_size)
        try:
            req.grants = self.allocator.allocate(rid, need)
        except OutOfPages as exc:
            req.error = f"decode pool of rank {self.rt.rank} out of pages: {exc}"
            self._feed(req, core.on_assign(req.book, req.book.writers, granted=False))
            return
        self.allocations += 1
        req.planned_at = self.clock.now()
        self.reqs[rid] = req
        self._feed(req, core.on_assign(req.book, req.book.writers, granted=True))

    def _on_notice(self, msg: Message) -> None:
        req = self.reqs.get(msg.rid)
        if req is None:
            return
        if msg.src not in req.writers:
            log.warning(
                "request %s: notice from rank %d, which is not one of its writers %s",
                req.rid,
                msg.src,
                req.writers,
            )
            return
        if not self._same_incarnation(req, msg, "notice"):
            return
        whole = False
        if req.state is OwnerState.AWAITING and msg.src not in req.notices:
            parts = req.notice_parts.get(msg.src)
            if parts is None:
                parts = req.notice_parts[msg.src] = Reassembly(
                    req.rid,
                    f"NOTICE of rank {msg.src}",
                    msg.total,
                    PAGES_PER_CHUNK,
                    width=3,
                    optional=frozenset({2}),
                )
            if parts.add(msg.offset, msg.total, msg.pages, msg.generations, msg.checksums):
                pages, generations, checksums = parts.joined()
                del req.notice_parts[msg.src]
                req.notices[msg.src] = Notice(
                    msg.tokens,
                    pages,
                    generations,
                    checksums,
                    msg.bytes,
                    msg.prefill_ms,
                    msg.first_token,
                )
                whole = True
        self._feed(req, core.on_notice(req.book, msg.src, whole))

    def _on_notice_part(self, msg: Message) -> None:
        """A part of a writer's pages landed (pipelined): checked now, while the writer
        computes and writes the rest. Once the request left AWAITING it is of no use."""
        req = self.reqs.get(msg.rid)
        if req is None or msg.src not in req.writers:
            return
        if not self._same_incarnation(req, msg, "notice part"):
            return
        if req.state is OwnerState.AWAITING:
            req.parts.append(
                NoticePart(msg.src, msg.offset, msg.pages, msg.generations, msg.checksums)
            )
        self._feed(req, core.on_part(req.book, msg.src))

    # -------------------------------------------------------------- decoding
    def step(self) -> bool:
        """One decode step for up to ``max_batch`` decoding requests, here and now; False
        if none. An exception in the step fails the requests of its batch (their writers
        have all noticed, so their pages are freed) and the rank goes on."""
        batch = self._batch()
        if not batch:
            return False
        try:
            self.path.step(batch)
        except Exception as exc:
            self.fail_step(batch, exc)
        return True

    def begin_step(self) -> StepPlan | GroupStep | AttendJob | None:
        """The next step's plan, for :meth:`~.decode_path.ReadPath.run_step` to run
        anywhere (see :mod:`.stepping`), or None when nothing decodes. Its requests are
        pinned in the driver until :meth:`end_step`: an ABORT or a timer meanwhile waits
        for the step, since the step reads their pages and writes the new token's KV into
        them (freed under it, a page could be another request's by then). In a decode
        group that splits the heads (:mod:`.group_decode`): a member's share of its lead's
        layer, or the lead's step going on once its members answered (its requests stay
        pinned between layers)."""
        group = self.group_decode
        if group is not None:
            work = group.next_work()
            if work is not None:
                return work
            if group.waiting():
                return None
        batch = self._batch()
        if not batch:
            return None
        try:
            plan = self.path.plan_step(batch)
        except Exception as exc:
            self.fail_step(batch, exc)
            return None
        if plan is not None:
            for r in plan.batch:
                self.driver.pin(r)
            if group is not None:
                return group.start(plan)
        return plan

    def run_step(self, plan: StepPlan | GroupStep | AttendJob) -> Any:
        """The step's compute (any thread: see :mod:`.stepping`)."""
        if isinstance(plan, (GroupStep, AttendJob)):
            assert self.group_decode is not None
            return self.group_decode.run(plan)
        return self.path.run_step(plan)

    def end_step(
        self, plan: StepPlan | GroupStep | AttendJob, out: Any, error: BaseException | None
    ) -> None:
        """The step of ``plan`` ran (``out``, or it raised ``error``): what its requests
        received meanwhile is carried out first (an aborted one gets no token), then the
        step's results."""
        if isinstance(plan, (GroupStep, AttendJob)):
            assert self.group_decode is not None
            self.group_decode.end(plan, out, error)
            return
        for r in plan.batch:
            self.driver.unpin(r)
        if error is not None:
            self.fail_step(plan.batch, error)
            return
        try:
            self.path.apply_step(plan, out)
        except Exception as exc:
            self.fail_step(plan.batch, exc)

    def _batch(self) -> list[OwnedRequest]:
        decoding = [r for r in self.reqs.values() if r.state is OwnerState.DECODING]
        if self.group_decode is not None:  # its lead steps a group's requests
            return self.group_decode.batch(decoding, self.max_batch)
        return decoding[: self.max_batch]

    def _on_group_message(self, msg: Message) -> None:
        """A decode group's step message (:mod:`.group_decode`); dropped, with a log
        line, by a rank whose group does not split the heads of a model mixing them."""
        if self.group_decode is None:
            log.warning(
                "%s from rank %d dropped: rank %d decodes no group that splits the heads",
                msg.kind,
                msg.src,
                self.rt.rank,
            )
            return
        self.group_decode.handlers[Kind(msg.kind)](msg)

    def fail_step(self, batch: list[OwnedRequest], exc: BaseException) -> None:
        reason = f"decode step on rank {self.rt.rank} failed: {type(exc).__name__}: {exc}"
        log.error("requests %s: %s", [r.rid for r in batch], reason, exc_info=exc)
        for r in batch:
            if r.state is OwnerState.DECODING:
                self.rt.run_for(
                    r.rid,
                    "failing a decode step",
                    functools.partial(self.fail_request, r.rid, reason),
                )

    # -------------------------------------------------------------- abort
    def _on_abort(self, msg: Message) -> None:
        req = self.reqs.get(msg.rid)
        if req is None:
            if msg.rid in self.tombstones:
                return
            # No ASSIGN yet (or never): the router still counts the pages it reserved
            # here; none are held, and a late ASSIGN is ignored.
            req = OwnedRequest(msg.rid, 0, 0, [], 0)
        # The router sends its ABORT to every writer as well as to us: asking them again
        # now would only double the messages on the abort's critical path.
        self._abort(
            req,
            core.on_abort(req.book, writers_told=msg.src == self.router),
            msg.source,
            msg.reason,
        )

    def _on_ack(self, msg: Message) -> None:
        req = self.reqs.get(msg.rid)
        if req is None or msg.src not in req.writers:
            return
        if not self._same_incarnation(req, msg, "ack"):
            return
        # Before we heard of an abort, a writer's ack is the abort (see core.on_ack).
        self._abort(
            req,
            core.on_ack(req.book, msg.src, self.rt.is_severed(msg.src)),
            AbortSource.WRITER,
            f"writer rank {msg.src} acked an abort",
        )

    # -------------------------------------------------------------- writer facts (a port)
    def restarted_since(self, req: OwnedRequest, writer: int) -> bool:
        """``writer`` has a new incarnation since ``req`` was assigned to it."""
        card = self.rt.cards.get(writer)
        recorded = req.writer_incs.get(writer)
        return card is not None and recorded is not None and recorded != card.incarnation

    def _same_incarnation(self, req: OwnedRequest, msg: Message, what: str) -> bool:
        """The message comes from the incarnation of its writer the request was assigned
        to; one from a restarted writer is refused and counted (it wrote none of this
        request's pages, so its word proves nothing about them)."""
        expected = req.writer_incs.get(msg.src, msg.inc)
        if msg.inc == expected:
            return True
        self.dropped_other_incarnation += 1
        log.warning(
            "request %s: %s from rank %d refused: incarnation %#x, the request's writer was "
            "incarnation %#x",
            req.rid,
            what,
            msg.src,
            msg.inc,
            expected,
        )
        return False

    def _on_card_replaced(self, old, new) -> None:
        """A writer came back with a new incarnation: every request its old one was still
        writing fails (the old one is gone, its writes may be partial); their pages wait,
        as any abort's, for an ack (which the old one can no longer send) or the proof
        that the old process is gone (``write_path_closed`` for the old incarnation).

        The router came back: the requests its old incarnation assigned have no client
        any more (nobody reads their tokens); each ends now, through the protocol (a
        decoding one frees its pages at once, one still awaiting its writers goes the
        abort's way), instead of decoding to its end into failed sends."""
        if old.rank == self.router:
            self._end_requests_of_router(old, new)
            return
        for req in list(self.reqs.values()):
            if req.writer_incs.get(old.rank) != old.incarnation:
                continue
            if old.rank in req.book.noticed or old.rank in req.book.acked:
                continue  # its pages from that writer are all in
            reason = (
                f"writer rank {old.rank} restarted (incarnation {old.incarnation:#x} -> "
                f"{new.incarnation:#x}) before its notice"
            )
            req.error = req.error or f"peer: {reason}"
            self._abort(req, core.on_failure(req.book), AbortSource.PEER, reason)

    def stats(self) -> dict:
        """The books' pool figures, and the second ASSIGNs this rank dropped (STATS)."""
        return {**super().stats(), "duplicate_assigns": self.duplicate_assigns}

    def fenced_writers(self) -> list[str]:
        """``rank:incarnation`` (hex) of every writer incarnation whose ack or proof a
        quarantined request here still waits for: the router admits a restarted rank
        only once its old incarnation is on no decode rank's list (STATS)."""
        out = set()
        for req in self.reqs.values():
            if req.state in (OwnerState.QUARANTINED, OwnerState.FENCED):
                for w in req.book.pending():
                    out.add(f"{w}:{req.writer_incs.get(w, 0):x}")
        return sorted(out)

    def quarantines(self) -> list[str]:
        """``rid pages=N state=S waiting=[w:inc] proven=[w:proof]`` for every request
        whose pages are quarantined here (the first ``QUARANTINES_SHOWN``), for /status:
        which writer incarnations it waits on, and which proof each other writer gave."""
        out = []
        for req in self.reqs.values():
            if req.state not in (OwnerState.QUARANTINED, OwnerState.FENCED):
                continue
            book = req.book
            proven = [
                f"{w}:{Proof.NOTICED if w in book.noticed else Proof.ACKED}"
                for w in sorted(book.noticed | book.acked)
            ] + [f"{w}:{p}" for w, p in sorted(book.gone.items())]
            waiting = [f"{w}:{req.writer_incs.get(w, 0):x}" for w in book.pending()]
            out.append(
                f"{req.rid} pages={len(req.grants)} state={req.state.value} "
                f"waiting=[{','.join(waiting)}] proven=[{','.join(proven)}]"
            )
            if len(out) >= QUARANTINES_SHOWN:
                break
        return out

    def proven_gone(self, req: OwnedRequest, writers) -> dict[int, Proof]:
        """Those of ``writers`` whose incarnation on ``req`` can no longer write, with the
        proof of each (I4: see ``RankRuntime.write_path_closed``)."""
        proofs = {w: self.rt.write_path_closed(w, req.writer_incs.get(w)) for w in writers}
        return {w: proof for w, proof in proofs.items() if proof is not None}

    def is_severed(self, writer: int) -> bool:
        return self.rt.is_severed(writer)

    # -------------------------------------------------------------- the report (a port)
    def closed(self, req: OwnedRequest, pages: list[int], how: Release) -> None:
        if req.timer is not None:
            req.timer.cancel()
        self.reqs.pop(req.rid, None)
        now = self.clock.now()  # the router times aborts on this clock too (one host)
        released_ns = int(now * 1e9)
        self.tombstones[req.rid] = now
        why = req.book.justification()
        abort_ms = 1e3 * (now - req.abort_started) if req.abort_started else None
        # The router hears first: a log line costs more than the message, and the pages
        # are free for its next request from this moment.
        self.rt.send(
            self.router,
            m.RELEASED,
            rid=req.rid,
            pages=len(pages),
            how=how,
            justification=why,
            abort_ms=abort_ms,
            released_ns=released_ns,
        )
        if abort_ms is not None:
            log.info(
                "request %s: %d pages released (%s; proof: %s) %.1f ms after the abort (%s)",
                req.rid,
                len(pages),
                how.value,
                why,
                abort_ms,
                req.abort_reason or "writers finished",
            )
        else:
            log.info("request %s: %d pages freed (%s; proof: %s)", req.rid, len(pages), how, why)
        self.on_release(req, len(pages), how, abort_ms)

    def done(self, req: OwnedRequest, outcome: Outcome) -> None:
        finished = outcome is Outcome.FINISHED
        self.rt.send(
            self.router,
            m.DONE,
            rid=req.rid,
            outcome=outcome,
            error=None if finished else req.error,
            count=len(req.generated) if finished else None,
            transfer_ms=req.transfer_ms if finished else None,
            prefill_ms=req.prefill_ms if finished else None,
            landed_ns=int(req.noticed_at * 1e9) if finished and req.noticed_at else None,
        )

    def nothing_held(self, rid: str) -> None:
        self.rt.send(
            self.router,
            m.RELEASED,
            rid=rid,
            pages=0,
            how=Release.FREED,
            justification=Proof.NOTHING_POSTED,
        )

    def integrity_failure(self, req: OwnedRequest) -> None:
        self.integrity_failures += 1
        log.error(
            "request %s: integrity check failed on rank %d: %s", req.rid, self.rt.rank, req.error
        )

    def stuck(self, req: OwnedRequest, waited_s: float) -> None:
        log.error(
            "request %s: %d pages stay quarantined: severed writers %s neither "
            "acked nor are known to be gone after %.1f s",
            req.rid,
            len(req.grants),
            sorted(req.book.fenced - req.book.acked),
            waited_s,
        )
        self.on_stuck(req, waited_s)

    def router_incarnations(self) -> dict[str, int]:
        return {rid: req.router_inc for rid, req in self.reqs.items()}

    def _end_requests_of_router(self, old, new) -> None:
        reason = (
            f"router rank {old.rank} restarted (incarnation {old.incarnation:#x} -> "
            f"{new.incarnation:#x}): nobody waits for this request any more"
        )
        for req in list(self.reqs.values()):
            if req.router_inc == old.incarnation:
                log.warning("request %s: %s", req.rid, reason)
                req.error = req.error or f"peer: {reason}"
                self._abort(req, core.on_failure(req.book), AbortSource.PEER, reason)

    def fail_request(self, rid: str, reason: str) -> None:
        """An exception while handling ``rid`` here (see RankRuntime._request_failed): the
        router is told it failed, and its pages go the abort's way: freed once every
        writer noticed, else quarantined until every writer acked."""
        req = self.reqs.get(rid)
        if req is None:
            if rid in self.tombstones:
                return
            req = OwnedRequest(rid, 0, 0, [], 0)
        req.error = reason
        self._abort(req, core.on_failure(req.book), AbortSource.INTERNAL, reason)

    # -------------------------------------------------------------- housekeeping
    def in_flight(self) -> bool:
        """Some request awaits its writers' notices or acks."""
        return any(
            r.state
            in (
                OwnerState.AWAITING,
                OwnerState.VERIFYING,
                OwnerState.QUARANTINED,
                OwnerState.FENCED,
            )
            for r in self.reqs.values()
        )

    def awaiting_peers(self) -> bool:
        """A decode group's peer will message soon (a lead's step waits for its members'
        shares, a member's lead steps its requests): the loop polls rather than sleeps,
        a wake-up a layer being the group step's cost."""
        return self.group_decode is not None and self.group_decode.awaiting()

    def busy(self) -> bool:
        """A step to run now (in a split decode group: a member's share to compute, or
        the lead's step or batch while no step waits for its members)."""
        group = self.group_decode
        if group is not None:
            return group.busy() or (not group.waiting() and bool(self._batch()))
        return any(r.state is OwnerState.DECODING for r in self.reqs.values())
