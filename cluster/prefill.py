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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvferry.engine.allocator import OutOfPages, PageAllocator
from kvferry.engine.integrity import page_checksums
from kvferry.engine.pool import KVPool, coalesce_runs
from kvferry.engine.protocol import writer as core
from kvferry.engine.protocol.driver import Clock, Driver
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import AbortSource, Kind, Release
from kvferry.engine.protocol.writer import WriterBook, WriterDo, WriterEvent, WriterState
from kvferry.transfer import Batch, BatchStatus, Segment, TransferError
from kvferry.transfer.wire import Message

from . import messages as m
from .batching import BatchSizer
from .books import RankBooks
from .chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK, Reassembly, spans
from .clock import MonotonicClock
from .faults import Decision, PointDecision
from .runtime import RankRuntime
from .sliced import run_in_slices

log = logging.getLogger("kvferry.cluster")

PREFILL_SLICE_S = 0.001  # longest a prefill computes before the loop polls again
CHECKSUM_SLICE_BYTES = 32 << 20  # pages checksummed per step

_END = -1  # the prefill generator is exhausted
WRITER_RECEIVES = frozenset({Kind.PREFILL, Kind.PLAN, Kind.ABORT})
_COMPUTING = (WriterState.COMPUTING, WriterState.COMPUTING_PLANNED)


