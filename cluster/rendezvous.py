"""Rank cards in the torch.distributed store.

Every rank publishes one msgpack-encoded card: its role, transfer-engine address,
incarnation, pool segment descriptor and measured capacity. Every rank then reads all
cards (bounded wait). A card is keyed by rank and carries the incarnation, so a restarted
rank's new card replaces the old one and peers refuse the old descriptors (I3: the
measured capacity travels with the card, so the router can check it and report it).

What goes into the store is sealed with the cluster's secret (:mod:`.trust`): a card is
encrypted whole (AES-GCM: its address and segment descriptor, with the memory keys, are
no use to a store reader) and MAC'd under its store key, so a card written without the
secret is refused (:class:`CardRefused`); exit records and start-up failures are MAC'd,
so one written without the secret fences nothing and stops nothing.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import asdict, dataclass, field

import msgpack

from kvferry.engine.reshard import Order

from .topology import Role
from .trust import TAG_BYTES, Trust, Unauthenticated, process_trust

log = logging.getLogger("kvferry.cluster")

CARD_VERSION = 3  # 2: kv_layout; 3: published_ns
SEALED_CARD = "kvf.card/sealed-v1"  # the store's form of a card (see seal_card)
KEY_PREFIX = "kvferry/card/"
FAIL_PREFIX = "kvferry/failed/"
EPOCH_KEY = "kvferry/cards-epoch"  # bumped on every card published: peers re-read on change
EXIT_PREFIX = "kvferry/exited/"  # rank/incarnation -> exit record, from the rank's launcher
EXIT_COUNT_KEY = "kvferry/exits"  # exit records published so far: the log's length
EXIT_LOG_PREFIX = "kvferry/exit-log/"  # 1..count -> the same records, in publishing order


class RendezvousError(RuntimeError):
    """A rank's card is missing, malformed or of another protocol version."""


class CardRefused(RendezvousError):
    """A card in the store that does not authenticate with this cluster's secret: written
    by a process without it (or by a rank given another secret), or altered since."""


class RecordRefused(RendezvousError):
    """An exit or failure record in the store whose MAC does not verify."""


