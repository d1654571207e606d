"""Why a page was safe to reuse: the proofs of I4, as words, and the one rule that says a
writer is gone.

Every release of pages carries a justification: for each writer that may have written
them, the proof that no write of it can land any more. A writer proves it by its notice
or its ack, both sent after its flush; or it is proven gone from facts a host gathers
(its process on this host, or its launcher's exit record and the transport's failure
horizon), judged here by :func:`gone_proof`, a pure function every host calls. A timer
is never one of the proofs; ``NONE`` stands only in the broken modes that release
without any.

Plain data, no I/O, no clock: the host passes what it read and when.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Proof(enum.StrEnum):
    """One writer's proof that nothing more of it lands (``kvferry_releases_total``'s
    ``justification`` joins those of a release's writers with ``+``)."""

    NOTICED = "noticed"  # its completion notice, sent after the flush of every write
    ACKED = "acked"  # its ABORT_ACK, sent after its flush
    PROCESS_GONE = "process-gone"  # on this host: its process exited, then the drain
    EXIT_RECORD = "exit-record"  # elsewhere: its launcher's exit record, then the horizon
    NOTHING_POSTED = "nothing-posted"  # no page was allocated or planned for it here
    OWN_FLUSH = "own-flush"  # a writer's own source pages, after its flush completed
    DRAINED = "drained"  # a writer's own source pages: every batch ended, the ack unflushed
    NONE = "none"  # BROKEN MODE only: released without proof


@dataclass(frozen=True)
class GoneFacts:
    """What a host knows of one writer incarnation it waits on.

    ``same_host``: the writer ran on this host (its process can be looked up here).
    ``process_gone``: on this host, its process has exited. ``exit_record``: elsewhere,
    its launcher's exit record was read from the store. ``gone_for_s``: how long ago this
    host first saw either (None: not yet). ``drain_s``: how long the host keeps driving its
    worker after that, so that bytes already received are applied into the quarantined
    pages; ``horizon_s``: the transport's failure horizon (a remote writer's kernel may
    still retransmit what its sockets held)."""

    same_host: bool
    process_gone: bool = False
    exit_record: bool = False
    gone_for_s: float | None = None
    drain_s: float = 0.0
    horizon_s: float = 0.0

    @property
    def seen_gone(self) -> bool:
        """What the host observed counts as the writer's end (the clock starts there)."""
        return self.process_gone if self.same_host else self.exit_record


def gone_proof(facts: GoneFacts) -> Proof | None:
    """The proof that a silent writer is gone, or None. A process on this host that
    exited is gone once the drain passed; a remote one only on its exit record, once
    the drain and the failure horizon passed. A silent remote writer with no record (its
    host lost with it) is never proven gone."""
    if not facts.seen_gone or facts.gone_for_s is None:
        return None
    if facts.same_host:
        return Proof.PROCESS_GONE if facts.gone_for_s >= facts.drain_s else None
    wait = facts.drain_s + facts.horizon_s
    return Proof.EXIT_RECORD if facts.gone_for_s >= wait else None


def justification(
    writers: Iterable[int],
    noticed: Iterable[int],
    acked: Iterable[int],
    gone: Mapping[int, Proof],
) -> str:
    """The justification of releasing a request's pages: each writer's proof (a notice
    before an ack, an ack before a proof of its end), joined sorted by ``+``; a writer
    with none makes it ``none``. No writer at all: ``nothing-posted``."""
    noticed, acked = set(noticed), set(acked)
    proofs: set[Proof] = set()
    for w in writers:
        if w in noticed:
            proofs.add(Proof.NOTICED)
        elif w in acked:
            proofs.add(Proof.ACKED)
        elif w in gone:
            proofs.add(gone[w])
        else:
            return Proof.NONE.value
    if not proofs:
        return Proof.NOTHING_POSTED.value
    return "+".join(sorted(p.value for p in proofs))


def is_justified(label: str) -> bool:
    """A justification names a proof for every writer (``none`` never; nothing else
    that is not a :class:`Proof` word either)."""
    words = label.split("+")
    known = {p.value for p in Proof} - {Proof.NONE.value}
    return bool(label) and all(w in known for w in words)
