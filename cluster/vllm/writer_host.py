"""The prefill worker's side of the protocol: the writer's driver over vLLM's ports.

A prefill worker is the one writer of its TP rank's share of a request: vLLM computed the
prompt's KV into blocks it holds until the connector reports the request in
``finished_sending``. What each effect of the writer's table means is
:class:`~kvferry.engine.protocol.writer_driver.WriterDriver`'s, as for the service's
prefill rank; this module turns what reaches the worker (the scheduler's hand-over, the
decode's PLAN and ABORT, settled batches, the hold timeout) into the table's events and
supplies the ports: the data path (checksums, the one-sided writes, the notice), the
source blocks (vLLM's, given back in ``finished_sending``), the wire to the owner, the
report and the tombstones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.engine.integrity import page_checksums
from kvferry.engine.protocol import writer as wc
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import AbortSource, Release
from kvferry.engine.protocol.writer import WriterBook, WriterEvent, WriterState
from kvferry.engine.protocol.writer_driver import WriterDriver, WriterPorts
from kvferry.transfer import (
    Batch,
    BatchStatus,
    Peer,
    RemoteSegment,
    SegmentDescriptor,
    TransferError,
)

from . import wire
from .layout import KVRegions, LayoutError
from .loop import PollTimers, Timer
from .parts import WorkerHost, WorkerParts

log = logging.getLogger("kvferry.vllm")

OWNER = 0  # a job's one owner: the decode worker of its TP rank whose plan or abort named it


@dataclass
class Job:
    """A request at a prefill worker: the writer's book and what its ports need."""

    rid: str
    book: WriterBook = field(init=False)
    src: list[int] | None = None  # vLLM holds these blocks until finished_sending
    tokens: int = 0
    checksums: list[int] = field(default_factory=list)
    peer: Peer | None = None  # the owner's endpoint
    orid: str = ""  # the request's id at its owner
    plan: dict[str, Any] | None = None
    dst: KVRegions | None = None
    rsegs: list[RemoteSegment] = field(default_factory=list)
    queue: list[tuple[int, Any]] = field(default_factory=list)  # (buffer, triples) to post
    inflight: list[tuple[Batch, Callable[[Batch], None]]] = field(default_factory=list)
    posted_bytes: int = 0
    batches_posted: int = 0
    hold: Timer | None = None  # the hold timeout while its KV waits for a plan
    abort_source: AbortSource = AbortSource.PREFILL  # TELL_ABORT's words
    abort_reason: str = ""

    def __post_init__(self) -> None:
        self.book = WriterBook(self.rid)

    def meet(self, peer: Peer | None, orid: str) -> None:
        """The owner is known now: where its messages go."""
        self.peer, self.orid = peer, orid
        self.book.owner = OWNER if peer is not None else -1


class WriterWire:
    """The writer's control messages to the request's owner (the decode worker that
    planned it), over the worker's link; the owner's number in the book is :data:`OWNER`
    whenever the job knows that worker's endpoint."""

    def __init__(self, host: WriterHost) -> None:
        self.host = host

    def tell_abort(self, rid: str, owner: int, source: AbortSource, reason: str) -> None:
        """ABORT to the owner, when known. There is no router: the prefill's own vLLM
        engine already ended the request, and the decode's hears of it from its worker."""
        h = self.host
        log.error("request %s: prefill worker tp%d failed: %s", rid, h.tp_rank, reason)
        h.stats.abort(source.value)
        job = h.jobs.get(rid)
        if job is None or owner < 0:
            return
        payload = wire.encode(
            wire.ABORT, rid=rid, orid=job.orid, source=source.value, reason=reason
        )
        h.link.send(job.peer, payload, rid)

    def send_ack(self, rid: str, owner: int, flushed: Callable[[], None] | None) -> None:
        h = self.host
        job = h.jobs.get(rid)
        ack = None
        if job is not None and owner >= 0:
            ack = h.link.notify(job.peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=job.orid), rid)
        if flushed is None:
            return
        if ack is None or job is None:
            flushed()
        else:
            job.inflight.append((ack, lambda _batch: flushed()))


