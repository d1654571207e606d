"""The ground truth the ranks cannot see, and the safety checks read off it.

The simulator knows every write batch posted and not yet landed. A write "can still land"
while it is posted, not landed, and its writer has not crashed (a crashed writer's
writes stop at the crash). Every time an owner's allocator frees pages (the one place:
:class:`WatchedAllocator`), the pages' request is looked up here: a release with a write
still able to land is an I4 violation. When a write lands, the pages it names are
checked against the owner's allocator: a page that another allocation holds now (or that
is free) was overwritten by a late write, the leak the protocol exists to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.engine.allocator import PageAllocator
from kvferry.engine.integrity import PageList


@dataclass
class Write:
    """One posted batch: ``pages`` of request ``rid`` at ``owner``, planned with
    ``generation``."""

    writer: int
    owner: int
    rid: str
    pages: PageList
    generation: int
    landed: bool = False
    dropped: bool = False  # its writer crashed before it landed


@dataclass
class Truth:
    pending: dict[tuple[int, str], int] = field(default_factory=dict)  # (owner, rid) -> batches
    released_while_landing: int = 0  # pages
    released_while_landing_requests: int = 0
    overwritten: int = 0  # pages of another allocation written by a late write
    overwritten_requests: set[str] = field(default_factory=set)  # the victims
    landed_in_free: int = 0  # pages written after they were freed, before reuse
    examples: list[str] = field(default_factory=list)

    def posted(self, w: Write) -> None:
        key = (w.owner, w.rid)
        self.pending[key] = self.pending.get(key, 0) + 1

    def _settle(self, w: Write) -> None:
        key = (w.owner, w.rid)
        left = self.pending[key] - 1
        if left:
            self.pending[key] = left
        else:
            del self.pending[key]

    def dropped(self, w: Write) -> None:
        """The writer crashed: this write never lands."""
        if not w.landed and not w.dropped:
            w.dropped = True
            self._settle(w)

    def landed(self, w: Write, alloc: PageAllocator, now: float) -> None:
        w.landed = True
        self._settle(w)
        pages = w.pages
        if len(pages) == 0:
            return
        if alloc.owner(pages[0]) == w.rid and alloc.generation(pages[0]) == w.generation:
            return  # still the request's own pages (they are released all at once)
        hit = 0
        for p in pages:
            owner = alloc.owner(p)
            if owner is None:
                self.landed_in_free += 1
            elif owner != w.rid or alloc.generation(p) != w.generation:
                hit += 1
                self.overwritten_requests.add(owner)
        if hit:
            self.overwritten += hit
            self._example(
                f"t={now:.3f}s: a late write of {w.rid} by rank {w.writer} landed in {hit} "
                f"pages of rank {w.owner} that another request holds now"
            )

    def on_release(self, owner: int, rid: str, pages: int, now: float) -> None:
        if (owner, rid) in self.pending:
            self.released_while_landing += pages
            self.released_while_landing_requests += 1
            self._example(
                f"t={now:.3f}s: rank {owner} released {pages} pages of {rid} with "
                f"{self.pending[owner, rid]} write batches still able to land"
            )

    def _example(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)


class WatchedAllocator(PageAllocator):
    """The real allocator; every page it frees is reported to :class:`Truth` first.
    ``_to_free`` is the one place pages become free (free, release, and the unsafe
    quarantine all go through it)."""

    def __init__(self, num_pages: int, *, unsafe: bool, truth: Truth, rank: int, clock) -> None:
        super().__init__(num_pages, unsafe=unsafe)
        self.truth, self.rank, self.clock = truth, rank, clock

    def _to_free(self, request_id: str, pages: list[int]) -> None:
        if pages:
            self.truth.on_release(self.rank, request_id, len(pages), self.clock.now)
        super()._to_free(request_id, pages)
