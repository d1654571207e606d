"""I5 on arrival, in one place: what a writer's completion notice must prove before an
owner lets decode read the pages it names.

Every host of the protocol (a decode rank, the vLLM connector) checks a notice the same
way, in the same order, with the same words:

1. the length: the writer wrote exactly the prompt's positions of KV;
2. the pages: exactly the pages (and generations) the owner planned for the prompt, in
   order: a page of another request, or of an earlier allocation, is refused here;
3. the bytes: what the writer posted equals what those pages hold for its heads;
4. the canaries: each page's side-table tag is this request's (id, generation, index);
5. the checksums: the bytes that landed are the bytes the writer checksummed, a slice of
   pages per step (:func:`checksum_steps`), so a long prompt's check never holds its
   host for long.

Each check raises :class:`~.integrity.IntegrityError` with the request id and the numbers;
the host turns that into the protocol's CORRUPT and the request fails without a token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from .integrity import IntegrityError, PageList, check_transferred_length, request_id_hash


@dataclass(frozen=True)
class Notice:
    """What one writer's whole completion notice says it wrote."""

    writer: int
    tokens: int
    pages: PageList
    generations: PageList
    checksums: PageList
    bytes: int


@dataclass(frozen=True)
class Planned:
    """What the owner planned for that writer: the prompt's pages and generations, in
    order, and the bytes they hold for the writer's heads. ``unit``: what the host calls
    a page in its messages ("page", or vLLM's "block")."""

    rid: str
    tokens: int
    pages: PageList
    generations: PageList
    bytes: int
    unit: str = "page"


def check_notice(planned: Planned, notice: Notice) -> None:
    """Checks 1-3 (length, pages and generations, bytes); IntegrityError on the first
    that fails."""
    check_transferred_length(planned.rid, planned.tokens, notice.tokens)
    if not _same(notice.pages, planned.pages) or not _same(notice.generations, planned.generations):
        raise IntegrityError(
            planned.rid,
            f"writer rank {notice.writer} wrote {len(notice.pages)} {planned.unit}s "
            f"{_head(notice.pages)} generations {_head(notice.generations)}; the "
            f"prompt of {planned.tokens} tokens needs {len(planned.pages)}: "
            f"{list(zip(_head(planned.pages), _head(planned.generations), strict=True))}",
        )
    if notice.bytes != planned.bytes:
        raise IntegrityError(
            planned.rid,
            f"writer rank {notice.writer} posted {notice.bytes} bytes; the "
            f"{len(planned.pages)} {planned.unit}s planned hold {planned.bytes}",
        )


def _ints(values: PageList) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _same(a: PageList, b: PageList) -> bool:
    """The same integers in the same order (lists or arrays, compared in numpy)."""
    return len(a) == len(b) and bool(np.array_equal(_ints(a), _ints(b)))


def _head(values: PageList, n: int = 8) -> list[int]:
    """The first ``n`` of ``values`` as plain ints, for a message."""
    return [int(x) for x in _ints(values)[:n]]


def expected_canary_rows(
    rid: str, generations: PageList, index: npt.NDArray[np.int64] | None = None
) -> torch.Tensor:
    """``[n, 3]`` int64: the canary rows (request id hash, generation, index) the pages
    of ``rid``'s allocation must carry, in page-list order: the allocation's first ``n``
    pages, or those at its indices ``index`` (one a page)."""
    return torch.from_numpy(_expected_rows(rid, generations, index))


def _expected_rows(
    rid: str, generations: PageList, index: npt.NDArray[np.int64] | None
) -> npt.NDArray[np.int64]:
    gens = np.asarray(generations, dtype=np.int64).reshape(-1)
    rows = np.empty((gens.size, 3), dtype=np.int64)  # numpy: a request of a few pages
    rows[:, 0] = request_id_hash(rid)  # pays microseconds, not a torch call's each
    rows[:, 1] = gens
    rows[:, 2] = np.arange(gens.size) if index is None else index
    return rows


def check_canaries(
    planned: Planned, rows: torch.Tensor, index: npt.NDArray[np.int64] | None = None
) -> None:
    """Check 4: ``rows`` (``[n, 3]``, the side table's rows of the planned pages, in
    order) equal the request's own; ``index``: each page's place in the allocation, for
    a part or the pages no part checked (default: the allocation's first ``n``).
    IntegrityError naming the pages that differ."""
    expected = _expected_rows(planned.rid, planned.generations, index)
    # compared in numpy: a few calls of a microsecond (the check sits between the last
    # byte landing and the first token), where torch pays tens of microseconds a call
    got = rows.to(torch.int64).cpu().numpy()
    if got.shape != expected.shape:
        raise IntegrityError(
            planned.rid,
            f"{len(got)} canary rows for the {len(expected)} {planned.unit}s planned",
        )
    wrong = np.flatnonzero((got != expected).any(axis=1))[:8]
    if len(wrong):
        pages = _ints(planned.pages)[wrong].tolist()
        raise IntegrityError(planned.rid, f"canary mismatch on {planned.unit}s {pages}")


