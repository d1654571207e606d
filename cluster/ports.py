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
from kvferry.engine.protocol.ports import SourceFreed
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import AbortSource, Release
from kvferry.transfer import BatchStatus

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

    def send_ack(self, rid: str, owner: int, flushed: Callable[[bool], None] | None) -> None:
        ack = self.rt.notify(owner, m.ABORT_ACK, rid=rid) if owner >= 0 else None
        if flushed is None:
            return
        if ack is None:  # no flush made: the source pages go as drained
            flushed(False)
        else:  # a flush that failed is no proof that the writes ended
            self.rt.watch(ack, lambda b: flushed(b.status() is BatchStatus.COMPLETED), rid=rid)


class SharedSource:
    """A writer's source pages in its pool's allocator, held by jobs under a key.

    A job holds a prompt's pages under the id the router reserved them under (its
    ``share``): the job's own id, or, for a writer into several members of a decode
    group, the first member's id, so that the prompt is computed and held once for all of
    them. The pages go back to the allocator when the last job's hold ends (after its
    notice's or its ack's flush, I4): no job's end frees pages another job's writes may
    still read."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._share_of: dict[str, str] = {}  # job id -> the key its pages are held under
        self._holders: dict[str, set[str]] = {}  # key -> job ids that hold its pages

    def hold(self, rid: str, share: str, pages: int) -> tuple[list[int], bool]:
        """Job ``rid`` holds ``pages`` source pages under ``share``: those already held
        there (False), or newly allocated (True; raises OutOfPages). Raises ValueError,
        naming both, if ``share`` holds another number of pages."""
        holders = self._holders.get(share)
        if holders is None:
            held = self.allocator.allocate_pages(share, pages)
            self._holders[share] = {rid}
            self._share_of[rid] = share
            return held, True
        held = self.allocator.pages_of(share)
        if len(held) != pages:
            raise ValueError(
                f"request {rid}: its prompt takes {pages} source pages, but the {len(held)} "
                f"held under {share} for its decode group are another prompt's"
            )
        holders.add(rid)
        self._share_of[rid] = share
        return held, False

    def free(self, rid: str) -> SourceFreed | None:
        share = self._share_of.pop(rid, rid)
        holders = self._holders.get(share)
        if holders is not None:
            holders.discard(rid)
            if holders:
                return None  # another job's writes may still read them
            del self._holders[share]
        freed = len(self.allocator.free(share)) if self.allocator.pages_of(share) else 0
        return SourceFreed(share, freed)


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
