"""A connected remote engine, as :meth:`TransferEngine.connect` returns it.

A :class:`Peer` is a record the engine owns and fills: its endpoint, its state
(:class:`PeerState`), why it failed, the watch on its process when it runs on this host,
and the bookkeeping the engine's batches and notices need. Callers read ``name``,
``state``, ``failure``, ``incarnation`` and ``transports``; everything else is the
engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .protocol import AddressInfo


class PeerState(Enum):
    CONNECTED = "connected"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(eq=False)
class Peer:
    """A connected remote engine. ``name`` appears in every error about it."""

    name: str
    address: bytes
    info: AddressInfo
    ep: Any = field(repr=False)  # kvf_ep_h (a cffi pointer)
    state: PeerState = PeerState.CONNECTED
    failure: str | None = None
    pidfd: int | None = field(default=None, repr=False)
    transports: str = ""
    transports_from: str = ""  # "ucp_ep_query", or "ucp_ep_print_info" before UCX 1.14
    last_liveness_check: float = 0.0
    # kvf_rkey_h of the segments opened on this peer: destroyed before the endpoint
    rkeys: list[Any] = field(default_factory=list, repr=False)
    # Segments opened on this peer by the path their pages take: "direct" (mapped
    # here), "cross-memory" (the kernel's copy) or "ucp_put" (UCX's puts).
    segment_paths: dict[str, int] = field(default_factory=dict)
    # Handles (kvf_batch_t *) whose completion a notice must wait for: batches that
    # posted puts through UCX, and notices still waiting for their flush. Empty: every
    # earlier write to this peer went through the direct (load/store) path and is
    # already visible, so a notice needs no endpoint flush (the AM is posted after the
    # writer's release fence).
    unflushed: list[Any] = field(default_factory=list, repr=False)
    # Batches posted to this peer that have not settled: while there are any, the
    # engine's progress watches the peer's process.
    unsettled: int = field(default=0, repr=False)

    @property
    def incarnation(self) -> int:
        return self.info.incarnation
