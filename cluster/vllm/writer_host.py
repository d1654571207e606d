"""The prefill worker's side of the protocol: the writer's driver over vLLM's ports.

A prefill worker writes its share of a request's KV into each decode worker that plans
from it: vLLM computed the prompt's KV into blocks it holds until the connector reports
the request in ``finished_sending``. One writer's *job* per (request, decode worker): each
job is one protocol instance with one owner (its own book, tombstone, notice and ack), and
the prompt's blocks go back to vLLM once every decode worker expected to plan here has
ended its job (:class:`Prompt`). Which decode workers those are, and which heads each
job writes, is :mod:`.reshape`'s rule, known at the first plan (it carries the decode's
TP size). A job between like workers (same TP rank and size and block size) moves
whole blocks as they lie here, its layout the decode's or one the decode turns them from
after its checks (:func:`.reshape.whole_blocks`); a fan-in (prefill TP a multiple of the
decode's, the decode's kernel blocks a whole number of the prefill's) moves its kernel
blocks' layer spans whole into its slots of the decode's, which the decode turns after
its checks (:func:`.reshape.slot_of`); any other moves the rows of its heads as runs
planned once (:func:`.reshape.plan_pair`). Both of these check with one region checksum
per decode block, taken (and the part's source blocks checked against the hand-over's)
as each part is posted; rows that lie scattered here and contiguous at the decode are
gathered into staging memory first (:mod:`.staging`). A job of more than ``part_bytes``
goes in parts of whole decode blocks, the table's pipelined path: each part but the last
is followed by a NOTICE_PART once it landed, so the decode checks (and turns) it while
the next part is written. What each effect of the writer's
table means is :class:`~kvferry.engine.protocol.writer_driver.WriterDriver`'s, as for the
service's prefill rank; this module turns what reaches the worker (the scheduler's
hand-over, the decode's PLAN and ABORT, settled batches, the hold timeout) into the
table's events and supplies the ports: the data path (checksums, the one-sided writes,
the notice), the source blocks (vLLM's, given back in ``finished_sending``), the wire to
the owner, the report and the tombstones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.engine.protocol import writer as wc
from kvferry.engine.protocol.ports import SourceFreed
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
from .reshape import (
    EngineShape,
    PairRuns,
    block_checksums,
    owners_of,
    pairs,
    part_ranges,
    plan_pair,
    plan_slots,
    region_checksums,
    slot_of,
    source_blocks,
    whole_blocks,
)
from .staging import Staged, Staging, worth_staging

log = logging.getLogger("kvferry.vllm")

OWNER = 0  # a job's one owner: the decode worker whose plan or abort named it


def job_id(rid: str, decode_rank: int) -> str:
    """The id of the job writing request ``rid`` into decode TP rank ``decode_rank``
    (the book's, the tombstone's and the logs')."""
    return f"{rid}@tp{decode_rank}"


@dataclass
class Prompt:
    """A request's KV at this prefill worker: vLLM holds its blocks until every decode
    worker expected to plan from this worker has ended its job."""

    rid: str
    src: list[int] | None = None  # vLLM holds these blocks until finished_sending
    tokens: int = 0
    checksums: list[int] | None = None  # page checksums of ``src``, taken once (I5)
    owners: frozenset[int] | None = None  # decode ranks that plan here (at the first plan)
    ended: set[int] = field(default_factory=set)  # decode ranks whose job ended
    jobs: dict[int, Job] = field(default_factory=dict)  # by decode rank
    # before the hand-over: the unclaimed timeout (vLLM may never hand the request over);
    # after it: the hold timeout while its KV waits for plans
    hold: Timer | None = None
    unclaimed: bool = False  # never handed over in time: forgotten once its jobs ended

    @property
    def all_ended(self) -> bool:
        return self.owners is not None and self.owners <= self.ended


@dataclass(frozen=True)
class Part:
    """Blocks ``[lo, hi)`` of a job's plan (their places in it), posted together: the
    batches that write them. A load of several parts goes pipelined: each part but the
    last is followed, once its batches landed, by a NOTICE_PART (flush first) that lets
    the owner check it while the next part is written."""

    lo: int
    hi: int
    batches: list[tuple[int, int, Any]]  # (local buffer, remote buffer, triples)
    runs: PairRuns | None = None  # rows of another shape: the part's runs, to checksum


@dataclass
class Job:
    """One decode worker's share of a request at this prefill worker: the writer's book
    and what its ports need."""

    rid: str  # the job's id (:func:`job_id`)
    prompt: Prompt
    decode_rank: int
    book: WriterBook = field(init=False)
    checksums: list[int] = field(default_factory=list)
    peer: Peer | None = None  # the owner's endpoint
    orid: str = ""  # the request's id at its owner
    plan: dict[str, Any] | None = None
    decode: EngineShape | None = None  # the planning decode engine's shape
    heads: tuple[int, ...] = ()  # global heads this job writes (empty: others write them)
    runs: PairRuns | None = None  # reshaped jobs: the rows' runs, planned once
    dst: KVRegions | None = None
    rsegs: list[RemoteSegment] = field(default_factory=list)
    parts: list[Part] | None = None  # the parts not posted yet (None: the plan not checked)
    part: Part | None = None  # the part posted last
    queue: list[tuple[int, int, Any]] = field(default_factory=list)  # (local, remote, triples)
    staged: bool = False  # rows scattered here, contiguous there: gathered before posting
    next_stage: tuple[Any, Staged] | None = None  # (its triples, the gather) of the next batch
    inflight: list[tuple[Batch, Callable[[Batch], None]]] = field(default_factory=list)
    posted_bytes: int = 0
    batches_posted: int = 0
    abort_source: AbortSource = AbortSource.PREFILL  # TELL_ABORT's words
    abort_reason: str = ""

    def __post_init__(self) -> None:
        self.book = WriterBook(self.rid)

    @property
    def request(self) -> str:
        return self.prompt.rid

    def meet(self, peer: Peer | None, orid: str) -> None:
        """The owner is known now: where its messages go."""
        self.peer, self.orid = peer, orid
        self.book.owner = OWNER if peer is not None else -1


class WriterWire:
    """The writer's control messages to a job's owner (the decode worker that planned
    it), over the worker's link; the owner's number in the book is :data:`OWNER`
    whenever the job knows that worker's endpoint."""

    def __init__(self, host: WriterHost) -> None:
        self.host = host

    def tell_abort(self, jid: str, owner: int, source: AbortSource, reason: str) -> None:
        """ABORT to the owner, when known. There is no router: the prefill's own vLLM
        engine already ended the request, and the decode's hears of it from its worker."""
        h = self.host
        log.error("request %s: prefill worker tp%d failed: %s", jid, h.tp_rank, reason)
        h.stats.abort(source.value)
        job = h.jobs.get(jid)
        if job is None or owner < 0:
            return
        h.link.send(job.peer, h.abort_payload(job.request, job.orid, source, reason), jid)

    def send_ack(self, jid: str, owner: int, flushed: Callable[[bool], None] | None) -> None:
        h = self.host
        job = h.jobs.get(jid)
        ack = None
        if job is not None and owner >= 0:
            ack = h.link.notify(
                job.peer, wire.encode(wire.ABORT_ACK, rid=job.request, orid=job.orid), jid
            )
        if flushed is None:
            return
        if ack is None or job is None:  # no flush made: the blocks go as drained
            flushed(False)
        else:
            # a flush that failed is no proof: ACK_FAILED, the source freed as drained
            job.inflight.append((ack, lambda b: flushed(b.peek() is BatchStatus.COMPLETED)))


TERMINAL = (WriterState.DONE, WriterState.ABORTED)


def _listed(values: Any, most: int = 16) -> str:
    """``values`` for a message: whole up to ``most``, else its ends and its length."""
    xs = [int(v) for v in values]
    if len(xs) <= most:
        return str(xs)
    head, tail = ", ".join(map(str, xs[: most - 2])), ", ".join(map(str, xs[-2:]))
    return f"[{head}, ..., {tail}] ({len(xs)} of them)"


class WriterHost(WorkerHost):
    """A prefill worker's prompts and jobs: what arrives becomes the writer's events, fed
    to its driver; this object is the driver's data path, source blocks and report ports."""

    def __init__(self, parts: WorkerParts, timers: PollTimers) -> None:
        super().__init__(parts, timers)
        self.jobs: dict[str, Job] = {}  # by job id
        self.prompts: dict[str, Prompt] = {}  # by request id
        self.finished_sending: set[str] = set()
        self.regions: KVRegions | None = None
        self.segments: list[Any] = []
        self.staging: Staging | None = None
        self.waiting_for_slot: list[Job] = []  # staged jobs whose next batch waits for a slot
        # slots of failed batches whose puts are still in flight (given back once done)
        self.slots_being_read: list[tuple[Staged, Batch]] = []
        # by the decode's incarnation: the endpoint they were opened on, and its segments
        self.remote_segments: dict[int, tuple[Peer, KVRegions, list[RemoteSegment]]] = {}
        ports = WriterPorts(
            data=self,
            wire=WriterWire(self),
            source=self,
            report=self,
            tombstones=self.tombstones,
            clock=self.clock,
        )
        self.driver = WriterDriver(ports, wc.WRITER_TABLE, settled=self._settled)

    def attach(
        self,
        regions: KVRegions,
        segments: list[Any],
        kv_heads: int,
        staging: Staging | None = None,
    ) -> None:
        """vLLM's KV buffers, registered with the transfer engine; the engine's KV heads
        (:attr:`WorkerHost.kv_heads`); the staging memory rows are gathered into, if any
        (:mod:`.staging`)."""
        self.regions, self.segments, self.kv_heads = regions, segments, kv_heads
        self.staging = staging

    @property
    def shape(self) -> EngineShape:
        return EngineShape(self.kv_heads, self.tp_size)

    # ------------------------------------------------------------ events in
    def _prompt(self, rid: str) -> Prompt:
        """``rid``'s prompt, made now if there is none. One made by a decode's PLAN or
        ABORT before vLLM handed the request over is bounded by the transfer timeout: a
        request id vLLM never hands over (a client named it, or it ended here unseen)
        would otherwise hold its record, and its jobs, for good."""
        prompt = self.prompts.get(rid)
        if prompt is None:
            prompt = self.prompts[rid] = Prompt(rid)
            prompt.hold = self.timers.call_later(
                self.settings.transfer_timeout_s, lambda: self._unclaimed(prompt), rid=rid
            )
        return prompt

    def _new_job(self, prompt: Prompt, decode_rank: int) -> Job:
        """A job of ``prompt`` for one decode worker; one of a prompt vLLM handed over
        starts from its KV (PROMPT), as the prompt's other jobs did."""
        job = prompt.jobs[decode_rank] = Job(job_id(prompt.rid, decode_rank), prompt, decode_rank)
        self.jobs[job.rid] = job
        if prompt.src is not None:
            self.driver.feed(job, WriterEvent.PROMPT)
        return job

    def _settled(self, job: Job, move: Any) -> None:
        """A job that ended (after its notice's or its ack's flush, or with nothing ever
        posted) ends its hold on the prompt's blocks."""
        if job.book.state in (WriterState.DONE, WriterState.ABORTED):
            self.stop_posting(job)  # a gather started ahead gives its slot back
            if self.jobs.get(job.rid) is job:
                del self.jobs[job.rid]
            prompt = job.prompt
            if prompt.jobs.get(job.decode_rank) is job:
                prompt.ended.add(job.decode_rank)
                self._maybe_hand_back(prompt)

    def fail(self, job: Job, source: AbortSource, reason: str) -> None:
        self.driver.fail(job, source, reason)

    def fail_request(self, rid: str | None, exc: Exception) -> None:
        """An exception in one of ``rid``'s timers: its jobs fail as if their transfer had
        (each owner is told, nothing more is posted, the acks follow what is in flight)."""
        reason = f"internal error: {type(exc).__name__}: {exc}"
        log.error("request %s: prefill worker tp%d: %s", rid, self.tp_rank, reason, exc_info=exc)
        prompt = self.prompts.get(rid) if rid is not None else None
        for job in list(prompt.jobs.values()) if prompt is not None else []:
            if job.book.state not in (WriterState.DONE, WriterState.ABORTED):
                self.fail(job, AbortSource.INTERNAL, reason)

    def on_send(self, rid: str, spec: dict[str, Any]) -> None:
        """The scheduler hands a finished prefill over: its blocks wait for the plans."""
        if rid in self.tombstones:  # handed back already (a repeated hand-over)
            self.finished_sending.add(rid)
            return
        prompt = self._prompt(rid)
        if prompt.hold is not None:  # the unclaimed timeout: the request is handed over
            prompt.hold.cancel()
            prompt.hold = None
        prompt.src, prompt.tokens = list(spec["blocks"]), int(spec["tokens"])
        if prompt.all_ended:  # every job ended before the hand-over: nothing was posted
            self._hand_back(prompt)
            return
        prompt.checksums = self._source_checksums(prompt)  # as handed over (I5)
        prompt.hold = self.timers.call_later(
            self.settings.hold_timeout_s, lambda: self._hold_expired(prompt), rid=rid
        )
        for job in list(prompt.jobs.values()):
            if job.book.state in (WriterState.NEW, WriterState.PLANNED):
                self.driver.feed(job, WriterEvent.PROMPT)

    def _hold_expired(self, prompt: Prompt) -> None:
        """The hold timeout: KV no decode planned for in time is let go (a decode worker
        that never planned posted nothing here)."""
        why = f"no plan from a decode within {self.settings.hold_timeout_s} s"
        for job in list(prompt.jobs.values()):
            if job.book.state is WriterState.COMPUTING:  # no plan yet
                self.fail(job, AbortSource.TRANSFER, why)
        if prompt.owners is None:
            prompt.owners = frozenset()
            log.warning("request %s: prefill worker tp%d: %s", prompt.rid, self.tp_rank, why)
        for r in prompt.owners - set(prompt.jobs):
            prompt.ended.add(r)
        self._maybe_hand_back(prompt)

    def _unclaimed(self, prompt: Prompt) -> None:
        """The unclaimed timeout: vLLM did not hand the request over within the transfer
        timeout of its first plan or abort here (by then its decode gave up on the load).
        Its jobs fail (each owner is told and acked; nothing was posted without the KV),
        and once they ended the prompt is forgotten and its ids tombstoned: a late
        hand-over gets its blocks back at once, a late plan is refused."""
        if self.prompts.get(prompt.rid) is not prompt or prompt.src is not None:
            return
        prompt.hold, prompt.unclaimed = None, True
        why = (
            f"vLLM did not hand request {prompt.rid} over within the transfer timeout "
            f"({self.settings.transfer_timeout_s} s) of its first plan or abort here"
        )
        log.warning(
            "request %s: prefill worker tp%d: %s; its %d job(s) end",
            prompt.rid, self.tp_rank, why, len(prompt.jobs),
        )  # fmt: skip
        for job in list(prompt.jobs.values()):
            if job.book.state not in TERMINAL:
                self.fail(job, AbortSource.TRANSFER, why)
        self._maybe_hand_back(prompt)

    def _expect(self, prompt: Prompt, decode: EngineShape) -> str:
        """The decode workers that plan here, from the first plan's shape; '' or why the
        two engines cannot pair."""
        try:
            owners = frozenset(owners_of(self.shape, decode, self.tp_rank) or [0])
        except LayoutError as exc:
            return str(exc)
        if prompt.owners is None:
            prompt.owners = owners
        elif prompt.owners != owners:
            return (
                f"plans from decode TP sizes that disagree: decode ranks {sorted(owners)} "
                f"against {sorted(prompt.owners)}"
            )
        return ""

    def on_plan(self, msg: Any, m: dict[str, Any]) -> None:
        rid, orid, decode_rank = m["rid"], m["orid"], int(m["tp_rank"])
        jid = job_id(rid, decode_rank)
        peer: Peer | None = None
        unreachable = ""
        try:
            peer = self.link.peer(msg.sender_address)
        except TransferError as exc:
            unreachable = f"{type(exc).__name__}: {exc}"
        prompt = self.prompts.get(rid)
        ended = (
            jid in self.tombstones
            or rid in self.tombstones  # handed back (e.g. its hold ran out before this plan)
            or (prompt is not None and decode_rank in prompt.ended)
        )
        if ended:  # ended here (and flushed): fail the load, and ack at once
            reason = f"request {rid} already ended at prefill worker tp{self.tp_rank}"
            self.link.send(peer, self.abort_payload(rid, orid, AbortSource.PREFILL, reason), rid)
            self.link.notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=orid), rid)
            return
        prompt = self._prompt(rid)
        job = prompt.jobs.get(decode_rank) or self._new_job(prompt, decode_rank)
        if job.plan is not None and job.orid != orid:
            # another decode request names ours (a router's retry, params that lie): it
            # fails at once, acked (nothing of ours goes into its blocks); ours goes on
            reason = (
                f"request {rid} at prefill worker tp{self.tp_rank} is planned by decode "
                f"request {job.orid} already"
            )
            log.warning("request %s: the plan of decode request %s refused: %s", jid, orid, reason)
            self.link.send(peer, self.abort_payload(rid, orid, AbortSource.PREFILL, reason), rid)
            self.link.notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=orid), rid)
            return
        if job.plan is not None:
            log.warning("request %s: a second plan (from %s) ignored", jid, msg.sender_name)
            return
        job.meet(peer, orid)
        job.plan = m
        if peer is None:
            self.fail(
                job, AbortSource.TRANSFER, f"the planning decode is unreachable: {unreachable}"
            )
            return
        job.decode = EngineShape(int(m["kv_heads"]), int(m["tp_size"]))
        refused = self._expect(prompt, job.decode)
        if not refused and decode_rank not in (prompt.owners or ()):
            refused = (
                f"decode TP rank {decode_rank}/{job.decode.tp} planned, but this prefill "
                f"worker (TP {self.tp_rank}/{self.tp_size}) writes into decode ranks "
                f"{sorted(prompt.owners or ())} only"
            )
        if not refused:
            job.heads = pairs(self.shape, job.decode).get((self.tp_rank, decode_rank), ())
            if tuple(m["heads"]) != job.heads:
                refused = (
                    f"decode TP rank {decode_rank} asks for heads {_listed(m['heads'])}; "
                    f"this prefill worker writes it heads {_listed(job.heads)}"
                )
        if refused:
            self.fail(job, AbortSource.TRANSFER, f"plan refused: {refused}")
            return
        try:
            key = msg.sender_incarnation
            cached = self.remote_segments.get(key)
            # opened on an endpoint since closed (severed, failed), its rkeys went with
            # it: the decode's segments are opened again on this one
            if cached is None or cached[0] is not peer:
                regions = KVRegions.from_wire(m["regions"])
                rsegs = [
                    self.link.engine.open_segment(peer, SegmentDescriptor.unpack(bytes(d)))
                    for d in m["descs"]
                ]
                cached = self.remote_segments[key] = (peer, regions, rsegs)
            job.dst, job.rsegs = cached[1], cached[2]
        except (TransferError, LayoutError, ValueError, KeyError) as exc:
            self.fail(job, AbortSource.TRANSFER, f"plan unusable: {exc}")
            return
        self.driver.feed(job, WriterEvent.PLAN)
        if job.book.state is WriterState.COMPUTING_PLANNED:  # vLLM handed its KV over
            self._start_writes(job)

    def on_owner_abort(self, msg: Any, m: dict[str, Any]) -> None:
        """An ABORT from an owner (a decode worker) for its job of one of our requests."""
        rid, orid, decode_rank = m["rid"], m["orid"], int(m["tp_rank"])
        jid = job_id(rid, decode_rank)
        peer: Peer | None = None
        try:
            peer = self.link.peer(msg.sender_address)
        except TransferError as exc:
            log.warning("request %s: the aborting decode is unreachable: %s", jid, exc)
        prompt = self.prompts.get(rid)
        job = prompt.jobs.get(decode_rank) if prompt is not None else None
        if job is None and (
            jid in self.tombstones
            or rid in self.tombstones
            or (prompt and decode_rank in prompt.ended)
        ):
            # Ended here already (and flushed): a book that says so, kept while its row
            # runs (the table acks again; nothing is in flight), of no prompt of ours.
            job = self.jobs[jid] = Job(jid, Prompt(rid), decode_rank)
            job.book.state = WriterState.ABORTED
        elif job is None:
            prompt = prompt or self._prompt(rid)
            self._expect(prompt, EngineShape(int(m["kv_heads"]), int(m["tp_size"])))
            job = self._new_job(prompt, decode_rank)
            self.stats.abort(m["source"])
        elif job.orid and job.orid != orid and job.book.state not in TERMINAL:
            # Another decode request names our request (a router's retry, or params that
            # lie): its plan was refused (or never came), so nothing of ours goes into its
            # blocks; it is acked as it is, and the job it did not plan goes on.
            log.warning(
                "request %s: ABORT of decode request %s, but this job writes for %s: acked, "
                "the job goes on",
                jid, orid, job.orid,
            )  # fmt: skip
            if peer is not None:
                self.link.notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=orid), jid)
            return
        else:
            self.stats.abort(m["source"])
            if job.book.state in TERMINAL and self.jobs.get(jid) is not job:
                # ended and settled while the prompt's other jobs go on: its book again,
                # for the row that acks once more (nothing of it is in flight), over the
                # endpoint this abort came from
                self.jobs[jid] = job
                if peer is not None:
                    job.meet(peer, orid)
        if job.peer is None:
            job.meet(peer, orid)
        self.driver.feed(job, wc.on_abort(job.book))

    def settle(self) -> None:
        """Run the continuation of every batch that settled (the poll). A batch that
        failed with puts of it still outstanding settles once they end: they may read
        vLLM's blocks (or a staging slot) yet, which the job's end gives back."""
        engine = self.link.engine
        for job in list(self.jobs.values()):
            current, job.inflight = job.inflight, []
            kept = []
            for batch, then in current:
                status = engine.poll(batch)
                if status is BatchStatus.PENDING or (
                    status is not BatchStatus.COMPLETED and engine.reading(batch)
                ):
                    kept.append((batch, then))
                else:
                    then(batch)
            job.inflight = kept + job.inflight
        self._release_read_slots()
        self._post_waiting()

    # ------------------------------------------------------------ the data path (a port)
    def _source_checksums(self, prompt: Prompt) -> list[int]:
        assert self.regions is not None and prompt.src is not None
        return block_checksums(self.regions, prompt.src).tolist()

    def start_prefill(self, job: Job) -> None:
        """vLLM computed the KV already, and the source blocks were checksummed when it
        handed them over (:meth:`on_send`). With the plan known the writes start; before
        it, the job waits for its PLAN (COMPUTING, then COMPUTING_PLANNED and
        :meth:`_start_writes`), so that a large load can go in parts."""
        if job.book.state is WriterState.COMPUTING_PLANNED:
            self._start_writes(job)

    def _start_writes(self, job: Job) -> None:
        """The plan and the prompt's KV are both here: check the plan, cut it into parts,
        and feed the first (:meth:`_next_part`)."""
        if self._prepare(job):
            self._next_part(job)

    def _next_part(self, job: Job) -> None:
        """KV_PART while more than one part is left (each is posted, then its
        NOTICE_PART sent), else KV_READY: the last part goes as a load of one part does,
        ending with the whole NOTICE."""
        assert job.parts is not None
        self.driver.feed(job, WriterEvent.KV_PART if len(job.parts) > 1 else WriterEvent.KV_READY)

    def _like(self, job: Job) -> bool:
        """Whole blocks go as they lie here: the same TP rank and size and blocks, and
        the same layout or one the owner turns them into (:func:`.reshape.whole_blocks`)."""
        assert self.regions is not None and job.dst is not None and job.decode is not None
        return (
            job.decode_rank == self.tp_rank
            and job.decode.tp == self.tp_size
            and whole_blocks(self.regions, job.dst)
        )

    def _prepare(self, job: Job) -> bool:
        """Check the plan against the prompt and plan its writes, in parts of about
        ``part_bytes`` (batches of at most ``max_batch_bytes``); False once the job failed."""
        prompt = job.prompt
        assert job.plan is not None and prompt.src is not None and job.dst is not None
        assert self.regions is not None and prompt.checksums is not None
        dst = job.plan["blocks"]
        if int(job.plan["tokens"]) != prompt.tokens:
            self.fail(
                job,
                AbortSource.PREFILL,
                f"plan for a prompt of {job.plan['tokens']} tokens; this one has {prompt.tokens}",
            )
            return False
        if not job.heads:  # a prefill worker whose heads others write: nothing to move
            job.parts, job.posted_bytes, job.checksums = [], 0, []
            return True
        return self._queue_blocks(job, dst) if self._like(job) else self._queue_rows(job, dst)

    def post_writes(self, job: Job) -> None:
        """The last part (a load's only one, most often; the plan was checked and cut by
        :meth:`_start_writes`): queue its batches, post the first (ALL_LANDED, then the
        whole NOTICE, once they all landed)."""
        assert job.parts is not None
        if not job.parts:  # nothing to move (our heads are others')
            job.queue = []
            self.driver.feed(job, WriterEvent.ALL_LANDED)
            return
        job.part = job.parts.pop(0)
        if not self._sum_part(job, job.part):
            return
        job.queue = list(job.part.batches)
        if job.book.state is WriterState.WRITING:
            self.post_next(job)

    def _queue_blocks(self, job: Job, dst: list[int]) -> bool:
        prompt = job.prompt
        assert self.regions is not None and job.dst is not None
        assert prompt.src is not None and prompt.checksums is not None
        if len(dst) > len(prompt.src) or not dst:
            self.fail(
                job,
                AbortSource.PREFILL,
                f"plan holds {len(dst)} blocks; the prompt's KV fills {len(prompt.src)}",
            )
            return False
        src = prompt.src[len(prompt.src) - len(dst) :]
        per = max(1, self.settings.max_batch_bytes // max(1, self.regions.block_bytes))
        job.posted_bytes = len(dst) * self.regions.block_bytes
        job.checksums = prompt.checksums[len(prompt.src) - len(dst) :]
        job.parts = []
        for first, end in part_ranges(len(dst), job.posted_bytes, self.settings.part_bytes):
            batches = []
            for lo in range(first, end, per):
                hi = min(end, lo + per)
                for i in range(len(self.regions.buffers)):
                    triples = self.regions.triples(i, src[lo:hi], job.dst, dst[lo:hi])
                    batches.append((i, i, triples))
            job.parts.append(Part(first, end, batches))
        return True

    def _queue_rows(self, job: Job, dst: list[int]) -> bool:
        """Another shape: the rows of the job's heads as runs, planned once, cut into
        parts; each part's region checksums are taken, and its source blocks checked, as
        it is posted (:meth:`_sum_part`)."""
        prompt = job.prompt
        assert self.regions is not None and job.dst is not None and job.decode is not None
        assert prompt.src is not None and prompt.checksums is not None
        decode = job.decode
        slot = slot_of(self.regions, job.dst, self.shape, decode, self.tp_rank, job.decode_rank)
        try:
            if slot is not None:  # a fan-in: our spans whole, into our slot of the owner's
                runs = plan_slots(self.regions, job.dst, slot, prompt.src, dst, prompt.tokens)
            else:
                runs = plan_pair(
                    self.regions,
                    job.dst,
                    job.heads,
                    self.shape.heads_of(self.tp_rank)[0],
                    decode.heads_of(job.decode_rank)[0],
                    prompt.src,
                    dst,
                    prompt.tokens,
                )
        except LayoutError as exc:
            self.fail(job, AbortSource.PREFILL, f"plan unusable: {exc}")
            return False
        job.runs = runs
        job.posted_bytes = runs.bytes
        job.checksums = [0] * len(dst)  # each part's as it is posted (_sum_part)
        job.parts = []
        for lo, hi in part_ranges(len(dst), job.posted_bytes, self.settings.part_bytes):
            keep = np.zeros(len(dst), dtype=bool)
            keep[lo:hi] = True
            within = runs.within(keep)
            job.parts.append(
                Part(lo, hi, list(within.batches(self.settings.max_batch_bytes)), within)
            )
        first = job.parts[0].batches[0][2] if job.parts and job.parts[0].batches else None
        job.staged = self.staging is not None and first is not None and worth_staging(first)
        return True

    def post_next(self, job: Job) -> None:
        """Post one batch (an abort stops posting within one)."""
        if not job.queue:
            return
        if job.staged and self.staging is not None and self.staging.fits(job.queue[0][2]):
            self._post_staged(job)
            return
        (i, j, triples), job.queue = job.queue[0], job.queue[1:]
        assert job.peer is not None
        try:
            batch = self.link.engine.write(job.peer, self.segments[i], job.rsegs[j], triples)
        except TransferError as exc:
            self.fail(job, AbortSource.TRANSFER, f"write refused: {exc}")
            return
        wc.on_posted(job.book)
        job.batches_posted += 1
        self.stats.add(bytes=int(triples[:, 2].sum()))
        job.inflight.append((batch, lambda b: self._written(job, b)))

    def _post_staged(self, job: Job) -> None:
        """Post the next batch from staging memory (:mod:`.staging`): gathered already
        while the batch before it was on the wire, or now; before it is posted, the
        gather of the batch after it starts, so that the two overlap. With every slot
        in flight the job waits for one (:meth:`_post_waiting`)."""
        assert self.staging is not None and job.peer is not None
        i, j, triples = job.queue[0]
        staged = self._take_stage(job, triples)
        if staged is None:
            staged = self.staging.stage(self.segments[i], triples)
        if staged is None:
            self.waiting_for_slot.append(job)
            return
        job.queue = job.queue[1:]
        try:
            staged.ready.result()
        except Exception as exc:  # the gather's thread: a device error, a buffer refused
            self.staging.release(staged)
            why = f"gathering a batch into staging failed: {type(exc).__name__}: {exc}"
            self.fail(job, AbortSource.INTERNAL, why)
            return
        try:
            self._stage_upcoming(job)
            batch = self.link.engine.write(
                job.peer, self.staging.segment, job.rsegs[j], staged.runs
            )
        except TransferError as exc:
            self.staging.release(staged)
            self.fail(job, AbortSource.TRANSFER, f"write refused: {exc}")
            return
        wc.on_posted(job.book)
        job.batches_posted += 1
        self.stats.add(bytes=int(triples[:, 2].sum()))
        job.inflight.append((batch, lambda b: self._staged_written(job, staged, b)))

    @staticmethod
    def _take_stage(job: Job, triples: Any) -> Staged | None:
        """The gather started for ``triples`` ahead of its turn, if any (one is only ever
        started for the batch posted next)."""
        ahead, job.next_stage = job.next_stage, None
        if ahead is None:
            return None
        assert ahead[0] is triples, "a gather started ahead for another batch"
        return ahead[1]

    def _stage_upcoming(self, job: Job) -> None:
        """Start gathering the batch after the one being posted: the next in this
        part's queue, else the first of the next part (its checks run when it is
        posted; a source byte changed in between lands unlike its region checksum)."""
        assert self.staging is not None
        if job.queue:
            i, _, triples = job.queue[0]
        elif job.parts and job.parts[0].batches:
            i, _, triples = job.parts[0].batches[0]
        else:
            return
        if not self.staging.fits(triples):
            return
        staged = self.staging.stage(self.segments[i], triples)
        if staged is not None:
            job.next_stage = (triples, staged)

    def _staged_written(self, job: Job, staged: Staged, batch: Batch) -> None:
        """A staged batch settled: its slot goes back once the transport reads it no more
        (a failed batch may still have puts in flight: then at a later poll,
        :meth:`_release_read_slots`), then as :meth:`_written`."""
        assert self.staging is not None
        if self.link.engine.reading(batch):
            self.slots_being_read.append((staged, batch))
        else:
            self.staging.release(staged)
        self._written(job, batch)

    def _release_read_slots(self) -> None:
        """Give back the slots of failed batches whose last puts have completed."""
        if not self.slots_being_read:
            return
        assert self.staging is not None
        still = []
        for staged, batch in self.slots_being_read:
            if self.link.engine.reading(batch):
                still.append((staged, batch))
            else:
                self.staging.release(staged)
        self.slots_being_read = still

    def _post_waiting(self) -> None:
        """Jobs that waited for a staging slot post, while slots are free (from the poll,
        outside any job's effects: a slot goes back in several of them)."""
        while self.waiting_for_slot and self.staging is not None and self.staging.free:
            self.post_next(self.waiting_for_slot.pop(0))

    def _written(self, job: Job, batch: Batch) -> None:
        ok = batch.peek() is BatchStatus.COMPLETED
        if not ok and job.book.state in (WriterState.WRITING, WriterState.COMPUTING_PLANNED):
            job.abort_source, job.abort_reason = (
                AbortSource.TRANSFER,
                f"write failed: {batch.error}",
            )
        self.driver.feed(job, wc.on_settled(job.book, ok, bool(job.queue)))

    def post_part(self, job: Job) -> None:
        """The next part of a pipelined load: queue its batches, post the first
        (PART_LANDED once they all landed)."""
        assert job.parts
        job.part = job.parts.pop(0)
        if not self._sum_part(job, job.part):
            return
        job.queue = list(job.part.batches)
        self.post_next(job)

    def _sum_part(self, job: Job, part: Part) -> bool:
        """Rows of another shape: each decode block's region checksum for the part's
        blocks, from the source, as the part is posted; then the source blocks the part
        reads are checked against the checksums taken when vLLM handed them over (a block
        changed since is never sent, and one changed after this check lands unlike its
        region checksum, which the owner sees). Taken part by part, these passes go on
        while the owner checks the parts before. Whole blocks carry the hand-over's
        checksums as they are. False once the job failed."""
        if part.runs is None:
            return True
        assert self.regions is not None and job.dst is not None
        prompt = job.prompt
        assert prompt.src is not None and prompt.checksums is not None
        sums = region_checksums(self.regions, part.runs, 0, part.hi)
        if self.settings.integrity:
            planned = len(job.checksums)
            a, b = source_blocks(self.regions, job.dst, planned, prompt.tokens, part.lo, part.hi)
            now = block_checksums(self.regions, prompt.src[a:b])
            changed = [
                blk
                for blk, x, y in zip(prompt.src[a:b], now, prompt.checksums[a:b], strict=True)
                if x != y
            ]
            if changed:
                self.fail(
                    job,
                    AbortSource.PREFILL,
                    f"{len(changed)} of the {b - a} source blocks of decode blocks "
                    f"[{part.lo}, {part.hi}) changed since vLLM handed them over "
                    f"(first: {changed[:4]})",
                )
                return False
        job.checksums[part.lo : part.hi] = sums[part.lo : part.hi].tolist()
        return True

    def send_part(self, job: Job) -> None:
        """NOTICE_PART with notify (flush, then send) for the part whose batches all
        landed: its blocks, generations and checksums, from its place in the plan. The
        next part is fed at once; it is written while the owner checks this one."""
        assert job.part is not None
        notice = self.link.notify(job.peer, self.part_notice(job, job.part), job.rid)
        if notice is None:
            self.fail(job, AbortSource.TRANSFER, "a notice part could not be sent")
            return
        job.inflight.append((notice, lambda b: None))
        self._next_part(job)

    @staticmethod
    def part_notice(job: Job, part: Part) -> bytes:
        """NOTICE_PART for ``part`` of ``job``: its offset in the plan, its blocks,
        generations and checksums (those the whole NOTICE repeats)."""
        assert job.plan is not None
        lo, hi = part.lo, part.hi
        return wire.encode(
            wire.NOTICE_PART,
            rid=job.request,
            orid=job.orid,
            offset=lo,
            blocks=list(job.plan["blocks"][lo:hi]),
            gens=list(job.plan["gens"][lo:hi]),
            checksums=[int(c) for c in job.checksums[lo:hi]],
        )

    def send_notice(self, job: Job) -> None:
        """NOTICE with notify (flush, then send); NOTICE_FLUSHED once that completed. A
        job that wrote nothing (its heads are others') ends without one: no owner waits
        for it."""
        assert job.plan is not None
        if not job.heads:
            self.driver.feed(job, WriterEvent.NOTICE_FLUSHED)
            return
        payload = wire.encode(
            wire.NOTICE,
            rid=job.request,
            orid=job.orid,
            tokens=job.prompt.tokens,
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
        job.inflight.append((notice, lambda b: self._notice_settled(job, b)))

    def _notice_settled(self, job: Job, notice: Batch) -> None:
        self.driver.notice_settled(
            job,
            notice.peek() is BatchStatus.COMPLETED,
            f"the notice's flush failed: {notice.error}",
        )

    def stop_posting(self, job: Job) -> None:
        """Nothing more is posted; what is in flight settles through :meth:`settle`. A
        gather started ahead gives its slot back once done."""
        job.queue = []
        job.parts = []
        if job.next_stage is not None and self.staging is not None:
            self.staging.release(job.next_stage[1])
        job.next_stage = None

    # ------------------------------------------------------------ source blocks (a port)
    def free(self, jid: str) -> SourceFreed:
        """The job's hold on the prompt's blocks ends (after its notice's or its ack's
        flush): the blocks it held, 0 when vLLM never handed the request over. vLLM gets
        them back (``finished_sending``) once every expected job has ended
        (:meth:`_settled`)."""
        job = self.jobs.get(jid)
        if job is None or job.prompt.src is None:
            return SourceFreed(jid, 0)
        return SourceFreed(jid, len(job.prompt.src))

    def _maybe_hand_back(self, prompt: Prompt) -> None:
        if prompt.src is not None:
            if prompt.all_ended:
                self._hand_back(prompt)
        elif prompt.unclaimed and set(prompt.jobs) <= prompt.ended:
            self._hand_back(prompt, handed_over=False)

    def _hand_back(self, prompt: Prompt, handed_over: bool = True) -> None:
        """``finished_sending`` for the prompt, once (none for one vLLM never handed
        over): it leaves :attr:`prompts` and its request and job ids are tombstoned (a
        late plan or abort finds them)."""
        if self.prompts.get(prompt.rid) is not prompt:
            return
        if prompt.hold is not None:
            prompt.hold.cancel()
        if handed_over:
            self.finished_sending.add(prompt.rid)
        del self.prompts[prompt.rid]
        now = self.clock.now()
        self.tombstones.tombstone(prompt.rid, now)
        for r in set(prompt.jobs) | set(prompt.owners or ()):
            self.tombstones.tombstone(job_id(prompt.rid, r), now)

    # ------------------------------------------------------------ the report (a port)
    def released(self, jid: str, pages: int, how: Release, justification: Proof) -> None:
        """Logged only: there is no router to tell, and vLLM learns of the blocks through
        ``finished_sending`` (:meth:`free`). A job whose request the scheduler never
        handed over (RELEASED with 0 pages) counts as ended: when, if ever, it is, its
        blocks go back at once."""
        log.debug(
            "request %s: %d source blocks released (%s; proof: %s)", jid, pages, how, justification
        )
