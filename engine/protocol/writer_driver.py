"""The writer's driver: the writer's table carried out, every effect in one place.

What each :class:`~.writer.WriterDo` means is written here once, as calls on the host's
ports (:mod:`.ports`): the service's prefill rank, the simulator's and the property walk's
fakes all run this same code. The host turns what arrives into events and feeds them;
the driver moves the job's book by the table (through the one :class:`~.driver.Driver`,
so an event an effect produces waits for the rest of its row) and does the row's effects.
What is decided here and not in a host: which release a freed source is (freed after the
notice, or aborted after the ack) and the proof it carries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import writer as core  # its on_* called through the module: a test may replace one
from .driver import TableDriver
from .ports import Clock, Report, SourcePages, Subject, Tombstones, WriterDataPath, WriterWire
from .proof import Proof
from .table import Move
from .words import AbortSource, Release
from .writer import WRITER_TABLE, WriterDo, WriterEvent, WriterState


@dataclass
class WriterPorts:
    """Everything the writer's effects touch, supplied by the host."""

    data: WriterDataPath
    wire: WriterWire
    source: SourcePages
    report: Report
    tombstones: Tombstones
    clock: Clock


Table = Mapping[tuple[WriterState, WriterEvent], Move[WriterState, WriterDo]]


class WriterDriver(TableDriver[WriterState, WriterEvent, WriterDo, Subject]):
    """Feeds a writer's jobs through ``table`` and carries out its effects on ``ports``.

    ``observe(job, event, before, move)`` and ``settled(job, move)`` are the
    :class:`~.driver.Driver`'s hooks (a host logs, forgets finished jobs, counts)."""

    def __init__(
        self,
        ports: WriterPorts,
        table: Table = WRITER_TABLE,
        *,
        observe: Callable[..., None] | None = None,
        settled: Callable[..., None] | None = None,
    ) -> None:
        self.ports = ports
        super().__init__(table, observe=observe, settled=settled)

    def fail(self, job: Subject, source: object, reason: str) -> None:
        """``job`` fails here for ``reason``: the table's FAIL or FAIL_IDLE."""
        job.abort_source, job.abort_reason = source, reason
        self.feed(job, core.on_failure(job.book))

    def notice_settled(self, job: Subject, flushed: bool, why: str) -> None:
        """The notice's flush settled: NOTICE_FLUSHED if it completed; else no proof that
        the writes ended, and the request fails (``why``, TRANSFER) by NOTICE_FAILED."""
        if flushed:
            self.feed(job, WriterEvent.NOTICE_FLUSHED)
            return
        job.abort_source, job.abort_reason = AbortSource.TRANSFER, why
        self.feed(job, WriterEvent.NOTICE_FAILED)

    def perform(self, do: WriterDo, job: Subject) -> None:
        """One effect of a row, through the ports."""
        p, D = self.ports, WriterDo
        rid, owner = job.rid, job.book.owner
        if do is D.START_PREFILL:
            p.data.start_prefill(job)
        elif do is D.POST_WRITES:
            p.data.post_writes(job)
        elif do is D.POST_NEXT:
            p.data.post_next(job)
        elif do is D.POST_PART:
            p.data.post_part(job)
        elif do is D.SEND_PART:
            p.data.send_part(job)
        elif do is D.SEND_NOTICE:
            p.data.send_notice(job)
        elif do is D.STOP_POSTING:
            p.data.stop_posting(job)
        elif do is D.TOMBSTONE:
            p.tombstones.tombstone(rid, p.clock.now())
        elif do is D.TELL_ABORT:
            p.wire.tell_abort(rid, owner, job.abort_source, job.abort_reason)
        elif do is D.SEND_ACK:  # the ack's flush settles as notice_settled's does
            E = WriterEvent  # a failed flush is no proof: ACK_FAILED
            p.wire.send_ack(
                rid, owner, lambda ok: self.feed(job, E.ACK_FLUSHED if ok else E.ACK_FAILED)
            )
        elif do is D.ACK_NOW:
            if owner >= 0:
                p.wire.send_ack(rid, owner, None)
        elif do in (D.FREE_SOURCE, D.FREE_SOURCE_DRAINED):
            freed = p.source.free(rid)
            if freed is None:  # another job still holds the pages: their release is its
                return
            how = Release.FREED if job.book.state is WriterState.DONE else Release.ABORTED
            p.report.released(
                freed.held_under,
                freed.pages,
                how,
                (Proof.OWN_FLUSH if do is D.FREE_SOURCE else Proof.DRAINED)
                if freed.pages
                else Proof.NOTHING_POSTED,
            )
        elif do is D.REPORT_NOTHING_HELD:
            p.report.released(rid, 0, Release.FREED, Proof.NOTHING_POSTED)
        else:  # pragma: no cover - the enum is closed
            raise AssertionError(f"request {rid}: no effect {do} in the writer's driver")
