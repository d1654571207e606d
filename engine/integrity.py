"""Page integrity, the building blocks of I5: checksums, canary tags, length checks.

Checksum. Each page's bytes are read as unsigned 16-bit words ``w_i`` in the machine's
byte order (bytes if the page's byte count is odd) and reduced modulo the Mersenne prime
``P = 2^31 - 1`` into two sums, Fletcher style: ``s1 = sum w_i mod P`` and
``s2 = sum (i+1) * w_i mod P``, packed as ``s1 * 2^31 + s2``. Why this function: it is
integer arithmetic, so the result does not depend on reduction order and is identical on
CPU and GPU (float sums are not); it has no sequential dependency (as a CRC has), so it
vectorises: SIMD lanes on a CPU, a one-pass GPU kernel. What it catches, for certain:

- any one changed word (``s1`` moves: the change is below ``P`` in size, never a multiple
  of it), and so any one changed 32-bit value: its two words' changes ``d_lo``, ``d_hi``
  leave ``s1`` alone only when ``d_lo = -d_hi``, and then ``s2`` moves by ``d_hi``;
- two words swapped or a run shifted (the position weight of ``s2``: ``P`` is prime, and
  both the distance and the difference are below it).

Words of 32 bits would not do: ``w`` and ``w + P`` (1.0 and -0.99999994 in fp32) sum
alike. Random changes (a torn, short or stale write, a page of another request) collide
with probability about ``2^-62``. It is not a MAC: it detects accidents, not an adversary.

Three implementations, bit-identical (tests/engine/test_checksum_impls.py):
:func:`page_checksums_reference`, torch on any device and layout, ~100 MB/s on a CPU (it
gathers the pages and widens every word to int64); :func:`page_checksums_native`, C
(``transfer/native/kvf_checksum.c``: adds in uint64 lanes, Mersenne folds per block, the
GIL released) reading the pool in place at memory speed, which :func:`page_checksums` runs
on CPU pools whose pages are dense inside, since decode checksums every page it receives;
and the Triton kernel for CUDA pools (:mod:`.kernels.triton_checksum`, chosen by
:func:`.kernels.page_checksums`).
When the two sides of a transfer differ in shape, the same function is taken over the
region one writer wrote into one page, put together from its byte runs
(:mod:`.run_checksum`).

Canary. A side table (not inside the KV) holds per page ``(request_id_hash, generation,
page_index)``: written by whoever writes the page, compared by the reader against what it
expects from its own allocation. A page written for another request, or for an earlier
allocation of the same page, or placed at the wrong index, mismatches.

Length. The reader compares the number of positions the writer reports written against
the number it will attend over; any difference fails the request.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .allocator import PageGrant

# Page ids as a host holds them: a list, or an int64 array (decoded from the wire)
PageList = Sequence[int] | npt.NDArray[np.int64]

MODULUS = (1 << 31) - 1
_WORD_MASK = (1 << 16) - 1
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
    """``[n, words]`` int64 holding each page's bytes as unsigned 16-bit words (or bytes)."""
    # the gather copies the listed pages only: [n, elements]
    flat = kv[pages].reshape(pages.numel(), kv[0].numel())
    raw = flat.view(torch.uint8)
    if raw.shape[1] % 2 == 0:
        return raw.view(torch.int16).to(torch.int64) & _WORD_MASK
    return raw.to(torch.int64)