@dataclass
class WriteJob:
    """One request at this writer: its protocol book and what the data path needs."""

    rid: str
    book: WriterBook = field(init=False)
    owner_inc: int = 0
    router_inc: int = 0  # the router incarnation that sent its PREFILL (0: not yet)
    tokens: np.ndarray | None = None  # int32 prompt tokens
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] | None = None
    dst_generations: list[int] | None = None
    checksums: list[int] = field(default_factory=list)
    posted_bytes: int = 0
    sent_pages: int = 0  # prompt pages written (all, unless a fault)
    timer: Any = None  # an injected pause at a protocol point
    queue: np.ndarray | None = None  # (local, remote, length) rows not yet posted
    prompt_parts: Reassembly | None = None  # PREFILL chunks so far
    plan_parts: Reassembly | None = None  # PLAN chunks so far
    prefill_started: float = 0.0
    prefill_ms: float | None = None
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
    def __init__(
        self,
        runtime: RankRuntime,
        model,
        pool: KVPool,
        segment: Segment,
        head_range: tuple[int, int],
        router: int,
        unsafe: bool = False,
        max_batch_bytes: int = 256 << 20,
        integrity: bool = True,
        prefill_slice_s: float = PREFILL_SLICE_S,
        batch_target_s: float = 0.5,
        clock: Clock | None = None,
    ) -> None:
        self.rt = runtime
        self.clock = clock or MonotonicClock()
        self.model = model
        self.pool = pool
        self.segment = segment
        self.heads = head_range
        self.router = router
        self.unsafe = unsafe
        self.integrity = integrity and not unsafe
        self.prefill_slice_s = prefill_slice_s
        self._init_driver(core.WRITER_TABLE)
        self.allocator = PageAllocator(pool.num_pages)
        self.jobs: dict[str, WriteJob] = {}
        self._init_books()
        runs = coalesce_runs(pool.head_slice_runs(0, *head_range))
        self._run_offsets = np.array([off for off, _ in runs], dtype=np.int64)
        self._run_lengths = np.array([n for _, n in runs], dtype=np.int64)
        self._row_bytes = int(self._run_lengths[0])
        self.batches = BatchSizer(target_s=batch_target_s, max_bytes=max_batch_bytes)
        self.handlers = {
            Kind.PREFILL: self._on_prefill,
            Kind.PLAN: self._on_plan,
            Kind.ABORT: self._on_abort,
        }
        assert set(self.handlers) == WRITER_RECEIVES
        runtime.set_handlers(self.handlers, role="prefill")
        runtime.on_request_error = self.fail_request
        runtime.on_card_replaced = self._on_card_replaced

    # -------------------------------------------------------------- the table
    def _init_driver(self, table: dict) -> None:
        """The writer's table, carried out by the protocol's one driver (an event an
        effect produces waits for the rest of its row: no re-entrant feed)."""
        self.driver: Driver = Driver(table, self._do, observe=self._observe, settled=self._settled)

    def _feed(self, job: WriteJob, event: WriterEvent) -> None:
        """Move the job by the writer's table and carry out the effects it lists."""
        self.driver.feed(job, event)

    def _observe(self, job: WriteJob, event: WriterEvent, before: WriterState, move) -> None:
        if move.ignored and event in (WriterEvent.FAIL, WriterEvent.FAIL_IDLE):
            log.error(
                "request %s: %s (the writer had already reached %s; nothing more to undo)",
                job.rid,
                job.abort_reason,
                before.value,
            )

    def _settled(self, job: WriteJob, move) -> None:
        if not move.ignored and job.state is WriterState.DONE and self.rt.faults.enabled:
            self._at_point(job, "after-notice", lambda j: None)  # the notice flushed
        if not move.ignored and job.state in (WriterState.DONE, WriterState.ABORTED):
            self.jobs.pop(job.rid, None)
            self.rt.faults.forget(job.rid)

    def _do(self, do: WriterDo, job: WriteJob) -> None:
        D = WriterDo
        if do is D.START_PREFILL:
            self._start_prefill(job)
        elif do is D.POST_WRITES:
            self._at_point(job, "before-write", self._post_writes)
        elif do is D.POST_NEXT:
            self._post_next(job)
        elif do is D.SEND_NOTICE:
            self._at_point(job, "after-write", self._send_notice)
        elif do is D.STOP_POSTING:
            if job.timer is not None:
                job.timer.cancel()
                job.timer = None
            job.queue = None
        elif do is D.TOMBSTONE:
            self.tombstones[job.rid] = self.clock.now()
        elif do is D.TELL_ABORT:
            log.error(
                "request %s: prefill rank %d failed: %s", job.rid, self.rt.rank, job.abort_reason
            )
            for rank in {self.router, job.owner} - {-1}:
                self.rt.send(
                    rank,
                    m.ABORT,
                    rid=job.rid,
                    owner=job.owner,
                    writers=[self.rt.rank],
                    source=job.abort_source,
                    reason=job.abort_reason,
                )
        elif do is D.SEND_ACK:
            ack = self.rt.notify(job.owner, m.ABORT_ACK, rid=job.rid) if job.owner >= 0 else None
            if ack is None:
                self._feed(job, WriterEvent.ACK_FLUSHED)
            else:
                self.rt.watch(ack, lambda b: self._feed(job, WriterEvent.ACK_FLUSHED), rid=job.rid)
        elif do is D.ACK_NOW:
            if job.owner >= 0:
                self.rt.notify(job.owner, m.ABORT_ACK, rid=job.rid)
        elif do is D.FREE_SOURCE:
            freed = self.allocator.free(job.rid) if self.allocator.pages_of(job.rid) else []
            how = Release.FREED if job.state is WriterState.DONE else Release.ABORTED
            why = Proof.OWN_FLUSH if freed else Proof.NOTHING_POSTED
            self.rt.send(
                self.router, m.RELEASED, rid=job.rid, pages=len(freed), how=how, justification=why
            )
        elif do is D.REPORT_NOTHING_HELD:
            self.rt.send(
                self.router,
                m.RELEASED,
                rid=job.rid,
                pages=0,
                how=Release.FREED,
                justification=Proof.NOTHING_POSTED,
            )
        else:  # pragma: no cover - the enum is closed
            raise AssertionError(f"request {job.rid}: no handler for {do}")

    def _fail(self, job: WriteJob, source: AbortSource, reason: str) -> None:
        job.abort_source, job.abort_reason = source, reason
        self._feed(job, core.on_failure(job.book))

    def _at_point(self, job: WriteJob, point: str, then) -> None:
        """Ask the fault layer at ``point``; then go on (now, or after an injected pause,
        unless the job moved on meanwhile)."""
        state = job.state
        decision: PointDecision = self.rt.faults.at_point(point, job.rid, job.tokens)
        if decision.decision is Decision.GO:
            then(job)
        elif decision.decision is Decision.PAUSE:

            def resume() -> None:
                job.timer = None
                if job.state is state:
                    then(job)

            job.timer = self.rt.call_later(decision.seconds, resume, rid=job.rid)
        else:
            source = (
                AbortSource.PREFILL
                if decision.decision is Decision.FAIL_PREFILL
                else AbortSource.TRANSFER
            )
            self._fail(job, source, f"injected fail-{source.value} at {point}")

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
        if job.prompt_parts is None:
            job.book.owner, job.owner_inc = msg.owner, msg.owner_inc
            job.router_inc = msg.inc
            job.prompt_parts = Reassembly(job.rid, "PREFILL", msg.total, TOKENS_PER_CHUNK)
        chunk = np.frombuffer(msg.tokens, dtype="<i4")
        if not job.prompt_parts.add(msg.offset, msg.total, chunk):  # type: ignore[arg-type]
            return
        tokens, job.prompt_parts = job.prompt_parts.joined_array(), None
        need = -(-len(tokens) // self.pool.page_size)
        try:
            grants = self.allocator.allocate(job.rid, need)
        except OutOfPages as exc:
            self._fail(job, AbortSource.PREFILL, f"prefill pool out of pages: {exc}")
            return
        self.allocations += 1
        job.tokens = tokens
        job.src_pages = [g.page for g in grants]
        self._feed(job, WriterEvent.PROMPT)

    def _on_plan(self, msg: Message) -> None:
        job = self._job(msg.rid)
        if job is None or job.dst_pages is not None:
            return
        if job.owner < 0:
            job.book.owner = msg.src
        elif job.owner != msg.src:
            log.warning(
                "request %s: PLAN from rank %d, but its owner is rank %d; ignored",
                msg.rid,
                msg.src,
                job.owner,
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

    # -------------------------------------------------------------- prefill
    def _start_prefill(self, job: WriteJob) -> None:
        job.prefill_started = self.clock.now()
        # The prefill and the checksums run in slices (see .sliced): an ABORT that arrives
        # during a long prefill waits for about one slice and one step (a layer, or a chunk
        # of a long prompt's tokens), not the whole prefill; a fast one never yields.
        run_in_slices(
            self.rt,
            job.rid,
            self._prefill_steps(job),
            self.prefill_slice_s,
            wanted=lambda: job.state in _COMPUTING,
            then=lambda: self._feed(job, WriterEvent.KV_READY),
        )

    def _prefill_steps(self, job: WriteJob) -> Iterator[None]:
        """The prefill, one model step at a time (the model yields a layer's index once
        that layer's KV is in the pages, None between chunks of a layer), stopping once
        the last layer's KV is written (nothing after it is needed here); then the
        checksums the owner will check what lands against (I5), a slice of pages a step."""
        assert job.tokens is not None
        layers = self.model.prefill_layers(
            self.pool.kv,
            torch.from_numpy(job.tokens.astype(np.int64)),
            job.src_pages,
            head_range=self.heads,
        )
        while True:
            with torch.no_grad():
                layer = next(layers, _END)
            if layer is _END:
                break
            yield
            if layer == 0 and self.rt.faults.enabled:
                self._at_point(job, "prefill", lambda j: None)
                if job.state not in _COMPUTING:
                    return
            if layer is not None and layer + 1 >= self.model.layers:
                break
        job.prefill_ms = 1e3 * (self.clock.now() - job.prefill_started)
        if not self.integrity:
            return
        lo, hi = self.heads
        view = self.pool.kv[:, :, :, lo:hi]
        per_step = max(1, CHECKSUM_SLICE_BYTES // (view[0].numel() * view.element_size()))
        job.checksums = []
        for start in range(0, len(job.src_pages), per_step):
            job.checksums.extend(
                page_checksums(view, job.src_pages[start : start + per_step]).tolist()
            )
            yield

    # -------------------------------------------------------------- writing
    def _triples(self, job: WriteJob) -> np.ndarray:
        """``[pages x runs, 3]`` int64: (local offset, remote offset, length) of every run
        of this writer's heads in the pages it sends."""
        assert job.dst_pages is not None
        pb = self.pool.page_bytes
        src = np.asarray(job.src_pages[: job.sent_pages], dtype=np.int64)
        dst = np.asarray(job.dst_pages[: len(src)], dtype=np.int64)
        local = (src[:, None] * pb + self._run_offsets[None, :]).reshape(-1)
        remote = (dst[:, None] * pb + self._run_offsets[None, :]).reshape(-1)
        lengths = np.broadcast_to(self._run_lengths, (len(src), len(self._run_lengths))).reshape(-1)
        return np.stack([local, remote, lengths], axis=1)

    def _post_writes(self, job: WriteJob) -> None:
        assert job.tokens is not None and job.dst_pages is not None
        if len(job.dst_pages) < len(job.src_pages):
            self._fail(
                job,
                AbortSource.PREFILL,
                f"plan holds {len(job.dst_pages)} pages but the prompt of "
                f"{len(job.tokens)} tokens needs {len(job.src_pages)}",
            )
            return
        faults = self.rt.faults
        faults.tamper_source(job.rid, job.tokens, self.pool, job.src_pages, self.heads)
        job.sent_pages = faults.pages_to_write(job.rid, job.tokens, len(job.src_pages))
        triples = self._triples(job)
        job.posted_bytes = int(triples[:, 2].sum())
        job.queue, held = faults.hold_in_flight(
            self.rt, job.rid, job.tokens, job.owner, self.segment, triples
        )
        if held is not None:
            core.on_posted(job.book)
            self.rt.watch(held, lambda b: self._on_written(job, b), rid=job.rid)
        if not self._post_next(job) or held is None:
            return
        # The action injected at mid-transfer (a pause needs nothing more: the held half
        # is in flight and lands on its own).
        self._at_point(job, "mid-transfer", lambda j: None)

    def _post_next(self, job: WriteJob) -> bool:
        """Post the next bounded batch of this job (one at a time, so an abort stops
        posting within one batch). False if posting failed (the job is failed)."""
        if not job.queued():
            return True
        assert job.queue is not None
        rows = max(1, self.batches.batch_bytes(job.owner) // self._row_bytes)
        chunk, job.queue = job.queue[:rows], job.queue[rows:]
        nbytes, posted_at = int(chunk[:, 2].sum()), self.clock.now()
        try:
            batch = self.rt.write(
                job.owner, self.segment, chunk, rid=job.rid, incarnation=job.owner_inc
            )
        except TransferError as exc:
            self._fail(job, AbortSource.TRANSFER, f"write to rank {job.owner} refused: {exc}")
            return False
        core.on_posted(job.book)

        def written(b: Batch) -> None:
            self.batches.settled(job.owner, nbytes, self.clock.now() - posted_at)
            self._on_written(job, b)

        self.rt.watch(batch, written, rid=job.rid)
        return True

    def _on_written(self, job: WriteJob, batch: Any) -> None:
        ok = batch.status() is BatchStatus.COMPLETED
        event = core.on_settled(job.book, ok, job.queued())
        if not ok and job.state is WriterState.WRITING:
            job.abort_source = AbortSource.TRANSFER
            job.abort_reason = f"write to rank {job.owner} failed: {batch.error}"
        self._feed(job, event)

    def _send_notice(self, job: WriteJob) -> None:
        """The NOTICE, in chunks of ``PAGES_PER_CHUNK`` pages, each sent with ``notify``
        (after a flush): any chunk that arrives proves every write landed."""
        assert job.tokens is not None and job.dst_pages is not None
        assert job.dst_generations is not None
        sent = job.sent_pages
        checksums = job.checksums[:sent]
        notice = None
        for lo, hi in spans(sent, PAGES_PER_CHUNK):
            notice = self.rt.notify(
                job.owner,
                m.NOTICE,
                rid=job.rid,
                tokens=len(job.tokens),
                offset=lo,
                total=sent,
                pages=job.dst_pages[lo:hi],
                generations=job.dst_generations[lo:hi],
                checksums=checksums[lo:hi],
                bytes=job.posted_bytes,
                prefill_ms=job.prefill_ms,
            )
            if notice is None:
                self._fail(
                    job, AbortSource.TRANSFER, f"notice to rank {job.owner} could not be sent"
                )
                return
        if notice is not None:
            self.rt.watch(notice, lambda b: self._on_notified(job), rid=job.rid)

    def _on_notified(self, job: WriteJob) -> None:
        self._feed(job, WriterEvent.NOTICE_FLUSHED)  # DONE: _settled runs after-notice

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
        nothing more is posted, and the ack follows what is in flight."""
        job = self.jobs.get(rid)
        if job is None:
            log.error(
                "request %s: failed on prefill rank %d after it ended here: %s",
                rid,
                self.rt.rank,
                reason,
            )
            return
        self._fail(job, AbortSource.INTERNAL, reason)

    # -------------------------------------------------------------- housekeeping
    def in_flight(self) -> bool:
        """Some request is between its PREFILL/PLAN and its end here."""
        return bool(self.jobs)
