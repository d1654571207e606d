"""The writer's side of the abort protocol (a prefill rank), as data and one table.

A writer needs two things before it writes: the prompt's KV, computed into its own pages,
and the owner's plan of destination pages. It then posts one-sided writes in bounded
batches, and once every batch has landed sends its notice with a flush first, so the
notice arrives only after every byte is visible at the owner. A long prompt is pipelined:
while its KV is still being computed and the plan is whole, each part whose pages are final
is written as it is ready, and once its batches landed a NOTICE_PART (flush first) lets the
owner check those pages before the rest arrives. A part proves nothing about the writer's
later writes: only the whole notice (or an ack) does. On an abort it stops
posting, waits for what it has in flight, then acks with a flush first, and keeps its
source pages until that flush. This module decides;
:class:`kvferry.cluster.prefill.PrefillRank` carries out the effects. It does no I/O and
reads no clock.

An input becomes an event through one of the ``on_*`` functions (they keep the count of
batches in flight on the :class:`WriterBook`); :func:`step` moves the book by
:data:`WRITER_TABLE`.

Invariants held here: I2 (DONE and ABORTED have no way out; an abort of a forgotten
request finds ABORTED and only acks again; a rank forgets a request once it is DONE or
ABORTED and keeps its tombstone), I4 writer side (no ack is sent while a batch
is in flight: ABORT leads to DRAINING, and only DRAINED, the last batch settling, to
SEND_ACK; source pages are freed only after the ack's or the notice's flush completed, of
every job that holds them: a writer into a decode group shares one prompt's pages among
the jobs of the members it writes into; a flush that failed proves nothing: the notice's
fails the request; the ack's, which follows the drain, frees them as ``drained``, no
batch of the job left to read them, and the owner waits for this writer's end).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fastenum import IdentityEnum
from .table import Move, complete, render
from .table import step as table_step


class WriterState(IdentityEnum):
    NEW = "new"  # PREFILL or PLAN chunks arriving, neither whole
    PLANNED = "planned"  # the plan is whole, the prompt is not
    COMPUTING = "computing"  # the prompt is whole: its KV is being computed
    COMPUTING_PLANNED = "computing+planned"  # computing, the plan is whole: parts posted
    KV_READY = "kv-ready"  # KV computed (and checksummed), no plan yet
    WRITING = "writing"  # batches posted, in flight or queued
    NOTIFYING = "notifying"  # every batch landed: notice posted (flush, then send)
    DONE = "done"  # notice flushed; source pages freed
    DRAINING = "draining"  # aborted: nothing more posted, batches in flight
    ACKING = "acking"  # nothing in flight: ack posted (flush, then send)
    ABORTED = "aborted"  # ack flushed; source pages freed


class WriterEvent(IdentityEnum):
    PROMPT = "the prompt is whole and its source pages are allocated"
    PLAN = "the owner's plan is whole"
    KV_READY = "the prompt's KV is computed and checksummed"
    KV_PART = "more of the prompt's pages are final (every layer written); the plan is whole"
    PART_LANDED = "computing: the part's last batch landed, nothing in flight"
    NEXT_BATCH = "a batch landed and more are queued"
    BATCH_LANDED = "a batch landed; nothing queued, others still in flight"
    ALL_LANDED = "the last batch landed"
    NOTICE_FLUSHED = "the notice's flush completed"
    NOTICE_FAILED = "the notice's flush failed (no proof that its writes ended)"
    ABORT = "an ABORT while batches are in flight"
    ABORT_IDLE = "an ABORT with nothing in flight"
    FAIL = (
        "the writer fails (no pages, a write refused or failed, an internal error); "
        "batches in flight"
    )
    FAIL_IDLE = "the writer fails with nothing in flight"
    DRAINED = "aborted: the last batch in flight settled"
    ACK_FLUSHED = "the ack's flush completed"
    ACK_FAILED = "the ack's flush failed (no proof that its writes ended)"


class WriterDo(IdentityEnum):
    """What the writer's rank does for a move, in the table's order."""

    START_PREFILL = "compute the KV into the source pages, in slices; then KV_READY"
    POST_WRITES = "check the plan against the prompt, then post the first batch"
    POST_NEXT = "post the next batch (one at a time: an abort stops within one batch)"
    POST_PART = (
        "checksum the pages final since the last part and post them (when no part is in "
        "flight; else they go with the next)"
    )
    SEND_PART = "NOTICE_PART for the part that landed, with notify: flush, then send"
    SEND_NOTICE = "NOTICE (in chunks) with notify: flush, then send"
    STOP_POSTING = "drop the queue and cancel any pause: nothing more is posted"
    TOMBSTONE = "remember the id as ended: a late PREFILL or PLAN is ignored (I2)"
    TELL_ABORT = "ABORT to the router and the owner, with the writer's reason"
    SEND_ACK = "ABORT_ACK with notify (flush, then send); then ACK_FLUSHED, or ACK_FAILED"
    ACK_NOW = (
        "ABORT_ACK with notify, nothing kept until its flush (none of our pages hold "
        "this request's KV: never allocated, or freed after an earlier flush)"
    )
    FREE_SOURCE = (
        "end this job's hold on the source pages; once no job holds them, free them and "
        "RELEASED(freed after a notice, aborted after an ack)"
    )
    FREE_SOURCE_DRAINED = (
        "FREE_SOURCE after the drain, though the ack's flush failed (RELEASED says "
        "drained: no batch of the job reads the pages; that proves nothing to the owner)"
    )
    REPORT_NOTHING_HELD = "RELEASED(0 pages) to the router: its reservation here ends"


S, E, D = WriterState, WriterEvent, WriterDo

_UNSTARTED = (S.NEW, S.PLANNED)  # no source pages allocated yet
_COMPUTING = (S.COMPUTING, S.COMPUTING_PLANNED, S.KV_READY)
_STOP = (D.STOP_POSTING, D.TOMBSTONE)

WRITER_ROWS: dict[tuple[WriterState, WriterEvent], Move[WriterState, WriterDo]] = {
    (S.NEW, E.PROMPT): Move(S.COMPUTING, (D.START_PREFILL,)),
    (S.NEW, E.PLAN): Move(S.PLANNED),
    (S.PLANNED, E.PROMPT): Move(S.COMPUTING_PLANNED, (D.START_PREFILL,)),
    (S.COMPUTING, E.PLAN): Move(S.COMPUTING_PLANNED),
    (S.COMPUTING, E.KV_READY): Move(S.KV_READY),
    (S.COMPUTING_PLANNED, E.KV_READY): Move(S.WRITING, (D.POST_WRITES,)),
    # the pipelined path: parts written while the rest is computed
    (S.COMPUTING_PLANNED, E.KV_PART): Move(S.COMPUTING_PLANNED, (D.POST_PART,)),
    (S.COMPUTING_PLANNED, E.NEXT_BATCH): Move(S.COMPUTING_PLANNED, (D.POST_NEXT,)),
    (S.COMPUTING_PLANNED, E.BATCH_LANDED): Move(S.COMPUTING_PLANNED),
    (S.COMPUTING_PLANNED, E.PART_LANDED): Move(S.COMPUTING_PLANNED, (D.SEND_PART,)),
    (S.COMPUTING_PLANNED, E.ABORT): Move(S.DRAINING, _STOP),
    (S.COMPUTING_PLANNED, E.FAIL): Move(S.DRAINING, (*_STOP, D.TELL_ABORT)),
    (S.KV_READY, E.PLAN): Move(S.WRITING, (D.POST_WRITES,)),
    **{
        (s, E.ABORT_IDLE): Move(S.ABORTED, (D.TOMBSTONE, D.REPORT_NOTHING_HELD, D.ACK_NOW))
        for s in _UNSTARTED
    },
    **{
        (s, E.FAIL_IDLE): Move(
            S.ABORTED, (D.TOMBSTONE, D.TELL_ABORT, D.REPORT_NOTHING_HELD, D.ACK_NOW)
        )
        for s in _UNSTARTED
    },
    **{(s, E.ABORT_IDLE): Move(S.ACKING, (*_STOP, D.SEND_ACK)) for s in _COMPUTING},
    **{(s, E.FAIL_IDLE): Move(S.ACKING, (*_STOP, D.TELL_ABORT, D.SEND_ACK)) for s in _COMPUTING},
    (S.WRITING, E.NEXT_BATCH): Move(S.WRITING, (D.POST_NEXT,)),
    (S.WRITING, E.BATCH_LANDED): Move(S.WRITING),
    (S.WRITING, E.ALL_LANDED): Move(S.NOTIFYING, (D.SEND_NOTICE,)),
    (S.WRITING, E.ABORT): Move(S.DRAINING, _STOP),
    (S.WRITING, E.ABORT_IDLE): Move(S.ACKING, (*_STOP, D.SEND_ACK)),
    (S.WRITING, E.FAIL): Move(S.DRAINING, (*_STOP, D.TELL_ABORT)),
    (S.WRITING, E.FAIL_IDLE): Move(S.ACKING, (*_STOP, D.TELL_ABORT, D.SEND_ACK)),
    # tombstoned: a late ABORT (a decode group's, a client's during decode) finds the
    # request ended and is acked, where a fresh book would report nothing held and end the
    # reservation a group's other members still hold the prompt under
    (S.NOTIFYING, E.NOTICE_FLUSHED): Move(S.DONE, (D.TOMBSTONE, D.FREE_SOURCE)),
    # a failed flush proves nothing: the request fails, and the source pages wait for
    # the ack (freed after its flush, or as drained should that fail too)
    (S.NOTIFYING, E.NOTICE_FAILED): Move(S.ACKING, (*_STOP, D.TELL_ABORT, D.SEND_ACK)),
    (S.NOTIFYING, E.ABORT_IDLE): Move(S.ACKING, (*_STOP, D.SEND_ACK)),
    (S.NOTIFYING, E.FAIL_IDLE): Move(S.ACKING, (*_STOP, D.TELL_ABORT, D.SEND_ACK)),
    (S.DONE, E.ABORT_IDLE): Move(S.DONE, (D.ACK_NOW,)),
    (S.DRAINING, E.BATCH_LANDED): Move(S.DRAINING),
    (S.DRAINING, E.DRAINED): Move(S.ACKING, (D.SEND_ACK,)),
    (S.ACKING, E.ACK_FLUSHED): Move(S.ABORTED, (D.FREE_SOURCE,)),
    # the ack follows the drain: no batch reads the pages, and an owner that asks again
    # finds ABORTED (ACK_NOW); the owner's own proof is then this writer's end
    (S.ACKING, E.ACK_FAILED): Move(S.ABORTED, (D.FREE_SOURCE_DRAINED,)),
    (S.ABORTED, E.ABORT_IDLE): Move(S.ABORTED, (D.ACK_NOW,)),
}

WRITER_TABLE = complete(WriterState, WriterEvent, WRITER_ROWS)
"""Every (state, event) pair; those not in :data:`WRITER_ROWS` are ignored."""

UNSAFE_WRITER_TABLE = WRITER_TABLE
"""The writer has no broken mode of its own: ``--unsafe`` changes the owner's table."""