def page_checksums_reference(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One int64 checksum per listed page (``[n]``, on kv's device); see the module doc.
    The torch reference: any device and layout. Pages outside the pool raise IndexError."""
    pages = torch.as_tensor(pages, dtype=torch.int64, device=kv.device).reshape(-1)
    out = torch.empty(pages.numel(), dtype=torch.int64, device=kv.device)
    if pages.numel() == 0:
        return out
    if bool(((pages < 0) | (pages >= kv.shape[0])).any()):
        raise IndexError(f"pages outside [0, {kv.shape[0]})")
    page_elements = max(1, kv[0].numel())
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


@functools.cache
def _native() -> tuple[Any, Any] | None:
    """The native checksum's cffi ``(ffi, lib)`` (``kvf_page_checksums``, see
    ``transfer/native/kvf_checksum.h``), or None when the module is not built. The one
    place the engine reaches into kvferry.transfer's native layer: a byte function."""
    try:
        module = importlib.import_module("kvferry.transfer._checksum")
    except (ImportError, OSError):
        return None
    return module.ffi, module.lib


def native_supports(kv: torch.Tensor) -> bool:
    """True when :func:`page_checksums` runs the native checksum on ``kv``: a CPU pool
    ``[pages, ...]`` with each page dense inside (pages at any stride), module built."""
    return _native_reads(kv) and kv[0].is_contiguous()


def _native_reads(kv: torch.Tensor) -> bool:
    """A CPU pool ``[pages, ...]`` whose pages the native checksum can read, in place when
    each is dense inside, else from a dense copy (:func:`page_checksums_gathered`)."""
    return (
        kv.device.type == "cpu"
        and kv.layout == torch.strided
        and kv.dim() > 0
        and kv.shape[0] > 0
        and _native() is not None
    )


def page_checksums_native(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """:func:`page_checksums_reference`'s values from the native checksum, read in place
    (no gather); needs :func:`native_supports`. Pages outside the pool raise IndexError."""
    if not native_supports(kv):
        raise ValueError("the native checksum takes CPU pools with each page dense inside")
    pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).to("cpu").contiguous()
    out = torch.empty(pages.numel(), dtype=torch.int64)
    if pages.numel() == 0:
        return out
    native = _native()
    assert native is not None  # native_supports
    ffi, lib = native
    size = kv.element_size()
    bad = lib.kvf_page_checksums(  # releases the GIL
        ffi.cast("const void *", kv.data_ptr()),
        kv.stride(0) * size,
        kv[0].numel() * size,
        kv.shape[0],
        ffi.cast("const int64_t *", pages.data_ptr()),
        pages.numel(),
        ffi.cast("int64_t *", out.data_ptr()),
    )
    if bad >= 0:
        raise IndexError(f"page {int(pages[bad])} outside [0, {kv.shape[0]})")
    return out


GATHER_BYTES = 32 << 20  # pages copied dense at a time for the native checksum


def page_checksums(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One int64 checksum per listed page (``[n]``, on kv's device); see the module doc.
    Native on CPU pools it takes (:func:`native_supports`); native on a dense copy for
    CPU views whose pages are not dense inside (:func:`page_checksums_gathered`); else
    the torch reference."""
    if native_supports(kv):
        return page_checksums_native(kv, pages)
    if _native_reads(kv):
        return page_checksums_gathered(kv, pages)
    return page_checksums_reference(kv, pages)


def page_checksums_gathered(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """:func:`page_checksums_reference`'s values for a CPU view whose pages are not dense
    inside (a writer's share of the heads, ``pool[:, :, :, lo:hi]``): the listed pages are
    copied into a dense buffer, ``GATHER_BYTES`` at a time, and checksummed natively. The
    values are the same, since the checksum reads a page's elements in their logical
    order. Pages outside the pool raise IndexError."""
    pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).to("cpu")
    out = torch.empty(pages.numel(), dtype=torch.int64)
    if pages.numel() == 0:
        return out
    if bool(((pages < 0) | (pages >= kv.shape[0])).any()):
        raise IndexError(f"pages outside [0, {kv.shape[0]})")
    per_chunk = max(1, GATHER_BYTES // max(1, kv[0].numel() * kv.element_size()))
    for start in range(0, pages.numel(), per_chunk):
        dense = kv[pages[start : start + per_chunk]].contiguous()  # a gather, then dense
        out[start : start + per_chunk] = page_checksums_native(
            dense, torch.arange(dense.shape[0], dtype=torch.int64)
        )
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

    def _write(self, pages: PageList, rows: torch.Tensor) -> None:
        index = torch.from_numpy(np.asarray(pages, dtype=np.int64).reshape(-1))
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

    def rows(self, pages: PageList) -> torch.Tensor:
        # numpy's gather on the table's memory (a copy, as torch's indexing makes one)
        index = np.asarray(pages, dtype=np.int64).reshape(-1)
        return torch.from_numpy(self.table.numpy()[index])

    def load(self, pages: PageList, rows: torch.Tensor) -> None:
        self._write(pages, rows.to(torch.int64))

    def mismatched(self, pages: Sequence[int], expected: Sequence[Canary]) -> list[int]:
        """Pages whose stamped canary differs from the expected one."""
        if len(pages) != len(expected):
            raise ValueError(f"{len(pages)} pages but {len(expected)} expected canaries")
        if len(pages) == 0:
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
