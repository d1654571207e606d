"""Page ownership: who holds each page, in which state, since which allocation.

Every page is FREE, OWNED (by exactly one request) or QUARANTINED (still attributed to the
request that owned it: a remote write may yet land in it). Allocation is all-or-nothing and
hands out the lowest-numbered free pages, so reuse is deterministic (tests rely on that to
hand one request's pages to the next). Each allocation stamps its pages with a fresh
generation from one counter, so ``(page, generation)`` never repeats.

Upholds: free + owned + quarantined == total at all times; only the owner frees; pages
leave quarantine only through :meth:`PageAllocator.release` (I4 bookkeeping; the proof
that no write can land is the caller's, see ``engine/protocol/README.md``). Quarantined
pages are not free, so admission counts them as used (I1).

Unsafe mode (``unsafe=True``, off by default, logged at CRITICAL) makes
:meth:`PageAllocator.quarantine` free pages at once. It exists only to show that the leak
tests can fail.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import NamedTuple

from .fastenum import IdentityEnum

log = logging.getLogger(__name__)


class PageState(IdentityEnum):
    FREE = "free"
    OWNED = "owned"
    QUARANTINED = "quarantined"


class PageGrant(NamedTuple):
    """One allocated page and the generation of the allocation that granted it. (A named
    tuple: allocations hand out hundreds at a time.)"""

    page: int
    generation: int


class AllocatorError(Exception):
    """Base of the allocator's errors."""


class OutOfPages(AllocatorError):
    def __init__(self, request_id: str, wanted: int, free: int) -> None:
        super().__init__(f"request {request_id!r}: wanted {wanted} pages, {free} free")
        self.request_id = request_id
        self.wanted = wanted
        self.free = free


class PageOwnershipError(AllocatorError):
    """A request tried to act on a page it does not hold in the needed state."""

    def __init__(
        self,
        request_id: str,
        page: int,
        owner: str | None,
        state: PageState,
        wanted_state: PageState,
    ) -> None:
        super().__init__(
            f"request {request_id!r}: page {page} is {state.value} (owner {owner!r}), "
            f"expected {wanted_state.value} by {request_id!r}"
        )
        self.request_id = request_id
        self.page = page
        self.owner = owner
        self.state = state
        self.wanted_state = wanted_state


class AllocatorInvariantError(AllocatorError):
    """The allocator's books do not add up; raised by :meth:`PageAllocator.check_invariants`."""


