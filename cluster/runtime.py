"""One rank's control plane over its transfer engine.

Sends cluster messages to ranks by number (connecting lazily from the rank cards), filters
what arrives (malformed, stale incarnation, duplicate: dropped and counted, abort protocol
step 2), dispatches the rest to the role, fires callbacks when batches settle, and runs
timers. Single-threaded, like the engine under it: the role's loop calls :meth:`pump`.

Upholds I4's severing rule on the control plane: once a rank is severed, its messages and
its writes are refused until it comes back with a new incarnation.

Knows each peer by rank and incarnation: in a cluster run as failure domains a restarted
rank publishes a new card, which :meth:`refresh_cards` adopts (the old one is kept, retired,
for the proof its quarantined pages still wait on); a message of a retired incarnation is
refused and counted as stale.

Trusts only what proves the cluster's secret (:mod:`.trust`): every message it sends
carries a MAC over the encoded message (sender, incarnation, sequence number and payload)
bound to the destination's rank and incarnation, and a message that arrives without a
valid one is dropped before it is decoded, counted (``dropped_unauthenticated``) and logged
once per sender address, never acted on. A valid message seen before (a replay) is refused
by the sequence checks: the dedup window, and below it a floor under which every sequence
number of that incarnation counts as seen. Cards and exit records read from the store are
authenticated the same way (:mod:`.rendezvous`); one that is not is refused and counted.

Upholds I6 for the rank's own failures: an exception raised while handling a message, or in
a timer, a deferred call or a batch callback that belongs to a request, is counted, logged
with the request id and handed to ``on_request_error``, which ends that request through the
protocol (its pages freed or quarantined), so no request is left live by a bug or a bad
input. A message this rank cannot send for a reason of its own (it does not encode, or
exceeds the engine's size limit) raises :class:`LocalSendError`: the request fails, the
peer is not marked lost.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvferry.engine.protocol.proof import GoneFacts, Proof, gone_proof
from kvferry.engine.protocol.words import Kind
from kvferry.transfer import (
    Batch,
    BatchStatus,
    Peer,
    RemoteSegment,
    Segment,
    TransferEngine,
    TransferError,
    WireError,
)
from kvferry.transfer.wire import Message, MessageKind

from . import messages, receive
from .faults import FaultHooks, FaultPlan
from .processes import DRAIN_S, process_gone
from .rendezvous import (
    CardRefused,
    ExitLog,
    ExitRecord,
    RankCard,
    RecordRefused,
    RendezvousError,
    cards_epoch,
    exit_record,
    read_cards,
)
from .store import StoreError
from .trust import Trust, process_trust

Handlers = Mapping[Kind, Callable[[Message], None]]


class Settles(Protocol):
    """What :meth:`RankRuntime.watch` needs of a batch: a status query that never blocks
    (a transfer engine's batch, or an injected in-flight write)."""

    def peek(self) -> BatchStatus: ...


log = logging.getLogger("kvferry.cluster")

UNAUTHENTICATED_LOGGED = 256  # sender addresses whose unauthenticated messages were logged
WATCH_POLL_S = 0.0005  # the longest sleep while a watched batch is pending
BUSY_DRAIN_US = 2000  # the longest a busy rank's pump takes what keeps arriving
# A pump drains only after the rank was away from the wire this long (a step of compute):
# a rank that polls often takes its fragments as they come, and draining there only
# delays its own work (a stream of 16 MiB requests lost 10 % of its throughput to it).
DRAIN_AFTER_S = 0.005


class LocalSendError(Exception):
    """A control message refused before it left this rank (it does not encode, or it is
    over the engine's size limit): our own error, not the peer's."""

    def __init__(self, kind: str, rank: int, reason: str) -> None:
        super().__init__(f"{kind} to rank {rank} not sent: {reason}")
        self.kind, self.rank, self.reason = kind, rank, reason


@dataclass
class ControlCounters:
    sent: int = 0
    request_errors: int = 0  # exceptions that ended a request (on_request_error)
    received: int = 0
    send_failures: int = 0
    dropped_duplicate: int = 0
    dropped_stale: int = 0
    dropped_malformed: int = 0
    dropped_unauthenticated: int = 0  # no valid MAC: not decoded, never acted on
    dropped_severed: int = 0
    dropped_unexpected: int = 0  # a kind this rank's role does not take
    severed: int = 0
    cards_replaced: int = 0  # peers that came back with a new incarnation
    cards_refused: int = 0  # cards in the store that did not authenticate
    exit_records_refused: int = 0  # exit records that did not authenticate: fenced nothing


@dataclass(order=True)
class _Timer:
    when: float
    order: int
    fn: Callable[[], None] = field(compare=False)
    rid: str | None = field(default=None, compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


def published_after(card: RankCard, old: RankCard) -> bool:
    """Whether ``card`` may replace ``old``: published no earlier (a sealed card replayed
    into the store by someone who recorded it is older than the live one)."""
    return card.published_ns >= old.published_ns


class RankRuntime:
    def __init__(
        self,
        rank: int,
        engine: TransferEngine,
        cards: dict[int, RankCard],
        faults: FaultHooks | None = None,
        store: Any = None,
        trust: Trust | None = None,
    ) -> None:
        self.rank = rank
        # The cluster's keys (launch.py always gives them; code that gives none, a test or
        # a tool, gets the process's: the environment's secret or a random one).
        self.trust = trust or process_trust()
        self._open: Callable[[bytes], bytes | None] | None = None
        self._unauthenticated_from: set[bytes] = set()
        # The cluster's rendezvous store when it runs as failure domains (cards of
        # restarted ranks, exit records of dead ones); None in a single torchrun group.
        self.store = store
        self.retired: dict[tuple[int, int], RankCard] = {}  # (rank, incarnation) -> card
        self.cards_epoch = cards_epoch(store) if store is not None else 0
        self.exit_log = ExitLog()  # where this rank is in the store's exit log
        self.exited: set[tuple[int, int]] = set()  # (rank, incarnation) with an exit record
        self.engine = engine
        self.cards = cards
        self.faults = faults or FaultPlan()
        self.counters = ControlCounters()
        self._seq = itertools.count(1)
        self._peers: dict[int, Peer] = {}
        self._segments: dict[int, RemoteSegment] = {}
        self._seen: dict[int, receive.SeqWindow] = {}  # by sender rank, every incarnation
        self._severed: dict[int, int] = {}  # rank -> incarnation severed
        self._severed_peers: dict[int, Peer] = {}  # control-only endpoints to severed ranks
        self._gone_since: dict[tuple[int, int], float] = {}  # (rank, inc) -> seen gone
        self._watches: list[tuple[Settles, Callable[[Any], None], str | None]] = []
        self._timers: list[_Timer] = []
        self._timer_order = itertools.count()
        self._deferred: list[tuple[Callable[[], None], str | None]] = []
        self._last_progress = time.monotonic()  # when the last pump polled the wire
        self._handlers: Handlers = {}
        self._role = "rank"
        self.on_send_failure: Callable[[int, Exception], None] = lambda rank, exc: None
        # Ends a request after an exception in its handling (see _request_failed).
        self.on_request_error: Callable[[str, str], None] = lambda rid, reason: None
        # Called when a watch, a timer or a deferred call is added: a loop that sleeps
        # outside pump (the router's asyncio loop) wakes and asks sleep_bound again.
        self.on_new_work: Callable[[], None] = lambda: None
        # Called with (old card, new card) when a peer came back with a new incarnation.
        self.on_card_replaced: Callable[[RankCard, RankCard], None] = lambda old, new: None
        engine.set_message_handler(self._on_payload)

    # ------------------------------------------------------------------ peers
    @property
    def incarnation(self) -> int:
        return self.engine.incarnation

    def peer(self, rank: int, *, severed_ok: bool = False) -> Peer:
        """The endpoint to ``rank``. A severed rank gets none, except for the messages
        that ask it for the proof we wait on (``severed_ok``: ABORT), on an endpoint kept
        apart from the data path."""
        if self.is_severed(rank):
            if not severed_ok:
                raise TransferError(
                    f"rank {rank} is severed (incarnation {self._severed[rank]:#x})"
                )
            peer = self._severed_peers.get(rank)
            if peer is None or not self.engine.peer_alive(peer):
                card = self.cards[rank]
                peer = self.engine.connect(
                    card.address, name=f"rank{rank}/{card.role}@{card.host} (severed)"
                )
                self._severed_peers[rank] = peer
            return peer
        peer = self._peers.get(rank)
        if peer is None or not self.engine.peer_alive(peer):
            card = self.cards[rank]
            peer = self.engine.connect(card.address, name=f"rank{rank}/{card.role}@{card.host}")
            self._peers[rank] = peer
            self._segments.pop(rank, None)
        return peer

    def remote_segment(self, rank: int) -> RemoteSegment:
        peer = self.peer(rank)
        rseg = self._segments.get(rank)
        if rseg is None:
            card = self.cards[rank]
            if card.segment is None:
                raise TransferError(f"rank {rank} ({card.role}) publishes no segment")
            rseg = self.engine.open_segment(
                peer, card.segment, expected_incarnation=card.incarnation
            )
            self._segments[rank] = rseg
        return rseg

    def open_segments(self, ranks: Iterable[int]) -> list[int]:
        """Open now the pool segment of each of ``ranks`` that publishes one; the ranks
        opened. Opening maps the peer's whole pool (over shared memory, about 0.18 s for
        570 MB here): paid at start-up or when a peer comes back, not by the first write
        of a request. A rank not ready yet is left to its first write, which opens it."""
        opened = []
        for rank in ranks:
            card = self.cards.get(rank)
            if card is None or card.segment is None or self.is_severed(rank):
                continue
            try:
                self.remote_segment(rank)
            except TransferError as exc:
                log.info("rank %d: rank %d's segment not opened yet: %s", self.rank, rank, exc)
                continue
            opened.append(rank)
        return opened

    def is_severed(self, rank: int) -> bool:
        return self._severed.get(rank) == self.cards[rank].incarnation

    def sever(self, rank: int, reason: str) -> None:
        """Stop using ``rank``: force-close our endpoint to it, send it nothing more, and
        drop its messages (except ABORT_ACK, see :meth:`_on_payload`) until it comes back
        with a new incarnation.

        Severing is not proof that no write from ``rank`` can land (I4). Measured with UCX
        over tcp: after the target force-closed its endpoint, a writer that resumed from a
        stall reconnected and its puts landed in the target's memory. Over shared memory
        the writer keeps its mapping of our pool and needs no endpoint of ours at all.
        Proof comes only from the writer itself (an ABORT_ACK, sent after its flush) or
        from its process being gone: see :meth:`write_path_closed`."""
        if self.is_severed(rank):
            return
        card = self.cards[rank]
        self._severed[rank] = card.incarnation
        self.counters.severed += 1
        peer = self._peers.pop(rank, None)
        self._segments.pop(rank, None)
        if peer is not None:
            self.engine.close(peer, force=True)
        log.warning(
            "rank %d severed rank %d (pid %d on %s, incarnation %#x): %s",
            self.rank,
            rank,
            card.pid,
            card.host,
            card.incarnation,
            reason,
        )

    def card_of(self, rank: int, incarnation: int) -> RankCard | None:
        """The card ``rank`` published in ``incarnation``: its current one or a retired one."""
        card = self.cards.get(rank)
        if card is not None and card.incarnation == incarnation:
            return card
        return self.retired.get((rank, incarnation))

    def write_path_closed(self, rank: int, incarnation: int | None = None) -> Proof | None:
        """The proof that no write from ``rank`` in ``incarnation`` (default: the one
        severed, else the current one) can land any more without its ack, or None. The
        facts are gathered here; the rule is :func:`kvferry.engine.protocol.gone_proof`:

        - on this host: its process is gone (checked in /proc);
        - on another host: its launcher's exit record is in the store (it reaped the
          process: its mappings and queue pairs are gone), and the transports' failure
          horizon has passed since this rank saw the record: the writer's kernel may
          still retransmit what its tcp sockets held for up to the tcp user timeout. A
          remote rank with no exit record (its host lost, no store) is never proven gone.

        Either way this rank then keeps driving its worker for ``DRAIN_S``: over tcp it
        applies puts it already received, so bytes still in its socket buffer when the
        writer died are consumed (applied into quarantined pages) before the release."""
        if incarnation is None:
            incarnation = self._severed.get(rank, self.cards[rank].incarnation)
        card = self.card_of(rank, incarnation)
        if card is None:
            return None
        same_host = card.host == self.cards[self.rank].host
        if same_host:
            seen = process_gone(card.pid)
            facts = GoneFacts(same_host=True, process_gone=seen, drain_s=DRAIN_S)
        else:
            seen = self.store is not None and self._exit_published(rank, incarnation)
            facts = GoneFacts(
                same_host=False,
                exit_record=seen,
                drain_s=DRAIN_S,
                horizon_s=self.engine.failure_horizon().seconds or 0.0,
            )
        if not seen:
            return None
        since = self._gone_since.setdefault((rank, incarnation), time.monotonic())
        return gone_proof(dataclasses.replace(facts, gone_for_s=time.monotonic() - since))

    def _exit_published(self, rank: int, incarnation: int) -> bool:
        if (rank, incarnation) in self.exited:
            return True
        try:
            record = exit_record(self.store, rank, incarnation, self.trust)
        except RecordRefused as exc:
            self.counters.exit_records_refused += 1
            log.warning("rank %d: %s; rank %d is not taken as gone", self.rank, exc, rank)
            return False
        except StoreError:  # the store's loss: logged once by the store's guard
            return False
        except (RendezvousError, RuntimeError, OSError) as exc:
            log.warning("rank %d: cannot read rank %d's exit record: %s", self.rank, rank, exc)
            return False
        if record is None or not self._record_fits(record):
            return False
        self.exited.add((rank, incarnation))
        return True

    def _record_fits(self, record: ExitRecord) -> bool:
        """Whether an exit record names the process the card of its incarnation named
        (same host and pid): a launcher's record for a process it did not run proves
        nothing. Counted and logged when it does not fit; one of an incarnation this rank
        never saw a card of is taken as it is."""
        card = self.card_of(record.rank, record.incarnation)
        if card is None or (card.host, card.pid) == (record.host, record.pid):
            return True
        self.counters.exit_records_refused += 1
        log.warning(
            "rank %d: the exit record of rank %d incarnation %#x names pid %d on %s, its card "
            "pid %d on %s; it is not taken as gone",
            self.rank, record.rank, record.incarnation, record.pid, record.host, card.pid,
            card.host,
        )  # fmt: skip
        return False

    def poll_exits(self) -> list[ExitRecord]:
        """The exit records published since the last poll (one store round trip when
        there are none), remembered for :meth:`process_exited`; nothing without a store."""
        if self.store is None:
            return []
        try:
            fresh = self.exit_log.read_new(self.store, self.trust)
        except StoreError:  # the store's loss: logged once by the store's guard
            return []
        except (RendezvousError, RuntimeError, OSError) as exc:
            log.warning("rank %d: cannot read the exit log: %s", self.rank, exc)
            return []
        fresh = [r for r in fresh if self._record_fits(r)]
        self.exited.update((r.rank, r.incarnation) for r in fresh)
        return fresh

    def process_exited(self, rank: int) -> bool:
        """``rank``'s current incarnation is known to have exited: its process gone on
        this host, or its launcher's exit record among those :meth:`poll_exits` has read
        (for the router's view of who is alive; a release needs
        :meth:`write_path_closed`)."""
        card = self.cards[rank]
        if card.host == self.cards[self.rank].host:
            return process_gone(card.pid)
        return (rank, card.incarnation) in self.exited

    def refresh_cards(self) -> list[int]:
        """Adopt the new card of every peer that came back with a new incarnation (read
        when the store's card epoch moved; nothing without a store). The old card is
        retired, the endpoints and the descriptor to the old incarnation are dropped, and
        ``on_card_replaced`` tells the role. Returns the ranks replaced."""
        if self.store is None:
            return []
        try:
            epoch = cards_epoch(self.store)
            if epoch == self.cards_epoch:
                return []
            refused: list[CardRefused] = []
            fresh = read_cards(
                self.store,
                sorted(r for r in self.cards if r != self.rank),
                self.trust,
                refused=refused,
            )
        except StoreError:  # the store's loss: logged once by the store's guard
            return []
        except (RendezvousError, RuntimeError, OSError) as exc:
            log.warning("rank %d: cannot read the cards from the store: %s", self.rank, exc)
            return []
        for refusal in refused:
            self.counters.cards_refused += 1
            log.warning(
                "rank %d refused a card: %s; the peer's card in use is kept", self.rank, refusal
            )
        self.cards_epoch = epoch
        replaced = []
        for rank, card in fresh.items():
            old = self.cards[rank]
            if card.incarnation == old.incarnation or (rank, card.incarnation) in self.retired:
                continue
            if not published_after(card, old):  # an old card written back
                self.counters.cards_refused += 1
                log.warning(
                    "rank %d refused rank %d's card of incarnation %#x: published before the "
                    "card in use (incarnation %#x), which is kept",
                    self.rank,
                    rank,
                    card.incarnation,
                    old.incarnation,
                )
                continue
            self.retired[(rank, old.incarnation)] = old
            self.cards[rank] = card
            self.counters.cards_replaced += 1
            for peer in (self._peers.pop(rank, None), self._severed_peers.pop(rank, None)):
                if peer is not None:
                    self.engine.close(peer, force=True)
            self._segments.pop(rank, None)
            replaced.append(rank)
            log.warning(
                "rank %d: rank %d came back: incarnation %#x (pid %d on %s) replaces "
                "%#x (pid %d); messages of the old one are refused from now on",
                self.rank,
                rank,
                card.incarnation,
                card.pid,
                card.host,
                old.incarnation,
                old.pid,
            )
            self.on_card_replaced(old, card)
        return replaced

    # ------------------------------------------------------------------ sending
    def _fill(self, rank: int, kind: MessageKind, fields: dict) -> bytes:
        """The message's bytes as they go on the wire: encoded, then sealed for ``rank``
        in the incarnation of its card (see :mod:`.trust`)."""
        try:
            encoded = messages.encode(
                kind.make(
                    src=self.rank,
                    inc=self.incarnation,
                    seq=next(self._seq),
                    **messages.clip_free_text(kind, fields),
                )
            )
        except WireError as exc:
            self.counters.send_failures += 1
            raise LocalSendError(kind.name, rank, str(exc)) from None
        card = self.cards.get(rank)
        return self.trust.seal(rank, card.incarnation if card is not None else 0, encoded)

    def seal_to_self(self, encoded: bytes) -> bytes:
        """``encoded`` sealed for this rank, as a peer with the secret would send it (for
        code that hands this rank a message itself: tests, tools)."""
        return self.trust.seal(self.rank, self.incarnation, encoded)

    def send(self, rank: int, kind: MessageKind, **fields) -> Batch | None:
        """Post a control message to ``rank``; a failure on the way or at the peer is
        counted, logged and reported to ``on_send_failure`` (not raised: the protocol's
        deadlines take over). A message refused here (LocalSendError) is raised."""
        return self._deliver(rank, kind.name, self._fill(rank, kind, fields), flushed=False)

    def notify(self, rank: int, kind: MessageKind, **fields) -> Batch | None:
        """Flush every earlier write to ``rank``, then deliver the message. The batch
        returned completes once the flush (and the send) did."""
        batch = self._deliver(rank, kind.name, self._fill(rank, kind, fields), flushed=True)
        if kind is messages.NOTICE and self.faults.enabled:
            self.faults.noticed(self, rank, str(fields.get("rid")))
        return batch

    def _deliver(self, rank: int, kind: str, data: bytes, flushed: bool) -> Batch | None:
        """The fault seam: what the network does with one outgoing message (dropped,
        duplicated, delayed, held back) is decided here, for every message alike. A flush
        asked for still happens at once: losing a notice does not unflush the writes."""
        first = None
        for payload, delay in self.faults.on_send(kind, rank, data):
            if delay > 0:

                def later(p: bytes = payload) -> None:
                    self._post(rank, kind, p, flushed)

                self.call_later(delay, later)
            else:
                posted = self._post(rank, kind, payload, flushed)
                first = first or posted
        if first is None and flushed:
            first = self._guarded(rank, kind, lambda peer: self.engine.quiesce(peer))
        return first

    def _post(self, rank: int, kind: str, payload: bytes, flushed: bool = False) -> Batch | None:
        def post(peer: Peer) -> Batch:
            return self.engine.notify(peer, payload) if flushed else self.engine.send(peer, payload)

        batch = self._guarded(rank, kind, post)
        if batch is not None:
            self.counters.sent += 1
            # A send can fail after it was posted (a tcp connection reset under a long
            # partition): watched until it settles, so that failure is reported too.
            if batch.peek() is BatchStatus.PENDING:
                self.watch(batch, lambda b: self._check_sent(rank, kind, b))
            else:
                self._check_sent(rank, kind, batch)
        return batch

    def _check_sent(self, rank: int, kind: str, batch: Batch) -> None:
        if batch.error is not None:
            self._send_failed(rank, kind, batch.error)

    def _guarded(self, rank: int, kind: str, op) -> Batch | None:
        try:
            return op(self.peer(rank, severed_ok=(kind == "ABORT")))
        except WireError as exc:  # over the engine's message size: ours, not the peer's
            self.counters.send_failures += 1
            raise LocalSendError(kind, rank, str(exc)) from None
        except (TransferError, OSError) as exc:
            self._send_failed(rank, kind, exc)
            return None

    def _send_failed(self, rank: int, kind: str, exc: Exception) -> None:
        """Counted, logged and reported to ``on_send_failure``; the failed batch has
        marked the endpoint failed, so the next message to ``rank`` reconnects."""
        self.counters.send_failures += 1
        log.warning("rank %d: %s to rank %d failed: %s", self.rank, kind, rank, exc)
        self.on_send_failure(rank, exc)

    def write(
        self,
        rank: int,
        local: Segment,
        pages,
        *,
        rid: str,
        incarnation: int,
    ) -> Batch:
        """One-sided write of (local offset, remote offset, length) triples into ``rank``'s
        pool segment, for request ``rid``, whose pages ``rank`` allocated in
        ``incarnation``. A write is bound to that incarnation: it is refused (TransferError,
        before anything is posted) once ``rank`` runs as another one, and it goes through
        a segment opened for exactly it. Also refused: bounds, a severed or failed peer."""
        current = self.cards[rank].incarnation
        if incarnation != current:
            raise TransferError(
                f"rank {rank} is now incarnation {current:#x}; request {rid}'s pages were "
                f"allocated by incarnation {incarnation:#x}, which is gone"
            )
        remote = self.remote_segment(rank)
        if remote.descriptor.incarnation != incarnation:  # a segment of the card's rank
            raise TransferError(
                f"rank {rank}'s open segment is of incarnation "
                f"{remote.descriptor.incarnation:#x}, not {incarnation:#x} (request {rid})"
            )
        batch = self.engine.write(self.peer(rank), local, remote, pages)
        if self.faults.enabled:
            self.faults.wrote(self, rank, rid, pages)
        return batch

    def quiesce(self, rank: int) -> Batch:
        return self.engine.quiesce(self.peer(rank))

    # ------------------------------------------------------------------ receiving
    def set_handlers(self, handlers: Handlers, role: str) -> None:
        """The role's handler for each kind it receives: the one dispatch scheme of every
        role. A kind the role does not take is counted and logged, never raised."""
        self._handlers, self._role = dict(handlers), role

    def _unauthenticated(self, sender_address: bytes, payload: bytes) -> None:
        self.counters.dropped_unauthenticated += 1
        if (
            sender_address in self._unauthenticated_from
            or len(self._unauthenticated_from) >= UNAUTHENTICATED_LOGGED
        ):
            return
        self._unauthenticated_from.add(sender_address)
        log.warning(
            "rank %d dropped an unauthenticated control message (%d bytes) from the sender "
            "address %s: no valid MAC of this cluster's secret (a stranger, a rank given "
            "another secret, or a message sealed for an earlier incarnation of this rank); "
            "logged once per sender, counted in dropped_unauthenticated",
            self.rank,
            len(payload),
            hashlib.sha256(sender_address).hexdigest()[:16],
        )

    def _on_payload(self, sender_address: bytes, payload: bytes) -> None:
        if self._open is None:
            self._open = self.trust.opener(self.rank, self.incarnation)
        body = self._open(payload)
        if body is None:
            self._unauthenticated(sender_address, payload)
            return
        try:
            msg = messages.decode(body)
        except WireError as exc:
            self.counters.dropped_malformed += 1
            log.warning("rank %d dropped a malformed control message: %s", self.rank, exc)
            return
        src = msg.src
        card = self.cards.get(src)
        if (
            card is not None
            and msg.inc != card.incarnation
            and (src, msg.inc) not in self.retired
            and self.refresh_cards()
        ):
            card = self.cards.get(src)  # a peer restarted: the first word of its new self
        severed = card is not None and self.is_severed(src)  # a rank with no card: stale
        why = receive.refusal(msg.kind, msg.inc, card.incarnation if card else None, severed)
        if why is receive.Refusal.STALE:
            self.counters.dropped_stale += 1
            log.info(
                "rank %d dropped %s from rank %s: incarnation %#x is not the current one",
                self.rank,
                msg.kind,
                src,
                msg.inc,
            )
            return
        if why is receive.Refusal.SEVERED:
            self.counters.dropped_severed += 1
            return
        seen = self._seen.get(src)
        if seen is None:
            seen = self._seen[src] = receive.SeqWindow()
        if not seen.take(msg.inc, msg.seq):
            self.counters.dropped_duplicate += 1
            return
        self.counters.received += 1
        handler = self._handlers.get(Kind(msg.kind))
        if handler is None:
            self.counters.dropped_unexpected += 1
            log.warning(
                "%s rank %d: unexpected %s from rank %d", self._role, self.rank, msg.kind, src
            )
            return
        try:
            handler(msg)
        except Exception as exc:
            self._request_failed(msg.fields.get("rid"), f"{msg.kind} from rank {src}", exc)
        if self._watches:
            # What the handler posted and is already done (a direct write) goes on now,
            # before the next queued message: a notice is not held back behind the
            # writes of requests that arrived later.
            self._settle_watches()

    # ------------------------------------------------------------------ failures
    def _request_failed(self, rid: str | None, what: str, exc: BaseException) -> None:
        """An exception while handling ``what``: counted, logged with the request id, and
        the request ended by the role (``on_request_error``). Without a request id there is
        no request to end; the rank keeps serving."""
        self.counters.request_errors += 1
        reason = f"internal error in {what} on rank {self.rank}: {type(exc).__name__}: {exc}"
        if rid is None:
            log.error("rank %d: %s", self.rank, reason, exc_info=exc)
            return
        log.error("request %s: %s", rid, reason, exc_info=exc)
        if self.faults.swallow_errors:
            log.error("UNSAFE: request %s left as it is (swallow-errors)", rid)
            return
        try:
            self.on_request_error(rid, reason)
        except Exception:
            log.exception(
                "request %s: ending it after an internal error failed too; its "
                "pages stay as they are (quarantined pages wait for proof)",
                rid,
            )

    def run_for(self, rid: str | None, what: str, fn: Callable[[], None]) -> None:
        """Call ``fn``; an exception ends request ``rid`` (see :meth:`_request_failed`)."""
        try:
            fn()
        except Exception as exc:
            self._request_failed(rid, what, exc)

    # ------------------------------------------------------------------ batches, timers
    def watch(
        self, batch: Settles, callback: Callable[[Any], None], rid: str | None = None
    ) -> None:
        """Call ``callback(batch)`` once the batch settles: from :meth:`pump`, or right
        after the message handler that posted it returns. ``rid``: the request an
        exception in ``callback`` ends."""
        self._watches.append((batch, callback, rid))
        self.on_new_work()

    def call_later(self, delay_s: float, fn: Callable[[], None], rid: str | None = None) -> _Timer:
        timer = _Timer(time.monotonic() + delay_s, next(self._timer_order), fn, rid)
        heapq.heappush(self._timers, timer)
        self.on_new_work()
        return timer

    def defer(self, fn: Callable[[], None], rid: str | None = None) -> None:
        """Call ``fn`` from the next :meth:`pump`, after the engine's next progress and
        the messages it delivers: an ABORT that arrived during a long step (a prefill) is
        handled before the step's sequel (the checksums and the writes) runs."""
        self._deferred.append((fn, rid))
        self.on_new_work()

    def progress_for(self, budget_s: float) -> None:
        """Pump without sleeping for about ``budget_s``, or until a pump finds nothing to
        do: for a loop that must share its time between its own work and the transfers
        and messages its engine moves."""
        until = time.monotonic() + budget_s
        while self.pump(0.0) and time.monotonic() < until:
            pass

    def pump(self, timeout_s: float = 0.0, stay_awake: bool = False) -> int:
        """Drive the engine (sleeping on its event fd up to ``timeout_s`` when idle, or
        polling that long with ``stay_awake``), deliver messages, settle watched batches,
        fire due timers, then call what was deferred before this pump. Returns the
        engine's progress count (0: nothing happened on the wire)."""
        deferred, self._deferred = self._deferred, []
        # settled already (a direct write completes as it is posted): go on at once
        settled = self._settle_watches() if self._watches else False
        timeout_s = 0.0 if deferred or settled else self.sleep_bound(timeout_s)
        progressed = 0
        try:
            # Back from a step of compute (a prefill step, a slice of checks) with more
            # to come: take what the wire brings now, all of it, or a message of many
            # fragments crosses one queue's worth a step (a 1 MiB PLAN chunk took a
            # million-token prefill's whole length to arrive).
            away = time.monotonic() - self._last_progress
            drain_us = BUSY_DRAIN_US if deferred and away >= DRAIN_AFTER_S else 0
            progressed = self.engine.progress(timeout_s, stay_awake, drain_us=drain_us)
        except TransferError as exc:
            log.error("rank %d: progress failed: %s", self.rank, exc)
        self._last_progress = time.monotonic()
        if self._watches:
            self._settle_watches()
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.run_for(timer.rid, "a timer", timer.fn)
        for fn, rid in deferred:
            self.run_for(rid, "a deferred step", fn)
        if deferred and self._watches:
            self._settle_watches()
        return progressed + len(deferred)

    def _settle_watches(self) -> bool:
        """Call back every watched batch that has settled; True if any had."""
        current, self._watches, pending = self._watches, [], []
        for watched in current:
            batch, cb, rid = watched
            if batch.peek() is BatchStatus.PENDING:
                pending.append(watched)
            else:
                self.run_for(rid, "a batch callback", functools.partial(cb, batch))
        settled = len(pending) < len(current)
        self._watches = pending + self._watches  # callbacks may have added watches
        return settled

    def sleep_bound(self, timeout_s: float) -> float:
        """How long a loop may sleep on the engine's event fd before its next
        :meth:`pump`: ``timeout_s`` at most, nothing with deferred calls waiting,
        ``WATCH_POLL_S`` while a watched batch is pending (its completion may raise no
        event), and no later than the next timer."""
        if self._deferred:
            return 0.0
        if self._watches:
            timeout_s = min(timeout_s, WATCH_POLL_S)
        next_timer = self.next_timer_in()
        if next_timer is not None:
            timeout_s = min(timeout_s, next_timer)
        return timeout_s

    def next_timer_in(self) -> float | None:
        return max(0.0, self._timers[0].when - time.monotonic()) if self._timers else None

    def dropped(self) -> dict[str, int]:
        c = self.counters
        return {
            "duplicate": c.dropped_duplicate,
            "stale": c.dropped_stale,
            "malformed": c.dropped_malformed + self.engine.counters.malformed_messages,
            "unauthenticated": c.dropped_unauthenticated,
            "severed": c.dropped_severed,
        }
