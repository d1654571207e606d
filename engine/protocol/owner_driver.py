"""The owner's driver: the owner's table carried out, every effect in one place.

What each :class:`~.owner.OwnerDo` means is written here once, as calls on the host's
ports (:mod:`.ports`), together with the owner's own timers (the transfer timeout, the
retry that asks silent writers again, the abort deadline, the search for proof), whose
firing is turned into the table's events here too. The service's decode rank and the
simulator's run this same code; the host turns messages into events and supplies its
pages, its data path, its wire and what it knows of writers' processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import owner as core  # its on_* called through the module: a test may replace one
from .driver import TableDriver
from .owner import OwnerDo, OwnerEvent, OwnerState
from .ports import (
    Clock,
    OwnerDataPath,
    OwnerPages,
    OwnerReport,
    OwnerWire,
    Subject,
    Timers,
    Tombstones,
    WriterFacts,
)
from .table import Move
from .words import AbortSource, Outcome, Release

TIMEOUT_TOKENS = 1 << 16  # the transfer timeout applies per this many prompt tokens
PROOF_CHECK_S = 0.05  # how often a fenced request looks for its proof
SEVERED_RETRY_S = 1.0  # how often a severed writer is asked again (it may come back)
STUCK_DEADLINES = 10  # a fenced request is said to be stuck after this many deadlines


@dataclass(frozen=True)
class OwnerTimes:
    """The owner's deadlines, in seconds."""

    transfer_timeout_s: float
    abort_deadline_s: float

    def transfer_timeout_for(self, prompt_len: int) -> float:
        """How long the owner waits for every writer's notice: ``transfer_timeout_s`` per
        ``TIMEOUT_TOKENS`` prompt tokens (at least once), since the prefill, checksums and
        copy of a long prompt take time in proportion to it."""
        return self.transfer_timeout_s * max(1, -(-prompt_len // TIMEOUT_TOKENS))

    def retry_every(self, a_writer_severed: bool) -> float:
        """How often silent writers are asked again: an eighth of the deadline, so a
        lost ABORT or ABORT_ACK costs a retry and not the deadline; a severed writer
        (a partition, a stalled process) once a second."""
        return SEVERED_RETRY_S if a_writer_severed else max(0.05, self.abort_deadline_s / 8)


@dataclass
class OwnerPorts:
    """Everything the owner's effects touch, supplied by the host."""

    wire: OwnerWire
    pages: OwnerPages
    facts: WriterFacts
    data: OwnerDataPath
    report: OwnerReport
    tombstones: Tombstones
    timers: Timers
    clock: Clock
    times: OwnerTimes


Table = Mapping[tuple[OwnerState, OwnerEvent], Move[OwnerState, OwnerDo]]
HELD = (OwnerState.QUARANTINED, OwnerState.FENCED, OwnerState.CLOSED)  # the abort is timed
# the events that are an abort's first sign: a host starts the abort's clock on one
ABORT_EVENTS = frozenset(
    {
        OwnerEvent.ABORT,
        OwnerEvent.ABORT_TOLD,
        OwnerEvent.ABORT_FLUSHED,
        OwnerEvent.FAIL,
        OwnerEvent.FAIL_FLUSHED,
    }
)


class OwnerDriver(TableDriver[OwnerState, OwnerEvent, OwnerDo, Subject]):
    """Feeds an owner's requests through ``table`` and carries out its effects on
    ``ports``. ``observe`` and ``settled`` are the :class:`~.driver.Driver`'s hooks."""

    def __init__(
        self,
        ports: OwnerPorts,
        table: Table,
        *,
        observe: Callable[..., None] | None = None,
        settled: Callable[..., None] | None = None,
    ) -> None:
        self.ports = ports
        super().__init__(table, observe=observe, settled=settled)

    def abort(self, req: Subject, event: OwnerEvent, source: AbortSource, reason: str) -> None:
        """Feed ``event``, an abort's, with its words (the first abort's words stay once
        the pages are held)."""
        if req.book.state not in HELD:
            req.abort_source, req.abort_reason = source, reason
        self.feed(req, event)

    # -------------------------------------------------------------- effects
    def perform(self, do: OwnerDo, req: Subject) -> None:
        """One effect of a row, through the ports."""
        p, D, rid = self.ports, OwnerDo, req.rid
        if do is D.STAMP_CANARIES:
            p.pages.stamp_canaries(req)
        elif do is D.SEND_PLAN:
            p.wire.send_plan(req)
        elif do is D.ARM_TRANSFER_TIMER:
            req.timer = p.timers.call_later(
                p.times.transfer_timeout_for(req.prompt_len),
                lambda: self.transfer_timeout(req),
                rid=rid,
            )
        elif do is D.CANCEL_TIMER:
            if req.timer is not None:
                req.timer.cancel()
        elif do is D.VERIFY:
            p.data.verify(req)
        elif do is D.VERIFY_PARTS:
            p.data.verify_parts(req)
        elif do is D.START_DECODE:
            p.data.start_decode(req)
        elif do is D.TOMBSTONE:
            p.tombstones.tombstone(rid, p.clock.now())
        elif do is D.REPORT_FAILED:
            p.report.done(req, Outcome.FAILED)
        elif do is D.REPORT_FINISHED:
            p.report.done(req, Outcome.FINISHED)
        elif do is D.ABORT_WRITERS:
            writers = list(req.writers)
            why = req.error or "no decode pages"
            p.wire.tell_abort(rid, writers, writers, AbortSource.DECODE, why)
        elif do is D.REPORT_NOTHING_HELD:
            p.report.nothing_held(rid)
        elif do is D.FREE:
            p.report.closed(req, p.pages.free(rid), req.book.free_reason())
        elif do is D.QUARANTINE:
            p.pages.quarantine(req)
        elif do is D.ASK_ACKS:
            # a restarted writer's new incarnation cannot ack for the old one
            ask = [w for w in req.book.pending() if not p.facts.restarted_since(req, w)]
            p.wire.tell_abort(rid, ask, list(req.writers), req.abort_source, req.abort_reason)
        elif do is D.ARM_RETRY:
            self.arm_retry(req)
        elif do is D.ARM_DEADLINE:
            req.timer = p.timers.call_later(
                p.times.abort_deadline_s,
                lambda: self.feed(req, core.on_deadline(req.book)),
                rid=rid,
            )
        elif do is D.SEVER_PENDING:
            self.sever(req)
        elif do is D.CHECK_PROOF:
            self.check_proof(req)
        elif do is D.ARM_PROOF_CHECK:
            waited = p.clock.now() - req.abort_started
            if waited > p.times.abort_deadline_s * STUCK_DEADLINES and not req.warned:
                req.warned = True
                p.report.stuck(req, waited)
            p.timers.call_later(PROOF_CHECK_S, lambda: self.check_proof(req), rid=rid)
        elif do is D.RELEASE_ACKED:
            p.report.closed(req, p.pages.release(rid), Release.ACKED)
        elif do is D.RELEASE_SEVERED:
            p.report.closed(req, p.pages.release(rid), Release.SEVERED)
        elif do is D.RELEASE_UNSAFE:  # the broken mode: whatever the pages' state
            pages = p.pages.release(rid) if p.pages.quarantined(rid) else p.pages.free(rid)
            p.report.closed(req, pages, Release.UNSAFE)
        elif do is D.COUNT_INTEGRITY:
            p.report.integrity_failure(req)
        else:  # pragma: no cover - the enum is closed
            raise AssertionError(f"request {rid}: no effect {do} in the owner's driver")

    # -------------------------------------------------------------- timers
    def transfer_timeout(self, req: Subject) -> None:
        """The transfer timer: a request still awaiting notices fails."""
        if req.book.state is not OwnerState.AWAITING:
            return
        times = self.ports.times
        missing = sorted(set(req.writers) - set(req.notices))
        reason = (
            f"no completion notice from writer ranks {missing} within "
            f"{times.transfer_timeout_for(req.prompt_len):.1f} s "
            f"({times.transfer_timeout_s:.1f} s per {TIMEOUT_TOKENS} prompt tokens)"
        )
        req.error = f"transfer timeout: {reason}"
        self.abort(req, core.on_failure(req.book), AbortSource.TRANSFER, reason)

    def arm_retry(self, req: Subject) -> None:
        """Ask every writer that has not acked again after a while, for as long as the
        pages are held: a lost ABORT or ABORT_ACK costs a retry, not the deadline, and a
        severed writer that comes back (a healed partition, a resumed process) still
        learns to ack."""
        p = self.ports
        severed = any(p.facts.is_severed(w) for w in req.book.pending())
        p.timers.call_later(p.times.retry_every(severed), lambda: self.retry(req), rid=req.rid)

    def retry(self, req: Subject) -> None:
        """The retry timer; a quarantined request whose silent writers are all gone is
        fenced at once (see ``owner.on_retry``)."""
        gone = (
            self.ports.facts.proven_gone(req, req.book.pending())
            if req.book.state is OwnerState.QUARANTINED
            else {}
        )
        self.feed(req, core.on_retry(req.book, gone))

    def check_proof(self, req: Subject) -> None:
        """Release once no write from any severed writer can land (I4): each one either
        acked after all (its ack follows its flush) or its process is gone. Until then the
        pages stay quarantined, counted as used."""
        if req.book.state is not OwnerState.FENCED:
            return
        gone = self.ports.facts.proven_gone(req, req.book.fenced)
        self.feed(req, core.on_proof_check(req.book, gone))

    def sever(self, req: Subject) -> None:
        """Every writer the deadline fenced is severed (its old incarnation, if it
        restarted meanwhile, is gone already: its proof is its exit)."""
        p = self.ports
        waited = p.clock.now() - req.abort_started
        deadline = p.times.abort_deadline_s
        if waited < deadline:  # fenced early: every silent writer is gone
            why = f"gone {waited:.1f} s into the {deadline:.1f} s abort deadline"
        else:
            why = f"no ABORT_ACK within {deadline:.1f} s"
        fenced = sorted(req.book.fenced)
        p.wire.sever(
            req.rid, fenced, [w for w in fenced if not p.facts.restarted_since(req, w)], why
        )