class WriterHost(WorkerHost):
    """A prefill worker's jobs: what arrives becomes the writer's events, fed to its
    driver; this object is the driver's data path, source blocks and report ports."""

    def __init__(self, parts: WorkerParts, timers: PollTimers) -> None:
        super().__init__(parts, timers)
        self.jobs: dict[str, Job] = {}
        self.finished_sending: set[str] = set()
        self.regions: KVRegions | None = None
        self.segments: list[Any] = []
        self.remote_segments: dict[int, tuple[KVRegions, list[RemoteSegment]]] = {}
        ports = WriterPorts(
            data=self,
            wire=WriterWire(self),
            source=self,
            report=self,
            tombstones=self.tombstones,
            clock=self.clock,
        )
        self.driver = WriterDriver(ports, wc.WRITER_TABLE, settled=self._settled)

    def attach(self, regions: KVRegions, segments: list[Any]) -> None:
        """vLLM's KV buffers, registered with the transfer engine."""
        self.regions, self.segments = regions, segments

    # ------------------------------------------------------------ events in
    def _job(self, rid: str) -> Job | None:
        if rid in self.tombstones:
            return None
        job = self.jobs.get(rid)
        if job is None:
            job = self.jobs[rid] = Job(rid)
        return job

    def _settled(self, job: Job, move: Any) -> None:
        if job.book.state in (WriterState.DONE, WriterState.ABORTED):
            if job.hold is not None:
                job.hold.cancel()
            if self.jobs.get(job.rid) is job:
                del self.jobs[job.rid]

    def fail(self, job: Job, source: AbortSource, reason: str) -> None:
        self.driver.fail(job, source, reason)

    def fail_request(self, rid: str | None, exc: Exception) -> None:
        """An exception in one of ``rid``'s timers: the job fails as if its transfer had
        (the owner is told, nothing more is posted, the ack follows what is in flight)."""
        reason = f"internal error: {type(exc).__name__}: {exc}"
        log.error("request %s: prefill worker tp%d: %s", rid, self.tp_rank, reason, exc_info=exc)
        job = self.jobs.get(rid) if rid is not None else None
        if job is not None:
            self.fail(job, AbortSource.INTERNAL, reason)

    def on_send(self, rid: str, spec: dict[str, Any]) -> None:
        """The scheduler hands a finished prefill over: its blocks wait for a plan."""
        job = self._job(rid)
        if job is None:  # aborted before the scheduler handed it over: nothing was posted
            self.finished_sending.add(rid)
            return
        job.src, job.tokens = list(spec["blocks"]), int(spec["tokens"])
        job.hold = self.timers.call_later(
            self.settings.hold_timeout_s, lambda: self._hold_expired(job), rid=rid
        )
        self.driver.feed(job, WriterEvent.PROMPT)

    def _hold_expired(self, job: Job) -> None:
        """The hold timeout: KV no decode planned for in time is let go."""
        if job.book.state is WriterState.KV_READY:
            self.fail(
                job,
                AbortSource.TRANSFER,
                f"no plan from a decode within {self.settings.hold_timeout_s} s",
            )

    def on_plan(self, msg: Any, m: dict[str, Any]) -> None:
        rid, orid = m["rid"], m["orid"]
        peer: Peer | None = None
        unreachable = ""
        try:
            peer = self.link.peer(msg.sender_address)
        except TransferError as exc:
            unreachable = f"{type(exc).__name__}: {exc}"
        job = self._job(rid)
        if job is None:  # ended here (and flushed): fail the load, and ack at once
            reason = f"request {rid} already ended at prefill worker tp{self.tp_rank}"
            self.link.send(
                peer,
                wire.encode(
                    wire.ABORT, rid=rid, orid=orid, source=AbortSource.PREFILL.value, reason=reason
                ),
                rid,
            )
            self.link.notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=orid), rid)
            return
        if job.plan is not None:
            log.warning("request %s: a second plan (from %s) ignored", rid, msg.sender_name)
            return
        job.meet(peer, orid)
        job.plan = m
        if peer is None:
            self.fail(
                job, AbortSource.TRANSFER, f"the planning decode is unreachable: {unreachable}"
            )
            return
        if m["tp_size"] != self.tp_size or m["tp_rank"] != self.tp_rank:
            self.fail(
                job,
                AbortSource.TRANSFER,
                f"plan from decode TP {m['tp_rank']}/{m['tp_size']} at prefill TP "
                f"{self.tp_rank}/{self.tp_size}: heterogeneous TP is not supported",
            )
            return
        try:
            key = msg.sender_incarnation
            if key not in self.remote_segments:
                regions = KVRegions.from_wire(m["regions"])
                rsegs = [
                    self.link.engine.open_segment(peer, SegmentDescriptor.unpack(bytes(d)))
                    for d in m["descs"]
                ]
                self.remote_segments[key] = (regions, rsegs)
            job.dst, job.rsegs = self.remote_segments[key]
        except (TransferError, LayoutError, ValueError, KeyError) as exc:
            self.fail(job, AbortSource.TRANSFER, f"plan unusable: {exc}")
            return
        self.driver.feed(job, WriterEvent.PLAN)

    def on_owner_abort(self, msg: Any, m: dict[str, Any]) -> None:
        """An ABORT from the owner (decode) for one of our jobs."""
        rid, orid = m["rid"], m["orid"]
        peer: Peer | None = None
        try:
            peer = self.link.peer(msg.sender_address)
        except TransferError as exc:
            log.warning("request %s: the aborting decode is unreachable: %s", rid, exc)
        job = self.jobs.get(rid)
        if job is None and rid in self.tombstones:
            # Ended here already (and flushed): a book that says so, kept while its row
            # runs (the table acks again; nothing is in flight).
            job = self.jobs[rid] = Job(rid)
            job.book.state = WriterState.ABORTED
        elif job is None:
            job = self.jobs[rid] = Job(rid)
            self.stats.abort(m["source"])
        else:
            self.stats.abort(m["source"])
        if job.peer is None:
            job.meet(peer, orid)
        self.driver.feed(job, wc.on_abort(job.book))

    def settle(self) -> None:
        """Run the continuation of every batch that settled (the poll)."""
        for job in list(self.jobs.values()):
            current, job.inflight = job.inflight, []
            kept = []
            for batch, then in current:
                if self.link.engine.poll(batch) is BatchStatus.PENDING:
                    kept.append((batch, then))
                else:
                    then(batch)
            job.inflight = kept + job.inflight

    # ------------------------------------------------------------ the data path (a port)
    def start_prefill(self, job: Job) -> None:
        """vLLM computed the KV already: checksum the source blocks, then KV_READY."""
        assert self.regions is not None and job.src is not None
        data = self.regions.block_bytes_of(job.src)
        job.checksums = page_checksums(data, list(range(len(job.src)))).tolist()
        self.driver.feed(job, WriterEvent.KV_READY)

    def post_writes(self, job: Job) -> None:
        """Check the plan against the prompt and the layouts, queue the writes in batches
        of at most ``max_batch_bytes``, post the first."""
        assert job.plan is not None and job.src is not None and job.dst is not None
        assert self.regions is not None
        if job.hold is not None:
            job.hold.cancel()
        dst = job.plan["blocks"]
        if len(dst) > len(job.src) or not dst:
            self.fail(
                job,
                AbortSource.PREFILL,
                f"plan holds {len(dst)} blocks; the prompt's KV fills {len(job.src)}",
            )
            return
        if (self.regions.layout, self.regions.signature()) != (job.dst.layout, job.dst.signature()):
            self.fail(
                job,
                AbortSource.TRANSFER,
                f"KV layouts differ: prefill {self.regions.layout} "
                f"{self.regions.signature()[:1]} vs decode {job.dst.layout} "
                f"{job.dst.signature()[:1]}",
            )
            return
        src = job.src[len(job.src) - len(dst) :]
        per = max(1, self.settings.max_batch_bytes // max(1, self.regions.block_bytes))
        job.queue = []
        for lo in range(0, len(dst), per):
            for i in range(len(self.regions.buffers)):
                job.queue.append(
                    (i, self.regions.triples(i, src[lo : lo + per], job.dst, dst[lo : lo + per]))
                )
        job.posted_bytes = len(dst) * self.regions.block_bytes
        job.checksums = job.checksums[len(job.src) - len(dst) :]
        self.post_next(job)

    def post_next(self, job: Job) -> None:
        """Post one batch (an abort stops posting within one)."""
        if not job.queue:
            return
        (i, triples), job.queue = job.queue[0], job.queue[1:]
        assert job.peer is not None
        try:
            batch = self.link.engine.write(job.peer, self.segments[i], job.rsegs[i], triples)
        except TransferError as exc:
            self.fail(job, AbortSource.TRANSFER, f"write refused: {exc}")
            return
        wc.on_posted(job.book)
        job.batches_posted += 1
        self.stats.add(bytes=int(triples[:, 2].sum()))
        job.inflight.append((batch, lambda b: self._written(job, b)))

    def _written(self, job: Job, batch: Batch) -> None:
        ok = batch.peek() is BatchStatus.COMPLETED
        if not ok and job.book.state is WriterState.WRITING:
            job.abort_source, job.abort_reason = (
                AbortSource.TRANSFER,
                f"write failed: {batch.error}",
            )
        self.driver.feed(job, wc.on_settled(job.book, ok, bool(job.queue)))

    def post_part(self, job: Job) -> None:
        raise NotImplementedError(
            f"request {job.rid}: vLLM computes the KV before saving it: no part to pipeline"
        )

    send_part = post_part

    def send_notice(self, job: Job) -> None:
        """NOTICE with notify (flush, then send); NOTICE_FLUSHED once that completed."""
        assert job.plan is not None
        payload = wire.encode(
            wire.NOTICE,
            rid=job.rid,
            orid=job.orid,
            tokens=job.tokens,
            blocks=list(job.plan["blocks"]),
            gens=list(job.plan["gens"]),
            checksums=[int(c) for c in job.checksums],
            bytes=job.posted_bytes,
        )
        notice = self.link.notify(job.peer, payload, job.rid)
        if notice is None:
            self.fail(job, AbortSource.TRANSFER, "the notice could not be sent")
            return
        self.stats.add(pages=len(job.plan["blocks"]))
        job.inflight.append((notice, lambda b: self.driver.feed(job, WriterEvent.NOTICE_FLUSHED)))

    def stop_posting(self, job: Job) -> None:
        """Nothing more is posted; what is in flight settles through :meth:`settle`."""
        job.queue = []
        if job.hold is not None:
            job.hold.cancel()

    # ------------------------------------------------------------ source blocks (a port)
    def free(self, rid: str) -> int:
        """vLLM's blocks of ``rid`` go back to it: the request is reported in
        ``finished_sending`` (vLLM frees them). 0 when vLLM never handed it over."""
        job = self.jobs.get(rid)
        if job is None or job.src is None:
            return 0
        self.finished_sending.add(rid)
        return len(job.src)

    # ------------------------------------------------------------ the report (a port)
    def released(self, rid: str, pages: int, how: Release, justification: Proof) -> None:
        """Logged only: there is no router to tell, and vLLM learns of the blocks through
        ``finished_sending`` (:meth:`free`). A request the scheduler never handed over
        (RELEASED with 0 pages) is reported when, if ever, it is: it is tombstoned, so
        :meth:`on_send` gives its blocks back at once."""
        log.debug(
            "request %s: %d source blocks released (%s; proof: %s)", rid, pages, how, justification
        )