# ---------------------------------------------------------------------- the book
@dataclass
class WriterBook:
    """What the writer knows of one request; plain data."""

    rid: str
    state: WriterState = WriterState.NEW
    owner: int = -1  # the decode rank that owns the destination pages
    in_flight: int = 0  # batches posted and not yet settled


# ---------------------------------------------------------------------- inputs -> events
def on_posted(book: WriterBook) -> None:
    """A batch was posted."""
    book.in_flight += 1


def on_settled(book: WriterBook, ok: bool, queued: bool) -> WriterEvent:
    """A posted batch settled (``ok``: every write in it completed); ``queued``: batches
    of this request wait to be posted."""
    book.in_flight -= 1
    if book.state is WriterState.DRAINING:
        return WriterEvent.DRAINED if book.in_flight == 0 else WriterEvent.BATCH_LANDED
    if not ok:
        return on_failure(book)
    if queued:
        return WriterEvent.NEXT_BATCH
    if book.in_flight:
        return WriterEvent.BATCH_LANDED
    if book.state is WriterState.COMPUTING_PLANNED:  # a part, the rest not computed yet
        return WriterEvent.PART_LANDED
    return WriterEvent.ALL_LANDED


def on_abort(book: WriterBook) -> WriterEvent:
    return WriterEvent.ABORT if book.in_flight else WriterEvent.ABORT_IDLE


def on_failure(book: WriterBook) -> WriterEvent:
    return WriterEvent.FAIL if book.in_flight else WriterEvent.FAIL_IDLE


def step(
    book: WriterBook,
    event: WriterEvent,
    table: dict[tuple[WriterState, WriterEvent], Move[WriterState, WriterDo]] = WRITER_TABLE,
) -> Move[WriterState, WriterDo]:
    """Move ``book`` by ``table``; returns the entry (its effects are the rank's to do)."""
    return table_step(book, event, table)


def render_writer_table() -> str:
    return render(WRITER_TABLE, "The writer (prefill rank)")