class PageAllocator:
    def __init__(self, num_pages: int, *, unsafe: bool = False) -> None:
        if num_pages < 1:
            raise ValueError(f"allocator needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.unsafe = unsafe
        self._state = [PageState.FREE] * num_pages
        self._owner: list[str | None] = [None] * num_pages
        self._generation = [0] * num_pages
        self._free_heap = list(range(num_pages))  # a sorted list is a valid heap
        self._held: dict[
            str, list[int]
        ] = {}  # request -> pages OWNED or QUARANTINED, in grant order
        self._next_generation = 1
        self._counts = {PageState.FREE: num_pages, PageState.OWNED: 0, PageState.QUARANTINED: 0}
        if unsafe:
            log.critical(
                "UNSAFE PAGE ALLOCATOR: quarantine frees pages immediately; late writes can "
                "land in the next owner's pages. Never use outside leak tests."
            )

    # --- queries ----------------------------------------------------------------------
    def state(self, page: int) -> PageState:
        return self._state[self._index(page)]

    def owner(self, page: int) -> str | None:
        return self._owner[self._index(page)]

    def generation(self, page: int) -> int:
        return self._generation[self._index(page)]

    def pages_of(self, request_id: str) -> list[int]:
        """Pages the request holds (owned or quarantined), in the order they were granted."""
        return list(self._held.get(request_id, ()))

    def grants_of(self, request_id: str) -> list[PageGrant]:
        return [PageGrant(p, self._generation[p]) for p in self._held.get(request_id, ())]

    def owned_pages_of(self, request_id: str) -> list[int]:
        return [p for p in self._held.get(request_id, ()) if self._state[p] is PageState.OWNED]

    def quarantined_pages_of(self, request_id: str) -> list[int]:
        return [
            p for p in self._held.get(request_id, ()) if self._state[p] is PageState.QUARANTINED
        ]

    @property
    def free_pages(self) -> int:
        return self._counts[PageState.FREE]

    def counts(self) -> dict[str, int]:
        return {
            "free": self._counts[PageState.FREE],
            "owned": self._counts[PageState.OWNED],
            "quarantined": self._counts[PageState.QUARANTINED],
            "total": self.num_pages,
        }

    # --- operations -------------------------------------------------------------------
    def allocate(self, request_id: str, n: int) -> list[PageGrant]:
        """Grant ``n`` pages to ``request_id`` or none at all (raises :class:`OutOfPages`)."""
        pages, generation = self._grant(request_id, n)
        return list(map(PageGrant, pages, itertools.repeat(generation, n)))

    def allocate_pages(self, request_id: str, n: int) -> list[int]:
        """:meth:`allocate`'s pages alone (the same pages, in the same order, under one
        generation), for a caller that needs no generation: a writer's source pages. A
        long prompt's grants are tens of thousands of tuples, most of an allocation's
        time."""
        return self._grant(request_id, n)[0]

    def _grant(self, request_id: str, n: int) -> tuple[list[int], int]:
        if n < 0:
            raise ValueError(f"request {request_id!r}: cannot allocate {n} pages")
        if n > self.free_pages:
            raise OutOfPages(request_id, n, self.free_pages)
        if n == 0:
            return [], self._next_generation
        generation = self._next_generation
        self._next_generation += 1
        heap = self._free_heap
        if n * 16 >= len(heap):
            # Many pages (a long prompt's): one sort in C beats n pops. The pages are the
            # same lowest ones in the same order, and the sorted rest is a valid heap.
            heap.sort()
            pages = heap[:n]
            del heap[:n]
        else:
            pop = heapq.heappop
            pages = [pop(heap) for _ in range(n)]
        state, owner, generations, owned = (
            self._state,
            self._owner,
            self._generation,
            PageState.OWNED,
        )
        for page in pages:
            state[page] = owned
            owner[page] = request_id
            generations[page] = generation
        self._move_counts(PageState.FREE, owned, n)
        self._held.setdefault(request_id, []).extend(pages)
        return pages, generation

    def free(self, request_id: str, pages: list[int] | None = None) -> list[int]:
        """Return OWNED pages of ``request_id`` to the free list (all of them by default).
        Every page is checked before any is freed."""
        if pages is None:
            targets = self.owned_pages_of(request_id)
        else:
            targets = list(pages)
            for page in targets:
                self._expect(request_id, page, PageState.OWNED)
        if len(set(targets)) != len(targets):
            raise ValueError(f"request {request_id!r}: duplicate pages in free({targets})")
        self._to_free(request_id, targets)
        return targets

    def quarantine(self, request_id: str) -> list[int]:
        """OWNED -> QUARANTINED for every page the request owns. Returns those pages.
        In unsafe mode the pages are freed instead (and the loss of protection is logged)."""
        pages = self.owned_pages_of(request_id)
        if self.unsafe:
            if pages:
                log.critical(
                    "UNSAFE: request %r: %d pages freed without quarantine", request_id, len(pages)
                )
            self._to_free(request_id, pages)
            return pages
        state, quarantined = self._state, PageState.QUARANTINED
        for page in pages:
            state[page] = quarantined
        self._move_counts(PageState.OWNED, quarantined, len(pages))
        return pages

    def release(self, request_id: str) -> list[int]:
        """QUARANTINED -> FREE for every quarantined page of the request."""
        pages = self.quarantined_pages_of(request_id)
        self._to_free(request_id, pages)
        return pages

    # --- checks -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recount everything from the per-page records; raise if any book disagrees."""
        recount = {s: 0 for s in PageState}
        for state in self._state:
            recount[state] += 1
        if recount != self._counts or sum(recount.values()) != self.num_pages:
            raise AllocatorInvariantError(
                f"counts {self._counts} but pages say {recount} of {self.num_pages}"
            )
        if sorted(self._free_heap) != [
            p for p in range(self.num_pages) if self._state[p] is PageState.FREE
        ]:
            raise AllocatorInvariantError("free list does not match the pages marked free")
        held = {p: rid for rid, pages in self._held.items() for p in pages}
        for page in range(self.num_pages):
            state, owner = self._state[page], self._owner[page]
            if state is PageState.FREE and (owner is not None or page in held):
                raise AllocatorInvariantError(
                    f"free page {page} still attributed to {owner or held.get(page)!r}"
                )
            if state is not PageState.FREE and (owner is None or held.get(page) != owner):
                raise AllocatorInvariantError(
                    f"{state.value} page {page}: owner {owner!r}, held by {held.get(page)!r}"
                )

    # --- internals --------------------------------------------------------------------
    def _index(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside allocator of {self.num_pages} pages")
        return page

    def _expect(self, request_id: str, page: int, wanted: PageState) -> None:
        self._index(page)
        if self._state[page] is not wanted or self._owner[page] != request_id:
            raise PageOwnershipError(request_id, page, self._owner[page], self._state[page], wanted)

    def _move_counts(self, old: PageState, new: PageState, n: int) -> None:
        counts = self._counts
        counts[old] -= n
        counts[new] += n

    def _to_free(self, request_id: str, pages: list[int]) -> None:
        """``pages`` all belong to ``request_id`` (owned or quarantined: the callers'
        selection guarantees it). Per-page work stays in plain list stores, since a
        request frees hundreds of pages at a time."""
        if not pages:
            return
        gone = set(pages)
        state, owner, heap, push = self._state, self._owner, self._free_heap, heapq.heappush
        quarantined, free = PageState.QUARANTINED, PageState.FREE
        n_quarantined = 0
        for page in pages:
            n_quarantined += state[page] is quarantined
            state[page] = free
            owner[page] = None
            push(heap, page)
        self._move_counts(quarantined, free, n_quarantined)
        self._move_counts(PageState.OWNED, free, len(pages) - n_quarantined)
        remaining = [p for p in self._held.get(request_id, ()) if p not in gone]
        if remaining:
            self._held[request_id] = remaining
        else:
            self._held.pop(request_id, None)