@dataclass(frozen=True)
class RankCard:
    rank: int
    role: Role
    address: bytes  # TransferEngine.address
    incarnation: int
    segment: bytes | None  # packed SegmentDescriptor of the KV pool (None: router)
    num_pages: int
    page_size: int
    capacity_tokens: int  # measured from the allocated pool (I3)
    context_length: int
    host: str
    pid: int
    transports: str = ""  # the UCX transports it asked for (and RDMA devices), /status
    kv_layout: str = "HND"  # how its pool's pages lie in memory (engine.reshard.Order)
    # when it was published (wall clock, ns), and later than the card it replaces: a peer
    # adopts a card only over an older one, so an old card written back into the store
    # (sealed, but replayed) cannot take a live incarnation's place (card_after)
    published_ns: int = 0

    @property
    def page_format(self) -> tuple[int, Order]:
        """Its pool's pages: (tokens per page, axis order), as
        :func:`~kvferry.engine.reshard.page_for_page` compares them."""
        return self.page_size, Order(self.kv_layout)

    def __post_init__(self) -> None:
        # a role given by its word ("decode") becomes the enum; anything else is refused
        object.__setattr__(self, "role", Role(self.role))

    def pack(self) -> bytes:
        fields = {**asdict(self), "role": self.role.value}
        return msgpack.packb({"v": CARD_VERSION, **fields}, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> RankCard:
        try:
            obj = msgpack.unpackb(data, raw=False, max_bin_len=1 << 20, max_str_len=1 << 16)
        except Exception as exc:
            raise RendezvousError(f"undecodable rank card ({type(exc).__name__})") from None
        if not isinstance(obj, dict) or obj.get("v") != CARD_VERSION:
            raise RendezvousError(
                f"rank card of version {obj.get('v') if isinstance(obj, dict) else '?'}"
                f", expected {CARD_VERSION}"
            )
        obj.pop("v")
        fields = cls.__dataclass_fields__.keys()
        if set(obj) != set(fields):
            raise RendezvousError(f"rank card fields {sorted(obj)} != {sorted(fields)}")
        try:
            obj["role"] = Role(obj["role"])
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise RendezvousError(
                f"rank card of rank {obj.get('rank')}: role {str(obj['role'])[:20]!r} is not "
                f"one of {known}"
            ) from None
        return cls(**obj)


def card_key(rank: int) -> str:
    return f"{KEY_PREFIX}{rank}"


def seal_card(card: RankCard, trust: Trust) -> bytes:
    """The store's form of ``card``: the whole card encrypted (AES-GCM, its store key as
    associated data), then a MAC over that under the store key."""
    key = card_key(card.rank)
    body = msgpack.packb([SEALED_CARD, trust.encrypt(card.pack(), key.encode())])
    return body + trust.card_tag(key, body)


def open_card(data: bytes, trust: Trust, rank: int) -> RankCard:
    """The card stored under ``rank``'s key; CardRefused unless it authenticates."""
    key = card_key(rank)
    data = bytes(data)
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if len(data) <= TAG_BYTES or not hmac.compare_digest(trust.card_tag(key, body), tag):
        raise CardRefused(
            f"rank {rank}'s card in the store does not authenticate: written without this "
            "cluster's secret (is every node given the same --secret-file?)"
        )
    try:
        form, sealed = msgpack.unpackb(body, raw=False, max_bin_len=1 << 20)
        if form != SEALED_CARD:
            raise ValueError(form)
        card = RankCard.unpack(trust.decrypt(sealed, key.encode()))
    except (ValueError, TypeError, Unauthenticated) as exc:
        raise CardRefused(f"rank {rank}'s card in the store does not open: {exc}") from None
    if card.rank != rank:
        raise RendezvousError(f"card under rank {rank} names rank {card.rank}")
    return card


def card_after(store, rank: int, trust: Trust | None = None) -> int:
    """A ``published_ns`` for ``rank``'s new card: now, and past the card it replaces if
    that one reads (a host whose clock is behind the last one's); 0-based on a card that
    does not authenticate (a stranger's bytes say nothing)."""
    now = time.time_ns()
    key = card_key(rank)
    try:
        if not store.check([key]):
            return now
        return max(now, open_card(store.get(key), trust or process_trust(), rank).published_ns + 1)
    except (RendezvousError, RuntimeError, KeyError, ValueError):  # no card to read: now
        return now


def publish(store, card: RankCard, trust: Trust | None = None) -> None:
    """Publish (or replace, for a restarted rank) ``card``, sealed (:func:`seal_card`),
    then bump the epoch so every peer re-reads the cards (:func:`cards_epoch`)."""
    store.set(card_key(card.rank), seal_card(card, trust or process_trust()))
    store.add(EPOCH_KEY, 1)


def cards_epoch(store) -> int:
    """How many cards were published so far: a peer re-reads the cards when it moved."""
    return int(store.add(EPOCH_KEY, 0))


def read_cards(
    store,
    ranks: list[int],
    trust: Trust | None = None,
    refused: list[CardRefused] | None = None,
) -> dict[int, RankCard]:
    """The current card of each of ``ranks`` (all published: see :func:`gather`). A card
    that does not authenticate raises CardRefused, or, given ``refused``, is left out and
    its refusal appended there."""
    trust = trust or process_trust()
    raw = store.multi_get([card_key(r) for r in ranks])
    cards = {}
    for r, data in zip(ranks, raw, strict=True):
        try:
            cards[r] = open_card(data, trust, r)
        except CardRefused as exc:
            if refused is None:
                raise
            refused.append(exc)
    return cards


@dataclass(frozen=True)
class ExitRecord:
    """A rank's process has exited, in the word of its launcher on the same host (the
    process that forked it and reaped it: :mod:`.supervise`). Across hosts this is the
    owner's proof that the writer's process, and with it its mappings and queue pairs, is
    gone; the tcp transport's failure horizon is added before a release (the writer's
    kernel may still retransmit what its sockets held)."""

    rank: int
    incarnation: int
    pid: int
    host: str
    status: int  # the wait status as os.waitstatus_to_exitcode gives it (-9: SIGKILL)
    at: float  # time.time() on the launcher's host when the process was reaped

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> ExitRecord:
        try:
            obj = msgpack.unpackb(data, raw=False, max_str_len=1 << 12)
            return cls(**obj)
        except Exception as exc:
            raise RendezvousError(f"undecodable exit record ({type(exc).__name__})") from None


def exit_key(rank: int, incarnation: int) -> str:
    return f"{EXIT_PREFIX}{rank}/{incarnation:x}"


EXIT_MAC_LABEL = "kvferry/exit-record"


def sign_exit(record: ExitRecord, trust: Trust) -> bytes:
    return trust.sign_record(EXIT_MAC_LABEL, record.pack())


def open_exit(value: bytes, trust: Trust) -> ExitRecord:
    """The record in a stored value; RecordRefused unless its MAC verifies (a record
    written without the cluster's secret is proof of nothing)."""
    try:
        data = trust.open_record(EXIT_MAC_LABEL, bytes(value))
    except Unauthenticated as exc:
        raise RecordRefused(f"exit record refused: {exc}") from None
    return ExitRecord.unpack(data)


def publish_exit(store, record: ExitRecord, trust: Trust | None = None) -> None:
    """The record, MAC'd, under its (rank, incarnation) key, for a proof that asks of one
    writer, and appended to the exit log, which a watcher of every rank reads in one round
    trip while nothing new has exited (:class:`ExitLog`)."""
    packed = sign_exit(record, trust or process_trust())
    store.set(exit_key(record.rank, record.incarnation), packed)
    slot = int(store.add(EXIT_COUNT_KEY, 1))
    store.set(f"{EXIT_LOG_PREFIX}{slot}", packed)


# how long a counted slot of the exit log may stay unwritten before it is given up: its
# launcher died (or lost the store) between counting it and writing it
EXIT_SLOT_GRACE_S = 60.0


@dataclass
class ExitLog:
    """A reader's place in the store's exit log. :meth:`read_new` costs one store round
    trip when nothing exited since the last call, and two more per new record; so a
    router watching a thousand ranks asks the store once a tick, not once a rank."""

    seen: int = 0  # every slot up to here is read (or given up)
    refused: int = 0  # records whose MAC did not verify: skipped, counted, logged
    # counted slots not written yet, past ``seen``: since when each was missing
    holes: dict[int, float] = field(default_factory=dict)
    given_up: int = 0

    def read_new(
        self, store, trust: Trust | None = None, now: float | None = None
    ) -> list[ExitRecord]:
        """The records published since the last call, in the log's order. A slot counted
        but not written yet (its launcher is between the two calls) is read again at the
        next calls, while the slots after it are read now: one launcher that died between
        the two calls hides no later exit. A slot still unwritten after
        ``EXIT_SLOT_GRACE_S`` is given up (logged). A record that does not authenticate
        (or decode) is skipped, counted in ``refused`` and logged: it fences nothing."""
        trust = trust or process_trust()
        now = time.monotonic() if now is None else now
        count = int(store.add(EXIT_COUNT_KEY, 0))
        out: list[ExitRecord] = []
        for slot in [*sorted(self.holes), *range(self.seen + 1, count + 1)]:
            key = f"{EXIT_LOG_PREFIX}{slot}"
            if not store.check([key]):
                since = self.holes.setdefault(slot, now)
                if now - since >= EXIT_SLOT_GRACE_S:
                    del self.holes[slot]
                    self.given_up += 1
                    log.warning(
                        "%s of the store's exit log still unwritten after %.0f s: given up "
                        "(its launcher died between counting and writing it)",
                        key,
                        now - since,
                    )
                continue
            self.holes.pop(slot, None)
            try:
                out.append(open_exit(store.get(key), trust))
            except RendezvousError as exc:
                self.refused += 1
                log.warning("%s in the store's exit log: %s; it fences nothing", key, exc)
        self.seen = max(self.seen, count)
        return out


def exit_record(
    store, rank: int, incarnation: int, trust: Trust | None = None
) -> ExitRecord | None:
    """The launcher's word that ``rank`` in ``incarnation`` exited, if it has said so.
    RecordRefused for a record that does not authenticate or names another rank or
    incarnation than its key."""
    key = exit_key(rank, incarnation)
    if not store.check([key]):
        return None
    record = open_exit(store.get(key), trust or process_trust())
    if (record.rank, record.incarnation) != (rank, incarnation):
        raise RecordRefused(
            f"{key} holds the exit record of rank {record.rank} incarnation {record.incarnation:#x}"
        )
    return record


def publish_failure(store, rank: int, reason: str, trust: Trust | None = None) -> None:
    """Tell the other ranks why this one will not start, so they fail fast with the reason
    (MAC'd: a failure written without the secret stops nobody)."""
    key = f"{FAIL_PREFIX}{rank}"
    store.set(key, (trust or process_trust()).sign_record(key, reason.encode()[:4096]))


def read_failure(store, rank: int, trust: Trust) -> str | None:
    """The reason rank ``rank`` published for not starting, if an authentic one is there."""
    key = f"{FAIL_PREFIX}{rank}"
    if not store.check([key]):
        return None
    try:
        return trust.open_record(key, bytes(store.get(key))).decode(errors="replace")
    except Unauthenticated as exc:
        log.warning("ignoring a start-up failure of rank %d in the store: %s", rank, exc)
        return None


def gather(
    store,
    world_size: int,
    timeout_s: float,
    poll_s: float = 0.1,
    trust: Trust | None = None,
) -> dict[int, RankCard]:
    """Every rank's card. Raises RendezvousError naming the ranks that published a failure,
    or, at the deadline, the ranks that published nothing; CardRefused for a card that
    does not authenticate (another secret, or a stranger's)."""
    trust = trust or process_trust()
    keys = [card_key(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        failed = {
            r: reason
            for r in range(world_size)
            if (reason := read_failure(store, r, trust)) is not None
        }
        if failed:
            reasons = "; ".join(f"rank {r}: {reason}" for r, reason in failed.items())
            raise RendezvousError(f"rank(s) {sorted(failed)} failed to start: {reasons}")
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise RendezvousError(f"ranks {missing} published no card within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return {r: open_card(store.get(k), trust, r) for r, k in enumerate(keys)}
