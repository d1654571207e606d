"""Rank cards in the torch.distributed store.

Every rank publishes one msgpack-encoded card: its role, transfer-engine address,
incarnation, pool segment descriptor and measured capacity. Every rank then reads all
cards (bounded wait). A card is keyed by rank and carries the incarnation, so a restarted
rank's new card replaces the old one and peers refuse the old descriptors (I3: the
measured capacity travels with the card, so the router can check it and report it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import msgpack

from .topology import Role

log = logging.getLogger("kvferry.cluster")

CARD_VERSION = 1
KEY_PREFIX = "kvferry/card/"
FAIL_PREFIX = "kvferry/failed/"
EPOCH_KEY = "kvferry/cards-epoch"  # bumped on every card published: peers re-read on change
EXIT_PREFIX = "kvferry/exited/"  # rank/incarnation -> exit record, from the rank's launcher
EXIT_COUNT_KEY = "kvferry/exits"  # exit records published so far: the log's length
EXIT_LOG_PREFIX = "kvferry/exit-log/"  # 1..count -> the same records, in publishing order


class RendezvousError(RuntimeError):
    """A rank's card is missing, malformed or of another protocol version."""


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


def publish(store, card: RankCard) -> None:
    """Publish (or replace, for a restarted rank) ``card``, then bump the epoch so every
    peer re-reads the cards (:func:`cards_epoch`)."""
    store.set(f"{KEY_PREFIX}{card.rank}", card.pack())
    store.add(EPOCH_KEY, 1)


def cards_epoch(store) -> int:
    """How many cards were published so far: a peer re-reads the cards when it moved."""
    return int(store.add(EPOCH_KEY, 0))


def read_cards(store, ranks: list[int]) -> dict[int, RankCard]:
    """The current card of each of ``ranks`` (all published: see :func:`gather`)."""
    raw = store.multi_get([f"{KEY_PREFIX}{r}" for r in ranks])
    return {r: RankCard.unpack(bytes(data)) for r, data in zip(ranks, raw, strict=True)}


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


def publish_exit(store, record: ExitRecord) -> None:
    """The record under its (rank, incarnation) key, for a proof that asks of one writer,
    and appended to the exit log, which a watcher of every rank reads in one round trip
    while nothing new has exited (:class:`ExitLog`)."""
    packed = record.pack()
    store.set(exit_key(record.rank, record.incarnation), packed)
    slot = int(store.add(EXIT_COUNT_KEY, 1))
    store.set(f"{EXIT_LOG_PREFIX}{slot}", packed)


@dataclass
class ExitLog:
    """A reader's place in the store's exit log. :meth:`read_new` costs one store round
    trip when nothing exited since the last call, and two more per new record; so a
    router watching a thousand ranks asks the store once a tick, not once a rank."""

    seen: int = 0

    def read_new(self, store) -> list[ExitRecord]:
        """The records published since the last call, oldest first. A slot counted but
        not written yet (its launcher is between the two calls) ends the read; the next
        call resumes there."""
        count = int(store.add(EXIT_COUNT_KEY, 0))
        out: list[ExitRecord] = []
        while self.seen < count:
            key = f"{EXIT_LOG_PREFIX}{self.seen + 1}"
            if not store.check([key]):
                break
            out.append(ExitRecord.unpack(bytes(store.get(key))))
            self.seen += 1
        return out


def exit_record(store, rank: int, incarnation: int) -> ExitRecord | None:
    """The launcher's word that ``rank`` in ``incarnation`` exited, if it has said so."""
    key = exit_key(rank, incarnation)
    if not store.check([key]):
        return None
    return ExitRecord.unpack(bytes(store.get(key)))


def publish_failure(store, rank: int, reason: str) -> None:
    """Tell the other ranks why this one will not start, so they fail fast with the reason."""
    store.set(f"{FAIL_PREFIX}{rank}", reason.encode()[:4096])


def gather(store, world_size: int, timeout_s: float, poll_s: float = 0.1) -> dict[int, RankCard]:
    """Every rank's card. Raises RendezvousError naming the ranks that published a failure,
    or, at the deadline, the ranks that published nothing."""
    keys = [f"{KEY_PREFIX}{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        failed = [r for r in range(world_size) if store.check([f"{FAIL_PREFIX}{r}"])]
        if failed:
            reasons = "; ".join(
                f"rank {r}: {store.get(f'{FAIL_PREFIX}{r}').decode(errors='replace')}"
                for r in failed
            )
            raise RendezvousError(f"rank(s) {failed} failed to start: {reasons}")
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise RendezvousError(f"ranks {missing} published no card within {timeout_s:.0f} s")
        time.sleep(poll_s)
    cards = {}
    for r, k in enumerate(keys):
        card = RankCard.unpack(store.get(k))
        if card.rank != r:
            raise RendezvousError(f"card under rank {r} names rank {card.rank}")
        cards[r] = card
    return cards
