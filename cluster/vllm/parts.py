"""What a connector worker's two protocol hosts (:mod:`.owner_host`, :mod:`.writer_host`)
share: its settings, its link to peers, its counters, its tombstones, its clock and its
place in the tensor-parallel group. Each host keeps its own timer list (a failed timer
fails a request through that host's own driver)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.engine.protocol.ports import Clock
from kvferry.engine.protocol.words import AbortSource

from . import wire
from .link import Link
from .loop import PollTimers, Tombstones
from .metrics import KvferryStats
from .settings import Settings


@dataclass(frozen=True)
class WorkerParts:
    settings: Settings
    link: Link
    stats: KvferryStats
    tombstones: Tombstones
    clock: Clock
    tp_rank: int
    tp_size: int


class WorkerHost:
    """The base of both hosts: the worker's shared parts as attributes, and the host's
    own timers."""

    def __init__(self, parts: WorkerParts, timers: PollTimers) -> None:
        self.settings = parts.settings
        self.link = parts.link
        self.stats = parts.stats
        self.tombstones = parts.tombstones
        self.clock = parts.clock
        self.tp_rank, self.tp_size = parts.tp_rank, parts.tp_size
        self.timers = timers
        self.kv_heads = 0  # the engine's KV heads in all (its TP group's), once attached

    def abort_payload(self, rid: str, orid: str, source: AbortSource, reason: str) -> bytes:
        """An ABORT from this worker (``rid``: the receiver's request id, ``orid``: ours),
        with this worker's TP rank and its engine's shape."""
        return wire.encode(
            wire.ABORT,
            rid=rid,
            orid=orid,
            source=source.value,
            reason=wire.clip_reason(reason),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            kv_heads=self.kv_heads,
        )
