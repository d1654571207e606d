"""The service's protocol ports: what a driver's effects mean over a rank's runtime.

The drivers in :mod:`kvferry.engine.protocol` carry out the tables' effects through small
ports (:mod:`kvferry.engine.protocol.ports`); these are the ones a rank of the service (and
the simulator, whose runtime speaks the same ``send``/``notify``/``watch``) supplies: the
control messages to the router and to the peer ranks, and the rank's own pool pages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvferry.engine.allocator import PageAllocator
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import AbortSource, Release

from . import messages as m
from .chunks import PAGES_PER_CHUNK, spans

log = logging.getLogger("kvferry.cluster")


class RouterReport:
    """RELEASED to the router: how many of a request's pages this rank let go, how, and
    the proof that made it safe."""

    def __init__(self, runtime: Any, router: int) -> None:
        self.rt = runtime
        self.router = router

    def released(self, rid: str, pages: int, how: Release, justification: Proof) -> None:
        self.rt.send(
            self.router, m.RELEASED, rid=rid, pages=pages, how=how, justification=justification
        )


class RankWriterWire:
    """A writer's control messages over the rank's runtime."""

    def __init__(self, runtime: Any, router: int) -> None:
        self.rt = runtime
        self.router = router

    def tell_abort(self, rid: str, owner: int, source: AbortSource, reason: str) -> None:
        for rank in {self.router, owner} - {-1}:
            self.rt.send(
                rank,
                m.ABORT,
                rid=rid,
                owner=owner,
                writers=[self.rt.rank],
                source=source,
                reason=reason,
            )

    def send_ack(self, rid: str, owner: int, flushed: Callable[[], None] | None) -> None:
        ack = self.rt.notify(owner, m.ABORT_ACK, rid=rid) if owner >= 0 else None
        if flushed is None:
            return
        if ack is None:
            flushed()
        else:
            self.rt.watch(ack, lambda _batch: flushed(), rid=rid)


class AllocatorSource:
    """A writer's source pages in its pool's allocator."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def free(self, rid: str) -> int:
        return len(self.allocator.free(rid)) if self.allocator.pages_of(rid) else 0


class RankOwnerWire:
    """An owner's control messages over the rank's runtime."""

    def __init__(self, runtime: Any, router: int) -> None:
        self.rt = runtime
        self.router = router

    def send_plan(self, req: Any) -> None:
        generations = [g.generation for g in req.grants]
        for w in req.writers:
            for lo, hi in spans(len(req.grants), PAGES_PER_CHUNK):
                self.rt.send(
                    w,
                    m.PLAN,
                    rid=req.rid,
                    offset=lo,
                    total=len(req.grants),
                    pages=req.pages[lo:hi],
                    generations=generations[lo:hi],
                )

    def tell_abort(
        self, rid: str, to: list[int], writers: list[int], source: AbortSource, reason: str
    ) -> None:
        for w in to:
            self.rt.send(
                w,
                m.ABORT,
                rid=rid,
                owner=self.rt.rank,
                writers=writers,
                source=source,
                reason=reason,
            )

    def sever(self, rid: str, fenced: list[int], writers: list[int], why: str) -> None:
        log.warning("request %s: writers %s %s; severing them", rid, fenced, why)
        for w in writers:
            reason = f"request {rid}: {why}"
            self.rt.sever(w, reason)
            self.rt.send(
                self.router,
                m.SEVERED,
                peer_rank=w,
                incarnation=self.rt.cards[w].incarnation,
                reason=reason,
            )
