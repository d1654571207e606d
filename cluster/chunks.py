"""Long lists in several control messages: a prompt's tokens (PREFILL), a plan's pages
(PLAN) and a notice's pages, generations and checksums (NOTICE).

A million-token prompt is 4 MiB of int32 tokens and, at page size 1, a million pages; no
single control message may carry that (the transfer engine's message limit is 4 MiB, and
a bigger limit only moves the cliff). Each list is therefore cut into chunks of a fixed
size per kind: chunk ``i`` covers items ``[i * size, min((i + 1) * size, total))`` and
carries its ``offset`` and the list's ``total``. The receiver rebuilds the list from the
chunks in any order, ignores duplicates, and refuses a chunk that does not fit the grid
(:class:`ChunkError`, which fails that request, never the rank). A lost chunk leaves the
list incomplete: the request then ends as any stalled one does, by the owner's transfer
timeout and the abort protocol.

Why chunked messages and not the transfer engine: these lists are small next to the KV
they describe (a token is 4 bytes against hundreds to thousands of KV bytes), they must
arrive before any page is written (the plan) or after every page is flushed (the notice),
and the control plane already orders, deduplicates and bounds them. Chunk sizes are set so
the largest chunk of each kind encodes well under the 4 MiB message limit
(``tests/cluster/test_chunks.py`` encodes the worst case).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

TOKENS_PER_CHUNK = 1 << 19  # int32 tokens per PREFILL: 2 MiB
PAGES_PER_CHUNK = 1 << 16  # pages (and generations, checksums) per PLAN or NOTICE


class ChunkError(ValueError):
    """A chunk that does not fit its list: wrong offset, length or total."""

    def __init__(self, rid: str, what: str, why: str) -> None:
        super().__init__(f"request {rid}: {what} chunk refused: {why}")
        self.rid = rid


def spans(total: int, size: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of every chunk of a list of ``total`` items; one empty chunk for an
    empty list, so that an empty list still arrives."""
    if total == 0:
        yield 0, 0
        return
    for lo in range(0, total, size):
        yield lo, min(total, lo + size)


def chunk_count(total: int, size: int) -> int:
    return max(1, -(-total // size))


@dataclass
class Reassembly:
    """The chunks of one list (or of several parallel lists of equal length) received so
    far. ``optional`` names the parallel lists that may also arrive empty in every chunk
    (a notice's checksums when integrity checks are off)."""

    rid: str
    what: str
    total: int
    size: int
    width: int = 1
    optional: frozenset[int] = frozenset()
    parts: dict[int, tuple[Sequence[int], ...]] = field(default_factory=dict)

    def add(self, offset: int, total: int, *lists: Sequence[int]) -> bool:
        """Take one chunk; True once every chunk is in. Raises ChunkError for a chunk
        that does not fit."""
        if total != self.total:
            raise ChunkError(
                self.rid, self.what, f"total {total}, earlier chunks said {self.total}"
            )
        if len(lists) != self.width:
            raise ChunkError(self.rid, self.what, f"{len(lists)} lists, expected {self.width}")
        if offset < 0 or offset % self.size or (offset >= total and not offset == total == 0):
            raise ChunkError(
                self.rid,
                self.what,
                f"offset {offset} is not a chunk of {total} items in chunks of {self.size}",
            )
        expect = min(self.size, total - offset)
        for i, values in enumerate(lists):
            if len(values) != expect and not (i in self.optional and len(values) == 0):
                raise ChunkError(
                    self.rid,
                    self.what,
                    f"{len(values)} items at offset {offset}, expected {expect} of {total}",
                )
        self.parts.setdefault(offset, lists)
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.parts) == chunk_count(self.total, self.size)

    def joined(self) -> tuple[np.ndarray, ...]:
        """Every list, whole, as an int64 array (an optional list that arrived empty stays
        empty)."""
        chunks = self._in_order()
        return tuple(
            np.concatenate([np.asarray(c[i], dtype=np.int64) for c in chunks])
            for i in range(self.width)
        )

    def joined_array(self) -> np.ndarray:
        """The single list, whole, from chunks that are numpy arrays (a prompt's tokens)."""
        return np.concatenate([chunk[0] for chunk in self._in_order()])

    def _in_order(self) -> list[tuple[Sequence[int], ...]]:
        if not self.complete:
            raise ChunkError(
                self.rid,
                self.what,
                f"{len(self.parts)} of {chunk_count(self.total, self.size)} chunks in",
            )
        return [self.parts[offset] for offset in sorted(self.parts)]
