"""The ports a protocol driver carries out its effects through.

A driver (:mod:`.writer_driver`, :mod:`.owner_driver`) knows what each effect of its table
means; it does it by calling one of these small interfaces, which the host supplies: the
service's ranks over UCX and a real KV pool, the simulator over a simulated wire, clock
and data path, a test over fakes that record what was asked. A port does its work and
reports what came of it as an event (``Events.feed``); it never moves a book itself.

Subjects: the driver's records of one request, with at least ``rid`` and ``book`` (the
table's book) and the words a failure is told with (``abort_source``, ``abort_reason``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .proof import Proof
from .words import AbortSource, Outcome, Release

Subject = Any  # a host's record of one request; see the module's docstring


class Clock(Protocol):
    """The time a host's protocol code reads (seconds, monotonic): the process's clock in
    the service, the simulated one in the simulator, a hand-moved one in tests."""

    def now(self) -> float: ...


class Tombstones(Protocol):
    """Request ids that ended here (I2): a late message for one never revives it."""

    def tombstone(self, rid: str, at: float) -> None: ...


class Report(Protocol):
    """What the router hears of a request's pages here (RELEASED)."""

    def released(self, rid: str, pages: int, how: Release, justification: Proof) -> None: ...


# ---------------------------------------------------------------------- the writer's ports
class WriterWire(Protocol):
    """The writer's control messages."""

    def tell_abort(self, rid: str, owner: int, source: AbortSource, reason: str) -> None:
        """ABORT to the router and to ``owner`` (-1: none known yet), with the reason."""
        ...

    def send_ack(self, rid: str, owner: int, flushed: Callable[[bool], None] | None) -> None:
        """ABORT_ACK to ``owner`` with a flush first; ``flushed`` (when given) is called
        once that flush settled, with whether it completed, or at once with False when
        none was made (no owner known, or the message could not be posted): only a
        completed flush lets RELEASED say ``own-flush``, the others say ``drained``."""
        ...


@dataclass(frozen=True)
class SourceFreed:
    """Source pages a writer freed: the id they were held under (the one the router
    reserved them under) and how many there were (0: none were allocated)."""

    held_under: str
    pages: int


class SourcePages(Protocol):
    """The writer's own pool pages, which hold a request's computed KV. Several jobs may
    hold the same pages (a writer into a decode group computes the prompt once for every
    member it writes into); the pages are freed when the last hold ends."""

    def free(self, rid: str) -> SourceFreed | None:
        """End job ``rid``'s hold on its source pages (after its notice's or its ack's
        flush): what was freed, or None while another job still holds them."""
        ...


class WriterDataPath(Protocol):
    """The prefill compute and the one-sided writes. Each call starts work whose end
    comes back as an event (KV_READY, batches settling, NOTICE_FLUSHED, a failure)."""

    def start_prefill(self, job: Subject) -> None: ...

    def post_writes(self, job: Subject) -> None: ...

    def post_next(self, job: Subject) -> None: ...

    def post_part(self, job: Subject) -> None:
        """The pipelined path: post the pages final since the last part (their batches'
        settling come back as events; the last one as PART_LANDED)."""
        ...

    def send_part(self, job: Subject) -> None:
        """NOTICE_PART for the part whose batches all landed (flush first)."""
        ...

    def send_notice(self, job: Subject) -> None: ...

    def stop_posting(self, job: Subject) -> None:
        """Nothing more of ``job`` is posted (its queue dropped, any pause cancelled);
        what is in flight settles on its own."""
        ...


# ---------------------------------------------------------------------- the owner's ports
class Timers(Protocol):
    """One-shot timers on the host's loop; the handle has ``cancel()``."""

    def call_later(self, delay_s: float, fn: Callable[[], None], rid: str | None = None) -> Any: ...


class OwnerWire(Protocol):
    """The owner's control messages."""

    def send_plan(self, req: Subject) -> None:
        """PLAN (the request's pages and their generations) to every writer."""
        ...

    def tell_abort(
        self, rid: str, to: list[int], writers: list[int], source: AbortSource, reason: str
    ) -> None:
        """ABORT to each rank of ``to``, naming all the request's ``writers``."""
        ...

    def sever(self, rid: str, fenced: list[int], writers: list[int], why: str) -> None:
        """``rid``'s deadline fenced ``fenced``: no more plans to the incarnations of
        ``writers`` (those not restarted since), and the router is told (SEVERED)."""
        ...


class OwnerPages(Protocol):
    """The owner's pool pages for a request (its allocator and canary tags)."""

    def stamp_canaries(self, req: Subject) -> None: ...

    def free(self, rid: str) -> list[int]: ...

    def quarantine(self, req: Subject) -> None:
        """Move ``req``'s pages to quarantine: counted as used, never allocated."""
        ...

    def release(self, rid: str) -> list[int]:
        """Release ``rid``'s quarantined pages (freed with a new generation)."""
        ...

    def quarantined(self, rid: str) -> bool: ...


class WriterFacts(Protocol):
    """What the owner's host knows of a request's writers beyond their messages."""

    def restarted_since(self, req: Subject, writer: int) -> bool:
        """``writer`` has a new incarnation since ``req`` was assigned to it."""
        ...

    def proven_gone(self, req: Subject, writers: Any) -> dict[int, Proof]:
        """Those of ``writers`` whose incarnation on ``req`` can no longer write, each with
        its proof (:func:`.proof.gone_proof` over the host's facts)."""
        ...

    def is_severed(self, writer: int) -> bool: ...


class OwnerDataPath(Protocol):
    """The I5 checks and decoding: ``verify`` ends in VERIFIED or CORRUPT, fed back;
    ``verify_parts`` checks the pages of the notice parts that arrived (pipelined) and
    feeds CORRUPT only on a mismatch; ``start_decode`` gives the router the first token
    the writers' prefill computed (feeding FINISHED when it is the answer's last)."""

    def verify(self, req: Subject) -> None: ...

    def verify_parts(self, req: Subject) -> None: ...

    def start_decode(self, req: Subject) -> None: ...


class OwnerReport(Protocol):
    """What the router hears from the owner, and what the host keeps of its requests."""

    def done(self, req: Subject, outcome: Outcome) -> None:
        """DONE (failed with ``req.error``, or finished with its figures) to the router."""
        ...

    def nothing_held(self, rid: str) -> None:
        """RELEASED(0 pages): the router's reservation here ends."""
        ...

    def closed(self, req: Subject, pages: list[int], how: Release) -> None:
        """``req`` released ``pages`` (``how``, with its book's proof): RELEASED to the
        router, the request forgotten here and tombstoned."""
        ...

    def integrity_failure(self, req: Subject) -> None: ...

    def stuck(self, req: Subject, waited_s: float) -> None:
        """A fenced request still found no proof long past its deadline (said once)."""
        ...