def check_part(
    planned: Planned,
    writer: int,
    offset: int,
    pages: PageList,
    generations: PageList,
    checksums: PageList,
) -> Planned:
    """Check 2 for a pipelined part of a writer's notice (pages ``offset ..`` of it,
    landed before the rest): exactly the planned pages and generations at that place, one
    checksum a page. Returns the part as a plan of its own, for checks 4 and 5 (canaries
    from index ``offset``, then :func:`checksum_steps`)."""
    n, total = len(pages), len(planned.pages)
    want_pages = _ints(planned.pages)[max(0, offset) : max(0, offset) + n]
    want_gens = _ints(planned.generations)[max(0, offset) : max(0, offset) + n]
    if (
        offset < 0
        or offset + n > total
        or not _same(pages, want_pages)
        or not _same(generations, want_gens)
    ):
        raise IntegrityError(
            planned.rid,
            f"writer rank {writer}'s notice part names {n} {planned.unit}s from index "
            f"{offset}: {_head(pages)} generations {_head(generations)}; the plan of "
            f"{total} has there {list(zip(_head(want_pages), _head(want_gens), strict=True))}",
        )
    if len(checksums) != n:
        raise IntegrityError(
            planned.rid,
            f"writer rank {writer}'s notice part has {len(checksums)} checksums for "
            f"{n} {planned.unit}s",
        )
    share = planned.bytes // total if total else 0
    return Planned(planned.rid, planned.tokens, pages, generations, share * n, planned.unit)


def unchecked_rest(
    planned: Planned, notice: Notice, mask: npt.NDArray[np.bool_], sums: npt.NDArray[np.int64]
) -> tuple[Notice, Planned, npt.NDArray[np.int64]]:
    """A writer's whole notice and plan cut to the pages none of its pipelined parts
    checked (``mask``: per page of the notice, checked by a part; ``sums``: the checksums
    those parts gave), and those pages' places in the notice (for the canaries' index).
    IntegrityError when the notice gives a checked page another checksum than its part
    did: the notice is the writer's last word on every page."""
    given = _ints(notice.checksums)
    differ = np.flatnonzero(mask & (given != sums))
    if differ.size:
        raise IntegrityError(
            planned.rid,
            f"writer rank {notice.writer}'s notice gives {differ.size} {planned.unit}s other "
            f"checksums than its parts did (first: {_ints(notice.pages)[differ[:4]].tolist()})",
        )
    rest = np.flatnonzero(~mask)
    pages = _ints(notice.pages)[rest]
    gens = _ints(notice.generations)[rest]
    cut = Notice(notice.writer, notice.tokens, pages, gens, given[rest], notice.bytes)
    return cut, Planned(planned.rid, planned.tokens, pages, gens, planned.bytes, planned.unit), rest


def checksum_steps(
    planned: Planned,
    notice: Notice,
    checksums_of: Callable[[PageList], torch.Tensor],
    per_step: int,
) -> Iterator[None]:
    """Check 5, ``per_step`` pages a step (yields between steps): ``checksums_of(pages)``
    gives the checksums of the landed bytes. IntegrityError, with the first pages that
    differ, once every page was checked; also when the notice has no checksum per page."""
    if len(notice.checksums) != len(notice.pages):
        raise IntegrityError(
            planned.rid,
            f"writer rank {notice.writer} sent {len(notice.checksums)} checksums for "
            f"{len(notice.pages)} {planned.unit}s",
        )
    want = torch.from_numpy(_ints(notice.checksums).copy())
    pages = _ints(notice.pages)
    bad: list[int] = []
    for start in range(0, len(pages), max(1, per_step)):
        chunk = pages[start : start + max(1, per_step)]
        got = checksums_of(chunk).cpu()
        differ = (got != want[start : start + len(chunk)]).nonzero().flatten().numpy()
        bad += chunk[differ].tolist()
        yield
    if bad:
        raise IntegrityError(
            planned.rid,
            f"checksum mismatch on {len(bad)} of {len(pages)} {planned.unit}s "
            f"written by rank {notice.writer} (first: {bad[:4]})",
        )
