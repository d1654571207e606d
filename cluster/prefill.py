"""The prefill rank: a writer of the abort protocol.

Computes a prompt's KV (its share of the heads, under tensor parallelism) into its own
pool pages, writes them one-sided into the pages the decode owner planned, then sends the
completion notice with ``notify`` (flush first, so the notice arrives only after every
byte is visible at the owner). What to do on each input in each state is the writer's
table (:mod:`kvferry.engine.protocol.writer`); this class turns messages, settled batches
and timers into the table's events and carries out the effects it lists.

Upholds:
- I2: a request id that reached a terminal state here is tombstoned; a late PREFILL or
  PLAN for it is ignored, so it never reaches transfer.
- I4, writer side: on ABORT it stops posting, then sends ABORT_ACK with ``notify`` (flush,
  then send), and holds its own source pages until that flush. A writer that never
  started, or already finished, acks at once; one still computing the prefill stops after
  the layer in progress (it polls between layers once a slice has passed).
- I6: a failure here aborts the request towards the owner and the router, with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.engine.allocator import OutOfPages, PageAllocator
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol import writer as core
from kvferry.engine.protocol.ports import Clock
from kvferry.engine.protocol.words import AbortSource, Kind
from kvferry.engine.protocol.writer import WriterBook, WriterDo, WriterEvent, WriterState
from kvferry.engine.protocol.writer_driver import WriterDriver, WriterPorts
from kvferry.transfer import Segment
from kvferry.transfer.wire import Message

from .batching import BatchSizer
from .books import RankBooks
from .chunks import PAGES_PER_CHUNK, Reassembly
from .clock import MonotonicClock
from .ports import RankWriterWire, RouterReport, SharedSource
from .prefill_path import COMPUTING, PREFILL_SLICE_S, PrefillPath, Route, WritePath
from .runtime import RankRuntime

log = logging.getLogger("kvferry.cluster")

WRITER_RECEIVES = frozenset({Kind.PREFILL, Kind.PLAN, Kind.ABORT})


@dataclass
class WriteJob:
    """One request at this writer: its protocol book and what the data path needs."""

    rid: str
    book: WriterBook = field(init=False)
    share: str = ""  # the id its source pages are held (and its prefill run) under
    owner_inc: int = 0
    router_inc: int = 0  # the router incarnation that sent its PREFILL (0: not yet)
    planned_by: tuple[int, int] | None = None  # (rank, incarnation) of a PLAN before PREFILL
    tokens: np.ndarray | None = None  # int32 prompt tokens
    src_pages: list[int] = field(default_factory=list)
    dst_pages: np.ndarray | None = None  # the owner's plan: int64 page ids
    dst_generations: np.ndarray | None = None
    checksums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # int64
    runs: np.ndarray | None = None  # reshaped: its runs into owner pages 0, 1, ... (planned once)
    posted_bytes: int = 0
    sent_pages: int = 0  # prompt pages written (all, unless a fault)
    final_pages: int = 0  # source pages whose KV is final (every layer written)
    posted_pages: int = 0  # pages posted so far (the pipelined parts, then the rest)
    part: tuple[int, int] | None = None  # pages [lo, hi) of the part in flight
    timer: Any = None  # an injected pause at a protocol point
    writes_due: bool = False  # POST_WRITES asked, its rows not queued yet (a pause held them)
    queue: np.ndarray | None = None  # (local, remote, length) rows not yet posted
    prompt_parts: Reassembly | None = None  # PREFILL chunks so far
    plan_parts: Reassembly | None = None  # PLAN chunks so far
    prefill_started: float = 0.0
    prefill_ms: float | None = None
    first_token: int | None = None  # the answer's first, computed by the prefill
    abort_source: AbortSource = AbortSource.INTERNAL  # TELL_ABORT's words
    abort_reason: str = ""

    def __post_init__(self) -> None:
        self.book = WriterBook(self.rid)

    @property
    def state(self) -> WriterState:
        return self.book.state

    @property
    def owner(self) -> int:
        return self.book.owner

    def queued(self) -> bool:
        return self.queue is not None and len(self.queue) > 0


class PrefillRank(RankBooks):
    """Messages and settled work in, the writer's events out: the table's effects are
    the writer driver's (:mod:`kvferry.engine.protocol.writer_driver`), carried out
    through this rank's ports and its data path (:mod:`.prefill_path`)."""

    def __init__(
        self,
        runtime: RankRuntime,
        path: WritePath,
        pool: Any,
        *,
        router: int,
        clock: Clock,
    ) -> None:
        self.rt = runtime
        self.path = path
        self.clock = clock
        self.router = router
        self.pool = pool  # its page count and capacity (the path owns its data)
        self.allocator = PageAllocator(pool.num_pages)
        self.source = SharedSource(self.allocator)
        self.jobs: dict[str, WriteJob] = {}
        self._init_books()
        ports = WriterPorts(
            data=path,
            wire=RankWriterWire(runtime, router),
            source=self.source,
            report=RouterReport(runtime, router),
            tombstones=self,
            clock=clock,
        )
        self.driver = WriterDriver(
            ports, core.WRITER_TABLE, observe=self._observe, settled=self._settled
        )
        path.bind(self.driver)
        self.handlers = {
            Kind.PREFILL: self._on_prefill,
            Kind.PLAN: self._on_plan,
            Kind.ABORT: self._on_abort,
        }
        assert set(self.handlers) == WRITER_RECEIVES
        runtime.set_handlers(self.handlers, role="prefill")
        runtime.on_request_error = self.fail_request
        runtime.on_card_replaced = self._on_card_replaced

    @classmethod
    def serving(
        cls,
        runtime: RankRuntime,
        model,
        pool: KVPool,
        segment: Segment | None,
        head_range: tuple[int, int],
        router: int,
        unsafe: bool = False,
        max_batch_bytes: int = 256 << 20,
        integrity: bool = True,
        prefill_slice_s: float = PREFILL_SLICE_S,
        batch_target_s: float = 0.5,
        clock: Clock | None = None,
        routes: Callable[[int], Route] | None = None,
    ) -> PrefillRank:
        """The service's prefill rank: ``model`` computes heads ``head_range`` of a
        prompt's KV into ``pool``, written into owners' pools through ``runtime``;
        ``routes`` says which of them go to an owner rank, and into a pool of which heads
        (default: all of them, into a pool of every head)."""
        clock = clock or MonotonicClock()
        path = PrefillPath(
            runtime,
            model,
            pool,
            segment,
            head_range,
            clock=clock,
            integrity=integrity and not unsafe,
            prefill_slice_s=prefill_slice_s,
            batches=BatchSizer(target_s=batch_target_s, max_bytes=max_batch_bytes),
            routes=routes,
        )
        return cls(runtime, path, pool, router=router, clock=clock)

    # -------------------------------------------------------------- the table
    def _feed(self, job: WriteJob, event: WriterEvent) -> None:
        """Move the job by the writer's table and carry out the effects it lists."""
        self.driver.feed(job, event)

    def _fail(self, job: WriteJob, source: AbortSource, reason: str) -> None:
        self.driver.fail(job, source, reason)

    def _observe(self, job: WriteJob, event: WriterEvent, before: WriterState, move) -> None:
        if move.ignored and event in (WriterEvent.FAIL, WriterEvent.FAIL_IDLE):
            log.error(
                "request %s: %s (the writer had already reached %s; nothing more to undo)",
                job.rid,
                job.abort_reason,
                before.value,
            )
        elif not move.ignored and WriterDo.TELL_ABORT in move.effects:
            log.error(
                "request %s: prefill rank %d failed: %s", job.rid, self.rt.rank, job.abort_reason
            )

    def _settled(self, job: WriteJob, move) -> None:
        if move.ignored or job.state not in (WriterState.DONE, WriterState.ABORTED):
            return
        try:
            if job.state is WriterState.DONE:
                self.path.finished(job)  # a fault hook, which may raise
        finally:  # the job is forgotten whatever the hook did
            self.jobs.pop(job.rid, None)
            self.rt.faults.forget(job.rid)

    # -------------------------------------------------------------- messages
    def _job(self, rid: str) -> WriteJob | None:
        if rid in self.tombstones:
            return None
        job = self.jobs.get(rid)
        if job is None:
            job = self.jobs[rid] = WriteJob(rid)
        return job

    def _on_prefill(self, msg: Message) -> None:
        job = self._job(msg.rid)
        if job is None or job.tokens is not None:
            return
        if job.prompt_parts is None:  # the prompt's first chunk
            mismatch = self._planned_by_another(job, msg)
            job.book.owner, job.owner_inc = msg.owner, msg.owner_inc
            if mismatch:
                self._fail(job, AbortSource.PREFILL, mismatch)
                return
            job.router_inc = msg.inc
            job.share = msg.share or msg.rid
        if not self.path.take_prompt(job, msg):
            return
        assert job.tokens is not None
        try:
            pages, allocated = self.source.hold(
                job.rid, job.share, self.path.pages_for(len(job.tokens))
            )
        except OutOfPages as exc:
            self._fail(job, AbortSource.PREFILL, f"prefill pool out of pages: {exc}")
            return
        except ValueError as exc:
            self._fail(job, AbortSource.PREFILL, str(exc))
            return
        self.allocations += allocated
        job.src_pages = pages
        self._feed(job, WriterEvent.PROMPT)

    @staticmethod
    def _planned_by_another(job: WriteJob, prefill: Message) -> str | None:
        """Why a PLAN that came before the PREFILL is not the owner's the router names
        (writing that plan's pages into the named owner's pool would land in pages nobody
        planned for this request there), or None."""
        if job.planned_by in (None, (prefill.owner, prefill.owner_inc)):
            return None
        assert job.planned_by is not None
        rank, inc = job.planned_by
        return (
            f"its PLAN came from rank {rank} (incarnation {inc:#x}), but the router names "
            f"rank {prefill.owner} (incarnation {prefill.owner_inc:#x}) its owner"
        )

    def _on_plan(self, msg: Message) -> None:
        job = self._job(msg.rid)
        if job is None or job.dst_pages is not None:
            return
        if job.owner < 0:
            job.book.owner = msg.src
            job.planned_by = (msg.src, msg.inc)
        elif job.owner != msg.src or (job.owner_inc and msg.inc != job.owner_inc):
            log.warning(
                "request %s: PLAN from rank %d (incarnation %#x), but its owner is rank %d "
                "(incarnation %#x); ignored",
                msg.rid,
                msg.src,
                msg.inc,
                job.owner,
                job.owner_inc,
            )
            return
        if job.plan_parts is None:
            job.plan_parts = Reassembly(job.rid, "PLAN", msg.total, PAGES_PER_CHUNK, width=2)
        if not job.plan_parts.add(msg.offset, msg.total, msg.pages, msg.generations):
            return
        (job.dst_pages, job.dst_generations), job.plan_parts = job.plan_parts.joined(), None
        self._feed(job, WriterEvent.PLAN)

    def _on_abort(self, msg: Message) -> None:
        job = self.jobs.get(msg.rid)
        if job is None:
            # Never started, or already ended here (then it is tombstoned): a book of its
            # own, so the table says what to do (ack; say no pages are held, once).
            job = WriteJob(msg.rid)
            if msg.rid in self.tombstones:
                job.book.state = WriterState.ABORTED
            else:
                self.jobs[msg.rid] = job
        if job.owner < 0:
            job.book.owner = msg.owner
        log.debug(
            "request %s: writer rank %d told to abort (%s: %s)",
            job.rid,
            self.rt.rank,
            msg.source,
            msg.reason,
        )
        self._feed(job, core.on_abort(job.book))

    def router_incarnations(self) -> dict[str, int]:
        return {rid: job.router_inc for rid, job in self.jobs.items()}

    # -------------------------------------------------------------- failures
    def _on_card_replaced(self, old, new) -> None:
        """An owner came back with a new incarnation: the requests whose pages its old one
        allocated fail here (nothing more is posted; the source pages are freed once what
        is in flight has settled), since those pages are gone with it."""
        if old.rank == self.router:  # its requests have no client any more: end them now
            for job in list(self.jobs.values()):
                if job.router_inc == old.incarnation:
                    self._fail(
                        job,
                        AbortSource.PEER,
                        f"router rank {old.rank} restarted (incarnation {old.incarnation:#x}"
                        f" -> {new.incarnation:#x})",
                    )
            return
        for job in list(self.jobs.values()):
            if job.owner == old.rank and job.owner_inc == old.incarnation:
                self._fail(
                    job,
                    AbortSource.PEER,
                    f"owner rank {old.rank} restarted (incarnation {old.incarnation:#x} -> "
                    f"{new.incarnation:#x})",
                )

    def fail_request(self, rid: str, reason: str) -> None:
        """An exception while handling ``rid`` here (see RankRuntime._request_failed): the
        request fails as if its prefill had failed: the owner and the router are told,
        nothing more is posted, and the ack follows what is in flight. The jobs of the
        other members of its decode group that still wait for the prefill they share with
        it fail too (their answer is the group's, and it runs no more)."""
        job = self.jobs.get(rid)
        share = job.share if job is not None else rid  # a shared prefill fails by its share
        sharing = [
            j
            for j in self.jobs.values()
            if j is not job and j.share == share and j.state in COMPUTING
        ]
        if job is None and not sharing:
            log.error(
                "request %s: failed on prefill rank %d after it ended here: %s",
                rid,
                self.rt.rank,
                reason,
            )
            return
        if job is not None:
            self._fail(job, AbortSource.INTERNAL, reason)
        for other in sharing:
            self._fail(
                other, AbortSource.INTERNAL, f"the prefill it shares with {rid} failed: {reason}"
            )

    # -------------------------------------------------------------- housekeeping
    def in_flight(self) -> bool:
        """Some request is between its PREFILL/PLAN and its end here."""
        return bool(self.jobs)
