"""Fence by restart: a severed rank is stopped by its launcher and comes back new.

An owner severs a writer that neither acked nor noticed within the abort deadline
(engine/protocol/README.md, point 4): nothing more is planned to it, and its pages stay
quarantined until it acks late or is proven gone. Severing alone leaves the cluster
without that writer for good: the router never routes to a severed incarnation again,
and a writer that was only slow (a stalled host, a long pause) would stay severed until
the cluster is stopped.

So the router, once a rank is severed, writes a fence order for that rank's incarnation in
the cluster's store (MAC'd with the cluster's secret: an order written without it stops
nothing). The rank's launcher (:mod:`.supervise`), which polls for an order naming its
child, SIGKILLs the child, reaps it and publishes its exit record: the owner's proof that
the writer is gone, so the old incarnation's quarantines are released. torchrun then
restarts the job, and the new incarnation is admitted once no rank waits on the old one.
The service recovers by itself, and no page is released on the order alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:  # the serve options import FencePolicy: no cryptography for them
    from .trust import Trust

log = logging.getLogger("kvferry.cluster")

FENCE_PREFIX = "kvferry/fence/"  # rank/incarnation -> the order, from the router
FENCE_MAC_LABEL = "kvferry/fence-order"
FENCE_POLL_S = 0.5  # how often a launcher looks for an order naming its child


class FencePolicy(StrEnum):
    """What becomes of a severed rank (``--fence-severed``)."""

    RESTART = "restart"  # its launcher kills it; torchrun restarts it as a new incarnation
    OFF = "off"  # it stays severed, out of service, until the cluster is stopped


class FenceRefused(RuntimeError):
    """A stored fence order that does not authenticate, decode, or match its key."""


@dataclass(frozen=True)
class FenceOrder:
    """Stop ``rank`` in ``incarnation``: it was severed for ``reason`` (a later
    incarnation is never named by it)."""

    rank: int
    incarnation: int
    reason: str
    at: float  # time.time() on the ordering host

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes) -> FenceOrder:
        try:
            obj = msgpack.unpackb(data, raw=False, max_str_len=1 << 12)
            return cls(**obj)
        except Exception as exc:
            raise FenceRefused(f"undecodable fence order ({type(exc).__name__})") from None


def fence_key(rank: int, incarnation: int) -> str:
    return f"{FENCE_PREFIX}{rank}/{incarnation:x}"


def order_fence(store, order: FenceOrder, trust: Trust) -> None:
    """Publish ``order`` (MAC'd) under its (rank, incarnation) key."""
    store.set(
        fence_key(order.rank, order.incarnation),
        trust.sign_record(FENCE_MAC_LABEL, order.pack()),
    )


def fence_ordered(store, rank: int, incarnation: int, trust: Trust) -> FenceOrder | None:
    """The order to stop ``rank`` in ``incarnation``, if one is in the store. FenceRefused
    for one that does not authenticate, or names another rank or incarnation than its
    key: it stops nothing."""
    from .trust import Unauthenticated

    key = fence_key(rank, incarnation)
    if not store.check([key]):
        return None
    try:
        data = trust.open_record(FENCE_MAC_LABEL, bytes(store.get(key)))
    except Unauthenticated as exc:
        raise FenceRefused(f"{key}: {exc}") from None
    order = FenceOrder.unpack(data)
    if (order.rank, order.incarnation) != (rank, incarnation):
        raise FenceRefused(
            f"{key} holds the order for rank {order.rank} incarnation {order.incarnation:#x}"
        )
    return order


def fence_order(rank: int, incarnation: int, reason: str) -> FenceOrder:
    return FenceOrder(rank=rank, incarnation=incarnation, reason=reason[:1024], at=time.time())
