"""The owner's side of the abort protocol (a decode rank), as data and one table.

The owner allocates a request's pages, tells every writer where to write, and takes the
pages as the request's own only once every writer's notice is whole (each notice follows
that writer's flush). An abort while a writer may still write quarantines the pages; they
are released only on proof that no write can land: every writer noticed or acked (both
follow a flush), or, for a writer severed at the abort deadline, an ack after all or its
process gone. This module decides; :class:`kvferry.cluster.decode.DecodeRank` carries out
the effects (sends, allocator calls, timers). It does no I/O and reads no clock, so tests
and a simulator drive it directly.

An input becomes an event through one of the ``on_*`` functions, which record what the
input proves (a writer flushed, acked) on the :class:`OwnerBook` and pick the event by
the facts the table cannot see (is every writer flushed?). :func:`step` then moves the
book by :data:`OWNER_TABLE`.

Invariants held here: I2 (CLOSED has no way out and every entry into it tombstones the id
or follows a tombstone), I4 (no entry from a state where a writer may still write leads to
a release except LAST_FLUSH and PROOF, whose conditions are exactly the proof).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..fastenum import IdentityEnum
from .proof import Proof, justification
from .table import Move, complete, render, replace
from .table import step as table_step
from .words import Release


class OwnerState(IdentityEnum):
    NEW = "new"  # ASSIGN arrived (or an ABORT for an unknown request)
    AWAITING = "awaiting"  # pages allocated, plan sent, waiting for every notice
    VERIFYING = "verifying"  # every notice whole: the I5 checks run (in slices)
    DECODING = "decoding"  # verified: decode steps read the pages
    QUARANTINED = "quarantined"  # aborted while a writer may write: pages held, acks asked
    FENCED = "fenced"  # past the abort deadline: silent writers severed, proof awaited
    CLOSED = "closed"  # pages freed or released; the id is tombstoned


class OwnerEvent(IdentityEnum):
    GRANTED = "the pages an ASSIGN needs were allocated"
    REFUSED = "the pool cannot hold the request (out of pages)"
    FLUSH = "a writer's notice chunk or ack that completes nothing"
    PART = (
        "a NOTICE_PART: a part of a writer's pages landed (later writes may still be in "
        "flight: it proves no flush of the writer's)"
    )
    ALL_NOTICED = "the chunk that makes every writer's notice whole"
    LAST_FLUSH = "quarantined: the notice or ack that makes every writer flushed"
    ABORT = "an ABORT from a rank other than the router; writers still pending"
    ABORT_TOLD = "the router's ABORT, or a writer's early ack: the writers were told already"
    ABORT_FLUSHED = "an abort of any origin when every writer has flushed"
    FAIL = "the owner fails the request (transfer timeout, internal error); writers pending"
    FAIL_FLUSHED = "the owner fails the request when every writer has flushed"
    VERIFIED = "the I5 checks passed"
    CORRUPT = "an I5 check failed: on arrival, or at a decode step's ownership check"
    CORRUPT_FLUSHED = "a part failed its I5 check when every writer has flushed"
    FINISHED = "the last token was generated"
    RETRY = "time to ask the writers that have not acked again"
    DEADLINE = "the abort deadline passed with writers still silent"
    PROOF = "every severed writer acked after all or its process is gone"
    NO_PROOF = "a severed writer is neither acked nor known gone yet"


class OwnerDo(IdentityEnum):
    """What the owner's rank does for a move, in the table's order."""

    STAMP_CANARIES = "write the request's canary into each allocated page's tag"
    SEND_PLAN = "PLAN (in chunks) to every writer"
    ARM_TRANSFER_TIMER = "the transfer timeout (per 65,536 prompt tokens)"
    CANCEL_TIMER = "cancel the transfer timeout"
    VERIFY = "run the I5 checks in slices, then VERIFIED or CORRUPT"
    VERIFY_PARTS = "check the pages of the parts that arrived, in slices; CORRUPT on a mismatch"
    START_DECODE = (
        "TOKENS with the prefill's first token to the router (FINISHED when it is the "
        "last), then decode steps"
    )
    TOMBSTONE = "remember the id as ended: a late ASSIGN or NOTICE is ignored (I2)"
    REPORT_FAILED = "DONE(failed, reason) to the router"
    REPORT_FINISHED = "the last TOKENS and DONE(finished) to the router"
    ABORT_WRITERS = "ABORT to every writer (refused, or aborted before the plan)"
    REPORT_NOTHING_HELD = "RELEASED(0 pages) to the router: its reservation here ends"
    FREE = "free the pages; RELEASED(freed, or acked when a writer acked rather than noticed)"
    QUARANTINE = "move the pages to quarantine: counted as used, never allocated"
    ASK_ACKS = "ABORT to every writer that has neither noticed nor acked"
    ARM_RETRY = "ask again after a while, for as long as the pages are held"
    ARM_DEADLINE = "the abort deadline"
    SEVER_PENDING = "sever every silent writer (no more plans to it) and tell the router"
    CHECK_PROOF = "ask whether each severed writer's process is gone: PROOF or NO_PROOF"
    ARM_PROOF_CHECK = "check for proof again after a while"
    RELEASE_ACKED = "release the quarantined pages; RELEASED(acked)"
    RELEASE_SEVERED = "release the quarantined pages; RELEASED(severed)"
    RELEASE_UNSAFE = "BROKEN MODE: free or release the pages without proof; RELEASED(unsafe)"
    COUNT_INTEGRITY = "count an integrity failure"


S, E, D = OwnerState, OwnerEvent, OwnerDo

_QUARANTINE = (D.TOMBSTONE, D.CANCEL_TIMER, D.QUARANTINE)
_GUARD = (D.ARM_RETRY, D.ARM_DEADLINE)

OWNER_ROWS: dict[tuple[OwnerState, OwnerEvent], Move[OwnerState, OwnerDo]] = {
    (S.NEW, E.GRANTED): Move(S.AWAITING, (D.STAMP_CANARIES, D.SEND_PLAN, D.ARM_TRANSFER_TIMER)),
    (S.NEW, E.REFUSED): Move(
        S.CLOSED, (D.TOMBSTONE, D.REPORT_FAILED, D.ABORT_WRITERS, D.REPORT_NOTHING_HELD)
    ),
    # Aborted before any page was allocated: no write can land here, so it closes at once;
    # writers it knows of and the abort did not reach are told to drop the request.
    (S.NEW, E.ABORT): Move(S.CLOSED, (D.TOMBSTONE, D.ABORT_WRITERS, D.REPORT_NOTHING_HELD)),
    (S.NEW, E.ABORT_TOLD): Move(S.CLOSED, (D.TOMBSTONE, D.REPORT_NOTHING_HELD)),
    (S.NEW, E.ABORT_FLUSHED): Move(S.CLOSED, (D.TOMBSTONE, D.REPORT_NOTHING_HELD)),
    (S.NEW, E.FAIL_FLUSHED): Move(S.CLOSED, (D.TOMBSTONE, D.REPORT_FAILED, D.REPORT_NOTHING_HELD)),
    (S.AWAITING, E.FLUSH): Move(S.AWAITING),
    (S.AWAITING, E.PART): Move(S.AWAITING, (D.VERIFY_PARTS,)),
    # a part failed its check while writers may still write: quarantined like a failure
    (S.AWAITING, E.CORRUPT): Move(
        S.QUARANTINED,
        (D.COUNT_INTEGRITY, D.REPORT_FAILED, *_QUARANTINE, D.ASK_ACKS, *_GUARD),
    ),
    # ... and once every writer flushed (a notice chunk of each came): nothing can land
    (S.AWAITING, E.CORRUPT_FLUSHED): Move(
        S.CLOSED, (D.COUNT_INTEGRITY, D.REPORT_FAILED, D.TOMBSTONE, D.CANCEL_TIMER, D.FREE)
    ),
    (S.AWAITING, E.ALL_NOTICED): Move(S.VERIFYING, (D.CANCEL_TIMER, D.VERIFY)),
    (S.AWAITING, E.ABORT): Move(S.QUARANTINED, (*_QUARANTINE, D.ASK_ACKS, *_GUARD)),
    (S.AWAITING, E.ABORT_TOLD): Move(S.QUARANTINED, (*_QUARANTINE, *_GUARD)),
    (S.AWAITING, E.ABORT_FLUSHED): Move(S.CLOSED, (D.TOMBSTONE, D.CANCEL_TIMER, D.FREE)),
    (S.AWAITING, E.FAIL): Move(S.QUARANTINED, (D.REPORT_FAILED, *_QUARANTINE, D.ASK_ACKS, *_GUARD)),
    (S.AWAITING, E.FAIL_FLUSHED): Move(
        S.CLOSED, (D.REPORT_FAILED, D.TOMBSTONE, D.CANCEL_TIMER, D.FREE)
    ),
    (S.VERIFYING, E.VERIFIED): Move(S.DECODING, (D.START_DECODE,)),
    (S.VERIFYING, E.CORRUPT): Move(
        S.CLOSED, (D.COUNT_INTEGRITY, D.REPORT_FAILED, D.TOMBSTONE, D.FREE)
    ),
    (S.VERIFYING, E.ABORT_FLUSHED): Move(S.CLOSED, (D.TOMBSTONE, D.FREE)),
    (S.VERIFYING, E.FAIL_FLUSHED): Move(S.CLOSED, (D.REPORT_FAILED, D.TOMBSTONE, D.FREE)),
    (S.DECODING, E.FINISHED): Move(S.CLOSED, (D.REPORT_FINISHED, D.TOMBSTONE, D.FREE)),
    (S.DECODING, E.CORRUPT): Move(
        S.CLOSED, (D.COUNT_INTEGRITY, D.REPORT_FAILED, D.TOMBSTONE, D.FREE)
    ),
    (S.DECODING, E.ABORT_FLUSHED): Move(S.CLOSED, (D.TOMBSTONE, D.FREE)),
    (S.DECODING, E.FAIL_FLUSHED): Move(S.CLOSED, (D.REPORT_FAILED, D.TOMBSTONE, D.FREE)),
    (S.QUARANTINED, E.FLUSH): Move(S.QUARANTINED),
    (S.QUARANTINED, E.LAST_FLUSH): Move(S.CLOSED, (D.RELEASE_ACKED,)),
    (S.QUARANTINED, E.RETRY): Move(S.QUARANTINED, (D.ASK_ACKS, D.ARM_RETRY)),
    (S.QUARANTINED, E.DEADLINE): Move(S.FENCED, (D.SEVER_PENDING, D.CHECK_PROOF)),
    (S.FENCED, E.FLUSH): Move(S.FENCED),
    (S.FENCED, E.RETRY): Move(S.FENCED, (D.ASK_ACKS, D.ARM_RETRY)),
    (S.FENCED, E.PROOF): Move(S.CLOSED, (D.RELEASE_SEVERED,)),
    (S.FENCED, E.NO_PROOF): Move(S.FENCED, (D.ARM_PROOF_CHECK,)),
}

OWNER_TABLE = complete(OwnerState, OwnerEvent, OWNER_ROWS)
"""Every (state, event) pair; those not in :data:`OWNER_ROWS` are ignored."""


def owner_table(
    *, unsafe: bool = False, release_on_sever: bool = False
) -> dict[tuple[OwnerState, OwnerEvent], Move[OwnerState, OwnerDo]]:
    """The table a rank runs. The two BROKEN MODES (each logged by the rank, each shown
    to leak by the fault suite and the spin model's mutants) are changed entries:
    ``unsafe`` frees an aborted request's pages at once; ``release_on_sever`` releases
    them at the abort deadline, on severing alone."""
    table = OWNER_TABLE
    if unsafe:
        table = replace(
            table,
            {
                (S.AWAITING, E.ABORT): Move(
                    S.CLOSED, (D.TOMBSTONE, D.CANCEL_TIMER, D.RELEASE_UNSAFE)
                ),
                (S.AWAITING, E.ABORT_TOLD): Move(
                    S.CLOSED, (D.TOMBSTONE, D.CANCEL_TIMER, D.RELEASE_UNSAFE)
                ),
                (S.AWAITING, E.FAIL): Move(
                    S.CLOSED, (D.REPORT_FAILED, D.TOMBSTONE, D.CANCEL_TIMER, D.RELEASE_UNSAFE)
                ),
                (S.AWAITING, E.CORRUPT): Move(
                    S.CLOSED,
                    (
                        D.COUNT_INTEGRITY,
                        D.REPORT_FAILED,
                        D.TOMBSTONE,
                        D.CANCEL_TIMER,
                        D.RELEASE_UNSAFE,
                    ),
                ),
            },
        )
    if release_on_sever:
        table = replace(
            table,
            {(S.QUARANTINED, E.DEADLINE): Move(S.CLOSED, (D.SEVER_PENDING, D.RELEASE_UNSAFE))},
        )
    return table


# ---------------------------------------------------------------------- the book
@dataclass
class OwnerBook:
    """What the owner knows of one request's writers; plain data."""

    rid: str
    writers: tuple[int, ...] = ()
    state: OwnerState = OwnerState.NEW
    noticed: set[int] = field(default_factory=set)  # sent a notice chunk: flushed
    whole: set[int] = field(default_factory=set)  # its notice is whole
    acked: set[int] = field(default_factory=set)  # acked an abort: flushed
    fenced: frozenset[int] = frozenset()  # severed at the abort deadline
    gone: dict[int, Proof] = field(default_factory=dict)  # silent writers proven gone, how

    def writers_done(self) -> bool:
        """Every writer noticed or acked: no write of this request can land any more."""
        return set(self.writers) <= (self.noticed | self.acked)

    def pending(self) -> list[int]:
        """The writers that have proven nothing yet."""
        return sorted(set(self.writers) - self.noticed - self.acked)

    def free_reason(self) -> Release:
        """FREE's word: ACKED when some writer acked instead of noticing."""
        return Release.ACKED if self.acked - self.noticed else Release.FREED

    def justification(self) -> str:
        """Why releasing the pages now is safe (see :func:`.proof.justification`):
        ``none`` unless every writer noticed, acked or was proven gone."""
        return justification(self.writers, self.noticed, self.acked, self.gone)


# ---------------------------------------------------------------------- inputs -> events
def on_assign(book: OwnerBook, writers: tuple[int, ...], granted: bool) -> OwnerEvent:
    book.writers = tuple(writers)
    return OwnerEvent.GRANTED if granted else OwnerEvent.REFUSED


def on_notice(book: OwnerBook, writer: int, whole: bool) -> OwnerEvent:
    """A chunk of ``writer``'s notice (``whole``: it completes that notice). Any chunk
    proves the writer flushed (it is sent after the flush of every write)."""
    book.noticed.add(writer)
    if whole:
        book.whole.add(writer)
    if book.state is OwnerState.AWAITING and whole and set(book.writers) <= book.whole:
        return OwnerEvent.ALL_NOTICED
    if book.state is OwnerState.QUARANTINED and book.writers_done():
        return OwnerEvent.LAST_FLUSH
    return OwnerEvent.FLUSH


def on_part(book: OwnerBook, writer: int) -> OwnerEvent:
    """A NOTICE_PART of ``writer``: its pages are to be checked now. It proves no flush
    (the writer may still be posting the rest), so nothing is recorded of the writer."""
    return OwnerEvent.PART


def on_ack(book: OwnerBook, writer: int, severed: bool) -> OwnerEvent:
    """``writer``'s ABORT_ACK (sent after its flush). Before the owner heard of the abort,
    it is the abort: a writer acks only an abort it was told of, and the router told the
    others in the same fan-out. A severed writer's ack while quarantined does not release
    at once: its proof is taken at the deadline, with the other severed writers'."""
    book.acked.add(writer)
    if book.state in (OwnerState.AWAITING, OwnerState.VERIFYING, OwnerState.DECODING):
        return on_abort(book, writers_told=True)
    if book.state is OwnerState.QUARANTINED and not severed and book.writers_done():
        return OwnerEvent.LAST_FLUSH
    return OwnerEvent.FLUSH


def on_abort(book: OwnerBook, writers_told: bool) -> OwnerEvent:
    """An abort; ``writers_told``: the router's fan-out (or a writer's own ack) reached
    the writers already, so asking them waits for the first retry."""
    if book.writers_done():
        return OwnerEvent.ABORT_FLUSHED
    return OwnerEvent.ABORT_TOLD if writers_told else OwnerEvent.ABORT


def on_part_corrupt(book: OwnerBook) -> OwnerEvent:
    """A part failed its check while the request awaits its notices."""
    return OwnerEvent.CORRUPT_FLUSHED if book.writers_done() else OwnerEvent.CORRUPT


def on_failure(book: OwnerBook) -> OwnerEvent:
    """The owner fails the request itself (its transfer timeout, an internal error)."""
    return OwnerEvent.FAIL_FLUSHED if book.writers_done() else OwnerEvent.FAIL


def on_deadline(book: OwnerBook) -> OwnerEvent:
    """The abort deadline: the writers still silent are the ones to sever."""
    book.fenced = frozenset(book.pending())
    return OwnerEvent.DEADLINE


def on_retry(book: OwnerBook, gone: Mapping[int, Proof]) -> OwnerEvent:
    """The retry timer. ``gone``: writers still silent proven gone, with the proof
    (:func:`.proof.gone_proof`). While quarantined, once every silent writer is gone no
    ack can come, so the deadline is not waited out: the request is fenced now, and
    released only on the same proof (PROOF_CHECK) as at the deadline."""
    pending = book.pending()
    if book.state is OwnerState.QUARANTINED and pending and set(pending) <= set(gone):
        return on_deadline(book)
    return OwnerEvent.RETRY


def on_proof_check(book: OwnerBook, gone: Mapping[int, Proof]) -> OwnerEvent:
    """``gone``: the severed writers proven gone (their last bytes drained), with the
    proof of each, which the release then records."""
    if all(w in book.acked or w in gone for w in book.fenced):
        book.gone.update({w: gone[w] for w in book.fenced if w not in book.acked})
        return OwnerEvent.PROOF
    return OwnerEvent.NO_PROOF


def step(
    book: OwnerBook,
    event: OwnerEvent,
    table: dict[tuple[OwnerState, OwnerEvent], Move[OwnerState, OwnerDo]] = OWNER_TABLE,
) -> Move[OwnerState, OwnerDo]:
    """Move ``book`` by ``table``; returns the entry (its effects are the rank's to do)."""
    return table_step(book, event, table)


def render_owner_table() -> str:
    return render(OWNER_TABLE, "The owner (decode rank)")
