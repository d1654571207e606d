"""Page integrity, the building blocks of I5: checksums, canary tags, length checks.

Checksum. Each page's bytes are read as 32-bit words ``w_i`` (bytes if the page size is
odd) and reduced modulo the Mersenne prime ``P = 2^31 - 1`` into two sums, Fletcher style:
``s1 = sum w_i mod P`` and ``s2 = sum (i+1) * w_i mod P``, packed as ``s1 * 2^31 + s2``.
Why this function: it is integer arithmetic, so the result does not depend on reduction
order and is identical on CPU and GPU (float sums are not); it is a handful of fully
vectorised elementwise ops and one reduction per page (no sequential dependency as in a
CRC), so it runs at memory speed in torch and maps to a one-pass GPU kernel; the position
weight in ``s2`` catches swapped or shifted words, and ``s1`` catches any single changed
word. It detects stale or foreign pages and accidental corruption, not an adversary.

Canary. A side table (not inside the KV) holds per page ``(request_id_hash, generation,
page_index)``: written by whoever writes the page, compared by the reader against what it
expects from its own allocation. A page written for another request, or for an earlier
allocation of the same page, or placed at the wrong index, mismatches.

Length. The reader compares the number of positions the writer reports written against
the number it will attend over; any difference fails the request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .allocator import PageGrant

MODULUS = (1 << 31) - 1
_WORD_MASK = (1 << 32) - 1
_CHUNK_ELEMENTS = 1 << 24  # bound on temporaries while checksumming many pages


class IntegrityError(Exception):
    """A request's pages failed a check; the request must fail without producing tokens."""

    def __init__(self, request_id: str, reason: str, bad_pages: Sequence[int] = ()) -> None:
        pages = f"; bad pages {list(bad_pages)}" if bad_pages else ""
        super().__init__(f"request {request_id!r}: integrity check failed: {reason}{pages}")
        self.request_id = request_id
        self.reason = reason
        self.bad_pages = list(bad_pages)


class TransferLengthError(IntegrityError):
    def __init__(self, request_id: str, expected_tokens: int, received_tokens: int) -> None:
        super().__init__(
            request_id, f"received {received_tokens} positions of KV, expected {expected_tokens}"
        )
        self.expected_tokens = expected_tokens
        self.received_tokens = received_tokens


def check_transferred_length(request_id: str, expected_tokens: int, received_tokens: int) -> None:
    """Raise :class:`TransferLengthError` unless exactly ``expected_tokens`` arrived."""
    if received_tokens != expected_tokens:
        raise TransferLengthError(request_id, expected_tokens, received_tokens)


