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
    store.set(f"{KEY_PREFIX}{card.rank}", card.pack())


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
