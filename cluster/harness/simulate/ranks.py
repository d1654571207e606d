"""The simulated ranks: the real decode and prefill ranks over a simulated runtime.

A simulated writer is the service's own :class:`~kvferry.cluster.prefill.PrefillRank`
with its writer driver (:mod:`kvferry.engine.protocol.writer_driver`): every handler,
table step and effect is the service's code; only its data path differs
(:class:`SimWritePath`: the prompt arrives as a length, the prefill takes
``prefill_s``, and each batch is a simulated write of the writer's share of its pages,
sized by the real BatchSizer, settled and noticed by the service's own
:class:`~kvferry.cluster.prefill_path.WritePath`).

:class:`SimDecodeRank` is the service's :class:`~kvferry.cluster.decode.DecodeRank`,
every message handler and table step its own and its effects the owner driver's; the
methods overridden here are the ones that touch what is not simulated (the model, the KV
pool's bytes, the wall clock): ``__init__`` (no pool, model or canary table; the
simulated clock as its clock port; each release reported to the world), ``_observe``
(the abort timed from when the rank began handling it; the decoding batch counted; a
verified request's steps started), ``_verify_and_start`` (the I5 checks read page bytes:
here they take ``verify_s`` and pass, then decoding takes ``max_tokens`` steps of
``decode_step_s``, with TOKENS after the first step and at the end), ``stuck`` (counted,
not logged).

What they run on, :class:`SimRuntime`, stands in for
:class:`~kvferry.cluster.runtime.RankRuntime`: sends and writes go through the simulated
network, timers through the simulated clock. It keeps the runtime's own rules for what
arrives (duplicates dropped, a severed rank's messages dropped except ABORT_ACK), for
severing (no more sends but ABORT) and for proof (``write_path_closed``: a writer on this
host whose process is gone, ``DRAIN_S`` after it was seen gone).
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.cluster import messages as m
from kvferry.cluster.batching import BatchSizer
from kvferry.cluster.decode import DecodeRank, OwnedRequest
from kvferry.cluster.decode_path import CHECKSUM_SLICE_BYTES, VERIFY_SLICE_S, ReadPath
from kvferry.cluster.faults import GO, Decision, PointDecision
from kvferry.cluster.prefill import PrefillRank, WriteJob
from kvferry.cluster.prefill_path import COMPUTING, PREFILL_SLICE_S, WritePath
from kvferry.cluster.receive import Refusal, refusal
from kvferry.cluster.runtime import DRAIN_S, ControlCounters
from kvferry.engine.integrity import PageList
from kvferry.engine.protocol.owner import OwnerEvent, OwnerState
from kvferry.engine.protocol.proof import GoneFacts, Proof, gone_proof
from kvferry.engine.protocol.words import Kind
from kvferry.engine.protocol.writer import WriterEvent
from kvferry.transfer import BatchStatus, TransferError

from .service import Background, ServiceModel, slices_of
from .truth import WatchedAllocator

if TYPE_CHECKING:
    from .world import World


# ---------------------------------------------------------------------- messages
class SimMessage:
    """A decoded control message: the header and the kind's fields as attributes (a field
    left out is None, as the codec decodes an absent optional field)."""

    __slots__ = ("__dict__",)
    kind: str
    src: int
    inc: int
    seq: int

    def __init__(self, kind: str, src: int, inc: int, seq: int, fields: dict[str, Any]) -> None:
        d = self.__dict__
        d.update(_DEFAULTS[kind])
        d.update(fields)
        d["kind"], d["src"], d["inc"], d["seq"] = kind, src, inc, seq

    @property
    def fields(self) -> dict[str, Any]:
        return self.__dict__


_DEFAULTS: dict[str, dict[str, None]] = {
    k.name: dict.fromkeys(k.fields) for k in m.CODEC.kinds.values() if isinstance(k.name, str)
}
_KINDS = {k.name: k for k in m.CODEC.kinds.values() if isinstance(k.name, str)}


def _encode(kind: str, fields: dict[str, Any]) -> bytes | None:
    """The real codec's bytes for a simulated message (calibration only); None for one
    whose simulated fields the codec refuses."""
    k = _KINDS[kind]
    try:
        return m.encode(k.make(**{f: fields.get(f) for f in ("src", "inc", "seq", *k.fields)}))
    except Exception:
        return None


class SimBatch:
    """What a send, a notify or a write returns: it settles once, then calls whoever
    watches it (as a transfer batch does)."""

    __slots__ = ("_status", "callbacks", "error")

    def __init__(self) -> None:
        self._status = BatchStatus.PENDING
        self.error: str | None = None
        self.callbacks: list[Callable[[SimBatch], None]] = []

    def status(self) -> BatchStatus:
        return self._status

    def peek(self) -> BatchStatus:
        return self._status

    def reading(self) -> bool:  # a simulated write reads nothing once settled
        return False

    @property
    def done(self) -> bool:
        return self._status is not BatchStatus.PENDING

    def settle(self, ok: bool, error: str | None = None) -> None:
        self._status = BatchStatus.COMPLETED if ok else BatchStatus.FAILED
        self.error = error
        callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            cb(self)


def settled_batch() -> SimBatch:
    b = SimBatch()
    b._status = BatchStatus.COMPLETED
    return b


@dataclass(frozen=True)
class SimCard:
    """What a rank knows of another (the rendezvous card's fields the ranks read)."""

    rank: int
    role: str
    host: int
    incarnation: int


class SimFaults:
    """The fault hooks the ranks ask (kvferry.cluster.faults.FaultHooks): nothing is
    injected, except a pause before the first write of the requests in ``pause_before_write``
    (bench-abort's ``at:before-write:pause``, for the validation)."""

    swallow_errors = False

    def __init__(self) -> None:
        self.pause_before_write: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return False

    def raise_at(self, point: str, label: str) -> None:
        return None

    def at_point(self, point: str, rid: str, tokens: Any) -> PointDecision:
        if point == "before-write" and rid in self.pause_before_write:
            return PointDecision(Decision.PAUSE, self.pause_before_write.pop(rid))
        return GO

    def forget(self, rid: str) -> None:
        return None


@dataclass
class SimPool:
    """The pool figures the ranks read (no bytes)."""

    num_pages: int
    page_size: int
    page_bytes: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


# ---------------------------------------------------------------------- the runtime
class SimRuntime:
    """RankRuntime's interface over the simulated clock and network."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.clock = world.clock
        self.cards = world.cards
        self.faults = world.faults
        self.counters = ControlCounters()
        self.incarnation = world.cards[rank].incarnation
        self._seq = itertools.count(1)
        self._severed: dict[int, int] = {}
        self._gone_since: dict[int, float] = {}
        self._twins: set[tuple[int, int]] = set()
        self._handlers: dict[str, Callable[..., Any]] = {}
        self.on_send_failure: Callable[[int, Exception], None] = lambda rank, exc: None
        self.on_request_error: Callable[[str, str], None] = lambda rid, reason: None
        # The service model (.service): None runs every event the instant it arrives.
        self.svc: ServiceModel | None = world.sc.service
        self.role = world.cards[rank].role
        self.bg = Background()
        self.worker: Any = None  # the rank's DecodeRank or PrefillRank (in_flight)
        self._rng = random.Random(world.sc.seed * 104_729 + rank)
        self._queue: deque[tuple[bool, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._serving = False
        self._last_done = -1.0
        self.started = 0.0  # when the event being handled began its service
        self.busy_s = 0.0  # time spent handling events
        msg = self.svc.message.get(self.role) if self.svc is not None else None
        self._msg_draw = msg.draw if msg is not None else None

    # -------------------------------------------------------------- running
    def gate(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` as this rank (a timer, a callback): never once its process is gone;
        after a stall; with the service model, once the rank is free."""
        self._enter(False, fn, args)

    def http(self, fn: Callable[..., Any], *args: Any) -> None:
        """An event of the router's HTTP front door (a request, a client gone): handled
        on the router's loop as a message is."""
        self._enter(True, fn, args)

    def _enter(self, message: bool, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        world = self.world
        if self.rank in world.crashed:
            return
        until = world.stalled_until.get(self.rank)
        if until is not None and until > self.clock.now:
            self.clock.at(until, self._enter, message, fn, args)
            return
        if self.svc is None:
            fn(*args)
            return
        self._queue.append((message, fn, args))
        if self._serving:
            return
        self._serving = True
        now = self.clock.now
        start = self.bg.free_at(now)
        if self._asleep(now):
            wake = self.svc.wake_router if self.role == "router" else self.svc.wake_worker
            start = max(start, now + wake.draw(self._rng))
        if start > now:
            self.clock.at(start, self._next)
        else:
            self._next()

    def _asleep(self, now: float) -> bool:
        """The rank sleeps on its event fd: the router between events; a worker with
        nothing in flight once its busy-poll window passed."""
        if self.role == "router":
            return True
        if now - self._last_done <= self.svc.idle_after_s or self.bg.active(now):  # type: ignore[union-attr]
            return False
        w = self.worker
        return w is None or not w.in_flight()

    def _next(self) -> None:
        """The rank is free: handle the head of its queue."""
        queue, clock = self._queue, self.clock
        until = self.world.stalled_until.get(self.rank)
        if until is not None and until > clock.now and queue:
            clock.at(until, self._next)  # stalled meanwhile: the queue waits for it
            return
        while queue:
            if self.rank in self.world.crashed:
                queue.clear()
                break
            message, fn, args = queue.popleft()
            self.started = clock.now
            if message and self._msg_draw is not None:
                s = self._msg_draw(self._rng)
                self.busy_s += s
                clock.after(s, self._finish, fn, args)
                return
            fn(*args)
            s = self.svc.callback_s  # type: ignore[union-attr]
            if s > 0:
                self.busy_s += s
                clock.after(s, self._next)
                return
        self._serving = False
        now = clock.now
        self._last_done = now
        self.bg.resume(now)

    def began(self) -> float:
        """When the event being handled began (its service's start; now without the
        model): the real handler stamps its times after decoding the message."""
        return self.started if self.svc is not None else self.clock.now

    def _finish(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        world = self.world
        if self.rank in world.crashed:
            self._queue.clear()
            self._serving = False
            return
        until = world.stalled_until.get(self.rank)
        if until is not None and until > self.clock.now:
            self.clock.at(until, self._finish, fn, args)
            return
        fn(*args)
        self._next()

    def call_later(self, delay_s: float, fn: Callable[[], None], rid: str | None = None) -> Any:
        return self.clock.after(delay_s, self.gate, fn)

    def defer(self, fn: Callable[[], None], rid: str | None = None) -> None:
        self.clock.at(self.clock.now, self.gate, fn)

    def watch(self, batch: SimBatch, callback: Callable[[Any], None], rid: str | None = None):
        if batch.done:
            self.clock.at(self.clock.now, self.gate, callback, batch)
        else:
            batch.callbacks.append(lambda b: self.gate(callback, b))

    def run_for(self, rid: str | None, what: str, fn: Callable[[], None]) -> None:
        fn()

    def set_handlers(self, handlers: Mapping[Kind, Callable[..., Any]], role: str) -> None:
        self._handlers = {str(k): fn for k, fn in handlers.items()}

    # -------------------------------------------------------------- severing, proof
    def is_severed(self, rank: int) -> bool:
        return self._severed.get(rank) == self.cards[rank].incarnation

    def sever(self, rank: int, reason: str) -> None:
        if self.is_severed(rank):
            return
        self._severed[rank] = self.cards[rank].incarnation
        self.counters.severed += 1
        self.world.on_sever(self.rank, rank)

    def write_path_closed(self, rank: int, incarnation: int | None = None) -> Proof | None:
        """As RankRuntime.write_path_closed, from the simulated world's facts, judged by
        the same rule (:func:`kvferry.engine.protocol.gone_proof`): a crashed rank on
        this host is gone once ``DRAIN_S`` passed since it was first seen gone; on
        another host only with its launcher's exit record (published as the process
        dies), once the drain and the transport's failure horizon passed."""
        if rank not in self.world.crashed:
            return None
        same_host = self.cards[rank].host == self.cards[self.rank].host
        if not same_host and not self.world.exit_records:
            return None
        seen = self._gone_since.setdefault(rank, self.clock.now)
        facts = GoneFacts(
            same_host=same_host,
            process_gone=same_host,
            exit_record=not same_host,
            gone_for_s=self.clock.now - seen,
            drain_s=DRAIN_S,
            horizon_s=self.world.net.cfg.failure_horizon_s,
        )
        return gone_proof(facts)

    # -------------------------------------------------------------- sending
    def send(self, rank: int, kind: Any, **fields: Any) -> SimBatch | None:
        return self._deliver(rank, kind.name, fields)

    def notify(self, rank: int, kind: Any, **fields: Any) -> SimBatch | None:
        """Flush, then send: the ranks notify only with nothing of theirs in flight to
        ``rank``, so the flush completes at once and the message goes as a send."""
        return self._deliver(rank, kind.name, fields)

    def _deliver(self, rank: int, kind: str, fields: dict[str, Any]) -> SimBatch | None:
        if self.is_severed(rank) and kind != Kind.ABORT:
            self._send_failed(rank, TransferError(f"rank {rank} is severed"))
            return None
        msg = SimMessage(kind, self.rank, self.incarnation, next(self._seq), fields)
        if self.world.profile is not None:
            _encode(kind, msg.fields)
        self.counters.sent += 1
        self.world.count_message(kind)
        dst = self.world.runtimes[rank]
        self.world.net.message(
            self.rank,
            rank,
            functools.partial(dst.receive, msg),
            functools.partial(self._send_failed, rank, TransferError(f"{kind} to {rank} lost")),
        )
        return settled_batch()

    def _send_failed(self, rank: int, exc: Exception) -> None:
        self.counters.send_failures += 1
        if self.rank not in self.world.crashed:
            self.on_send_failure(rank, exc)

    def write(self, rank: int, rid: str, pages: PageList, generation: int, nbytes: int):
        """Post a one-sided write of ``nbytes`` into ``pages`` of ``rank``'s pool."""
        return self.world.post_write(self.rank, rank, rid, pages, generation, nbytes)

    # -------------------------------------------------------------- receiving
    def receive(self, msg: SimMessage, twinned: bool) -> None:
        self._enter(True, self._on_payload, (msg, twinned))

    def _on_payload(self, msg: SimMessage, twinned: bool) -> None:
        src = msg.src
        why = refusal(msg.kind, msg.inc, self.cards[src].incarnation, self.is_severed(src))
        if why is Refusal.STALE:
            self.counters.dropped_stale += 1
            return
        if why is Refusal.SEVERED:
            self.counters.dropped_severed += 1
            return
        if twinned:  # the network delivers this message twice: drop the second (by seq)
            key = (src, msg.seq)
            if key in self._twins:
                self._twins.discard(key)
                self.counters.dropped_duplicate += 1
                return
            self._twins.add(key)
        self.counters.received += 1
        handler = self._handlers.get(msg.kind)
        if handler is None:
            self.counters.dropped_unexpected += 1
            return
        profile = self.world.profile
        if profile is None:
            handler(msg)
            return
        # calibration: the real codec's decode of this message, and the handler (whose
        # sends encode theirs, see _deliver)
        data = _encode(msg.kind, msg.fields)
        t0 = time.perf_counter()
        if data is not None:
            m.decode(data)
        handler(msg)
        profile[self.role].append(time.perf_counter() - t0)


# ---------------------------------------------------------------------- the owner
@dataclass(frozen=True)
class RankTimes:
    """The work the simulator does not run, as durations."""

    prefill_tokens_per_s: float = 20_000.0  # one prefill rank (its share of the heads)
    decode_step_s: float = 0.025  # one decode step (one token of every running stream)
    verify_gbps: float = 200.0  # the I5 checksums over the pages that landed
    decode_step_per_seq_s: float = 0.0  # a step's extra for each request in the batch
    prefill_base_s: float = 0.0  # a prefill's cost besides its tokens
    prefill_layers: int = 1  # model steps a prefill yields between (its slices)
    max_batch: int = 64  # DecodeRank.max_batch

    def decode_step(self, batch: int) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * min(max(1, batch), self.max_batch)

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + tokens / self.prefill_tokens_per_s


class _WorldClock:
    """The simulated world's clock, as the ranks' clock port."""

    def __init__(self, runtime: SimRuntime) -> None:
        self._clock = runtime.world.clock

    def now(self) -> float:
        return self._clock.now


class SimReadPath(ReadPath):
    """The owner's data path in the simulated world: the I5 checks take ``verify_s``
    (occupying the rank, in slices, when the service model is on) and pass, then the
    request sends the first token its prefill computed at once and decodes the other
    ``max_tokens - 1`` in steps of ``decode_step_s`` (the batch the rank steps counted),
    with TOKENS at the end. An abort's clock starts when the rank began handling it (the
    service model)."""

    def __init__(
        self, runtime: SimRuntime, pool: SimPool, router: int, times: RankTimes, *, unsafe: bool
    ) -> None:
        self.rt = runtime
        self.sim = runtime
        self.pool = pool
        self.router = router
        self.times = times
        self.unsafe = unsafe
        self.clock = _WorldClock(runtime)
        self._decoding = 0  # requests in DECODING: the batch the rank steps

    @property
    def now(self) -> float:
        return self.sim.clock.now

    def stamp(self, req: OwnedRequest) -> None:
        pass  # no page bytes: the world's truth tracks every page's writer instead

    def event_time(self) -> float:
        return self.sim.began()

    def moved(self, req: OwnedRequest, before: OwnerState) -> None:
        after = req.book.state
        if (before is OwnerState.DECODING) == (after is OwnerState.DECODING):
            return
        self._decoding += 1 if after is OwnerState.DECODING else -1
        if self.sim.svc is not None:
            n = self._decoding
            self.sim.bg.stepping(self.now, self.times.decode_step(n) if n else None)

    def start_decode(self, req: OwnedRequest) -> None:
        self._first_token(req)

    def verify(self, req: OwnedRequest) -> None:
        req.transfer_ms = 1e3 * (self.now - req.planned_at)
        times = [n.prefill_ms for n in req.notices.values() if n.prefill_ms is not None]
        req.prefill_ms = max(times) if times else None
        if self.unsafe:
            self._verified(req)
            return
        nbytes = len(req.grants) * self.pool.page_bytes
        seconds = nbytes / (self.times.verify_gbps * 1e9)
        if self.sim.svc is not None:  # the checks occupy the rank, in slices
            piece = max(VERIFY_SLICE_S, CHECKSUM_SLICE_BYTES / (self.times.verify_gbps * 1e9))
            seconds = self.sim.bg.compute(self.now, seconds, piece) - self.now
        self.rt.call_later(seconds, lambda: self._verified(req))

    def _verified(self, req: OwnedRequest) -> None:
        if req.state is not OwnerState.VERIFYING:
            return  # aborted meanwhile: the rest of the checks never run
        self.driver.feed(req, OwnerEvent.VERIFIED)  # DECODING: the first token, then steps

    def _first_token(self, req: OwnedRequest) -> None:
        if req.state is not OwnerState.DECODING:
            return
        req.generated.append(0)
        self.rt.send(self.router, m.TOKENS, rid=req.rid, offset=0, tokens=[0])
        rest = req.max_tokens - 1
        if rest <= 0:
            self.driver.feed(req, OwnerEvent.FINISHED)
            return
        step = self.times.decode_step(self._decoding)
        self.rt.call_later(rest * step, lambda: self._last_tokens(req))

    def _last_tokens(self, req: OwnedRequest) -> None:
        if req.state is not OwnerState.DECODING:
            return
        rest = req.max_tokens - len(req.generated)
        req.generated.extend([0] * rest)
        self.rt.send(self.router, m.TOKENS, rid=req.rid, offset=1, tokens=[0] * rest)
        self.driver.feed(req, OwnerEvent.FINISHED)


def sim_decode_rank(
    runtime: SimRuntime, pool: SimPool, router: int, times: RankTimes, **options: Any
) -> DecodeRank:
    """The service's owner over the simulated runtime and :class:`SimReadPath`: the
    world's allocator (which checks every page against the truth) and its report of
    every release. ``options`` are DecodeRank's own (deadlines, the broken modes)."""
    world = runtime.world
    unsafe = bool(options.get("unsafe", False))
    path = SimReadPath(runtime, pool, router, times, unsafe=unsafe)
    allocator = WatchedAllocator(
        pool.num_pages, unsafe=unsafe, truth=world.truth, rank=runtime.rank, clock=world.clock
    )
    rank = DecodeRank(
        runtime,  # type: ignore[arg-type]
        path,
        pool,
        router,
        clock=path.clock,
        allocator=allocator,
        **options,
    )
    rank.on_release = functools.partial(world.on_owner_release, runtime.rank)
    rank.on_stuck = lambda req, waited_s: world.count("stuck_warnings")
    runtime.worker = rank
    return rank


# ---------------------------------------------------------------------- the writer
class SimWritePath(WritePath):
    """The writer's data path in the simulated world: the prompt arrives as a length,
    the prefill takes ``times.prefill_s`` (occupying the rank, in slices, when the
    service model is on), and each batch is a simulated write of this writer's share of
    its pages. The plan's check, batch sizing (the real BatchSizer, one batch at a
    time), the settling of batches and the notice are the service's own
    (:class:`~kvferry.cluster.prefill_path.WritePath`)."""

    def __init__(
        self,
        runtime: SimRuntime,
        pool: SimPool,
        tp: int,
        times: RankTimes,
        *,
        batch_target_s: float,
        max_batch_bytes: int,
    ) -> None:
        self.rt = runtime
        self.sim = runtime
        self.pool = pool
        self.times = times
        self.clock = _WorldClock(runtime)
        self.row_bytes = pool.page_bytes // tp  # this writer's heads of one page
        self.batches = BatchSizer(target_s=batch_target_s, max_bytes=max_batch_bytes)

    @property
    def now(self) -> float:
        return self.sim.clock.now

    def take_prompt(self, job: WriteJob, msg: Any) -> bool:
        job.tokens = np.empty(msg.total, dtype=np.int32)  # one chunk: the prompt's length
        return True

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.page_size)

    def start_prefill(self, job: WriteJob) -> None:
        job.prefill_started = self.now
        assert job.tokens is not None
        seconds = self.times.prefill_s(len(job.tokens))
        if self.sim.svc is not None:  # the compute occupies the rank, in slices, FIFO
            piece = slices_of(seconds, self.times.prefill_layers, PREFILL_SLICE_S)
            seconds = self.sim.bg.compute(self.now, seconds, piece) - self.now

        def done() -> None:
            if job.state not in COMPUTING:
                return  # aborted meanwhile: nothing more is computed
            job.prefill_ms = 1e3 * (self.now - job.prefill_started)
            self.driver.feed(job, WriterEvent.KV_READY)

        self.rt.call_later(seconds, done, rid=job.rid)

    def post_writes(self, job: WriteJob) -> None:
        if not self._plan_covers(job):
            return
        job.sent_pages = len(job.src_pages)
        job.posted_bytes = job.sent_pages * self.row_bytes
        job.queue = np.arange(job.sent_pages, dtype=np.int64)  # page indices to write
        self._post_next(job)

    def _batch_bytes(self, rows: np.ndarray) -> int:
        return len(rows) * self.row_bytes

    def _post(self, job: WriteJob, rows: np.ndarray) -> Any:
        assert job.dst_pages is not None and job.dst_generations is not None
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        return self.sim.write(
            job.owner,
            job.rid,
            job.dst_pages[lo:hi],
            job.dst_generations[lo],
            self._batch_bytes(rows),
        )


def sim_prefill_rank(
    runtime: SimRuntime,
    pool: SimPool,
    tp: int,
    router: int,
    times: RankTimes,
    *,
    batch_target_s: float,
    max_batch_bytes: int,
) -> PrefillRank:
    """The service's PrefillRank over the simulated runtime and :class:`SimWritePath`."""
    path = SimWritePath(
        runtime, pool, tp, times, batch_target_s=batch_target_s, max_batch_bytes=max_batch_bytes
    )
    rank = PrefillRank(runtime, path, pool, router=router, clock=path.clock)  # type: ignore[arg-type]
    runtime.worker = rank
    return rank