# --- checksums -----------------------------------------------------------------------
def _page_words(kv: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``[n, words]`` int64 holding each page's bytes as unsigned 32-bit words (or bytes)."""
    flat = kv[pages].reshape(
        pages.numel(), -1
    )  # gather copies the listed pages only: [n, elements]
    raw = flat.view(torch.uint8)
    if raw.shape[1] % 4 == 0:
        return raw.view(torch.int32).to(torch.int64) & _WORD_MASK
    return raw.to(torch.int64)


def page_checksums(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One int64 checksum per listed page (``[n]``, on kv's device); see the module doc."""
    pages = torch.as_tensor(pages, dtype=torch.int64, device=kv.device).reshape(-1)
    out = torch.empty(pages.numel(), dtype=torch.int64, device=kv.device)
    if pages.numel() == 0:
        return out
    page_elements = kv[0].numel()
    per_chunk = max(1, _CHUNK_ELEMENTS // page_elements)
    weights = None
    for start in range(0, pages.numel(), per_chunk):
        words = _page_words(kv, pages[start : start + per_chunk]) % MODULUS
        if weights is None:
            weights = (
                torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=kv.device) % MODULUS
            )
        s1 = words.sum(dim=1) % MODULUS
        s2 = ((words * weights) % MODULUS).sum(dim=1) % MODULUS
        out[start : start + per_chunk] = s1 * (1 << 31) + s2
    return out


# --- canaries ------------------------------------------------------------------------
def request_id_hash(request_id: str) -> int:
    """Stable 63-bit hash of a request id (the same in every process)."""
    digest = hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Canary:
    request_id_hash: int
    generation: int
    page_index: int  # the page's index inside the request's page list


def expected_canaries(request_id: str, grants: Sequence[PageGrant]) -> list[Canary]:
    """What a reader expects on the pages of its own allocation, in page-list order."""
    rid = request_id_hash(request_id)
    return [Canary(rid, grant.generation, index) for index, grant in enumerate(grants)]


class CanaryTable:
    """``[num_pages, 3]`` int64 side table of canaries; -1 means never stamped.
    Rows can be shipped with a transfer (:meth:`rows`, :meth:`load`)."""

    EMPTY = -1

    def __init__(self, num_pages: int) -> None:
        self.table = torch.full((num_pages, 3), self.EMPTY, dtype=torch.int64)
        self._mirrors: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The table on ``device``, for a check that runs there (the decode kernel's): the
        table itself on the CPU; elsewhere a copy made once and kept equal by
        :meth:`stamp` and :meth:`load`, which write each stamped row to it too (writes to
        :attr:`table` by other means do not reach it)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.table
        mirror = self._mirrors.get(device)
        if mirror is None:
            mirror = self._mirrors[device] = self.table.to(device)
        return mirror

    def _write(self, pages: Sequence[int], rows: torch.Tensor) -> None:
        index = torch.as_tensor(list(pages), dtype=torch.int64)
        self.table[index] = rows
        for device, mirror in self._mirrors.items():
            mirror[index.to(device)] = rows.to(device)

    def stamp(self, pages: Sequence[int], canaries: Sequence[Canary]) -> None:
        if len(pages) != len(canaries):
            raise ValueError(f"{len(pages)} pages but {len(canaries)} canaries")
        if pages:
            self._write(
                pages,
                torch.tensor(
                    [[c.request_id_hash, c.generation, c.page_index] for c in canaries],
                    dtype=torch.int64,
                ),
            )

    def get(self, page: int) -> Canary | None:
        row = self.table[page].tolist()
        return None if row[0] == self.EMPTY else Canary(*row)

    def rows(self, pages: Sequence[int]) -> torch.Tensor:
        return self.table[torch.as_tensor(list(pages), dtype=torch.int64)].clone()

    def load(self, pages: Sequence[int], rows: torch.Tensor) -> None:
        self._write(pages, rows.to(torch.int64))

    def mismatched(self, pages: Sequence[int], expected: Sequence[Canary]) -> list[int]:
        """Pages whose stamped canary differs from the expected one."""
        if len(pages) != len(expected):
            raise ValueError(f"{len(pages)} pages but {len(expected)} expected canaries")
        if not pages:
            return []
        want = torch.tensor(
            [[c.request_id_hash, c.generation, c.page_index] for c in expected], dtype=torch.int64
        )
        bad = (self.rows(pages) != want).any(dim=1)
        return [page for page, is_bad in zip(pages, bad.tolist(), strict=True) if is_bad]


def verify_pages(
    kv: torch.Tensor,
    pages: Sequence[int],
    *,
    canary_table: CanaryTable | None = None,
    expected: Sequence[Canary] | None = None,
    expected_checksums: torch.Tensor | Sequence[int] | None = None,
) -> list[int]:
    """The pages (sorted) that fail the canary check, the checksum check, or both.
    Each check runs only when its inputs are given."""
    bad: set[int] = set()
    if canary_table is not None:
        if expected is None:
            raise ValueError("canary check needs the expected canaries")
        bad.update(canary_table.mismatched(pages, expected))
    if expected_checksums is not None:
        want = torch.as_tensor(expected_checksums, dtype=torch.int64).reshape(-1).cpu()
        if want.numel() != len(pages):
            raise ValueError(f"{len(pages)} pages but {want.numel()} expected checksums")
        got = page_checksums(kv, list(pages)).cpu()
        bad.update(page for page, ok in zip(pages, (got == want).tolist(), strict=True) if not ok)
    return sorted(bad)
