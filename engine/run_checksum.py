"""Checksums of regions put together from byte runs: what one writer wrote into one page.

When the two sides of a transfer differ in shape (TP, page size, layout: :mod:`.reshard`),
a writer's bytes land in a destination page as runs, neither a page of its own nor one
slice of it. The I5 check then compares, per (writer, destination page), the checksum of
the *region*: the bytes of that writer's runs into that page, concatenated in increasing
destination offset, read as words of ``unit`` bytes, with the function of
:mod:`.integrity` (Fletcher sums modulo ``P = 2^31 - 1``, packed ``s1 * 2^31 + s2``). The
writer computes it from its source bytes, the owner from what landed, and neither gathers
the bytes: each run's checksum is taken in place (native C, or the torch reference) and
the region's is put together from its runs', since the function is linear in the words
with a shift of index. A run of words ``w_0 .. w_{m-1}`` that starts at word ``k`` of its
region adds

    s1 += sum_j w_j,        s2 += sum_j (k + j + 1) w_j  =  s2_run + k * s1_run   (mod P).

So the value does not depend on how the region is cut into runs (the writer's plan and the
owner's may cut it differently) as long as every cut falls on a word: ``unit`` is 2 when
the shape's head vector (``head_dim x itemsize``, the grain of every run) is a whole
number of 16-bit words, else 1 (:func:`word_unit`). For one writer's heads of a
homogeneous HND page the region is exactly the slice a prefill writer checksums page by
page, and the values agree with :func:`.integrity.page_checksums` of that view.

What it catches (I5): a torn or short write leaves old bytes in the region; a write of
another request's bytes, or into the wrong place, changes the words or their order (the
index weight of ``s2``). What it does not: an adversary (see :mod:`.integrity`).
"""

from __future__ import annotations

import numpy as np
import torch

from .integrity import MODULUS, _native
from .keysort import lexsort_order

Runs = np.ndarray  # int64 [n, 3]: (local offset, remote offset, length) in bytes


def word_unit(vector_bytes: int) -> int:
    """The word size of region checksums for runs made of whole vectors of
    ``vector_bytes`` bytes: 2 when every cut falls on a 16-bit word, else 1."""
    return 2 if vector_bytes % 2 == 0 else 1


def split_at_pages(runs: Runs, page_bytes: int, column: int = 1) -> Runs:
    """``runs`` cut so that none crosses a boundary of ``page_bytes`` in ``column`` (1: the
    destination's offsets), the other offsets moving along: ``[m, 3]`` int64, m >= n."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if page_bytes <= 0:
        raise ValueError(f"page_bytes {page_bytes} must be positive")
    start, length = runs[:, column], runs[:, 2]
    first = start // page_bytes
    last = (start + np.maximum(length, 1) - 1) // page_bytes
    pieces = last - first + 1
    if bool((pieces == 1).all()):
        return runs
    owner = np.repeat(np.arange(len(runs)), pieces)
    within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    page = first[owner] + within
    lo = np.maximum(start[owner], page * page_bytes)
    hi = np.minimum(start[owner] + length[owner], (page + 1) * page_bytes)
    out = runs[owner].copy()
    shift = lo - start[owner]
    out[:, 0] += shift
    out[:, 1] += shift
    out[:, 2] = hi - lo
    return out


def _check_runs(nbytes: int, offsets: np.ndarray, lengths: np.ndarray, unit: int) -> None:
    if unit not in (1, 2):
        raise ValueError(f"word unit {unit}: 1 or 2")
    bad = (offsets < 0) | (lengths < 0) | (lengths % unit != 0) | (offsets > nbytes - lengths)
    if bool(bad.any()):
        i = int(np.flatnonzero(bad)[0])
        raise IndexError(
            f"run {i} (offset {int(offsets[i])}, {int(lengths[i])} bytes) is outside the "
            f"buffer of {nbytes} bytes or not whole {unit}-byte words"
        )


def _as_bytes(buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s storage as flat bytes (a view; ``buf`` must be contiguous)."""
    if not buf.is_contiguous():
        raise ValueError("region checksums read a contiguous buffer (a whole pool)")
    return buf.reshape(-1).view(torch.uint8)


def run_checksums_reference(
    buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, unit: int
) -> np.ndarray:
    """``[n]`` int64: the checksum of each run of ``buf``'s bytes (its own first word at
    index 0). The torch reference: gathers each run's words and widens them to int64."""
    raw = _as_bytes(buf)
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check_runs(raw.numel(), offsets, lengths, unit)
    out = np.zeros(len(offsets), dtype=np.int64)
    for length in np.unique(lengths):  # runs of one length in one gather
        if length == 0:
            continue
        which = np.flatnonzero(lengths == length)
        per_chunk = max(1, (1 << 24) // int(length))
        steps = torch.arange(int(length), dtype=torch.int64)
        weights = torch.arange(1, int(length) // unit + 1, dtype=torch.int64) % MODULUS
        for lo in range(0, len(which), per_chunk):
            sel = which[lo : lo + per_chunk]
            index = torch.from_numpy(offsets[sel])[:, None] + steps[None, :]
            data = raw[index.reshape(-1)].reshape(len(sel), int(length))
            if unit == 2:
                words = data.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
            else:
                words = data.to(torch.int64)
            words = words % MODULUS
            s1 = words.sum(dim=1) % MODULUS
            s2 = ((words * weights) % MODULUS).sum(dim=1) % MODULUS
            out[sel] = (s1 * (1 << 31) + s2).numpy()
    return out


def run_checksums_native(
    buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, unit: int
) -> np.ndarray:
    """:func:`run_checksums_reference`'s values from the native checksum (the GIL
    released), read in place; ``buf`` on the CPU and the module built."""
    native = _native()
    if native is None or buf.device.type != "cpu":
        raise ValueError("the native run checksum takes CPU buffers, with the module built")
    raw = _as_bytes(buf)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    _check_runs(raw.numel(), offsets, lengths, unit)
    out = np.empty(len(offsets), dtype=np.int64)
    ffi, lib = native
    bad = lib.kvf_run_checksums(
        ffi.cast("const void *", raw.data_ptr()),
        raw.numel(),
        ffi.cast("const int64_t *", offsets.ctypes.data),
        ffi.cast("const int64_t *", lengths.ctypes.data),
        len(offsets),
        unit,
        ffi.cast("int64_t *", out.ctypes.data),
    )
    if bad >= 0:  # pragma: no cover - _check_runs refused it first
        raise IndexError(f"run {bad} outside the buffer of {raw.numel()} bytes")
    return out


def run_checksums(
    buf: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, unit: int
) -> np.ndarray:
    """Each run's checksum: native on CPU buffers when built, else the torch reference."""
    if buf.device.type == "cpu" and _native() is not None:
        return run_checksums_native(buf, offsets, lengths, unit)
    return run_checksums_reference(buf, offsets, lengths, unit)


def combine(
    dst_offsets: np.ndarray, lengths: np.ndarray, sums: np.ndarray, page_bytes: int, unit: int
) -> tuple[np.ndarray, np.ndarray]:
    """The regions' checksums from their runs': ``(pages, checksums)``, one entry per
    destination page the runs touch, pages ascending. Runs must not cross a page of
    ``page_bytes`` (see :func:`split_at_pages`) nor overlap; ``sums[i]`` is run ``i``'s
    checksum (:func:`run_checksums`), in any order of the runs."""
    dst = np.asarray(dst_offsets, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if len(dst) != len(lengths):
        raise ValueError(f"{len(dst)} offsets, {len(lengths)} lengths")
    page = dst // page_bytes
    if bool(((dst + np.maximum(lengths, 1) - 1) // page_bytes != page)[lengths > 0].any()):
        raise ValueError("a run crosses a destination page: split_at_pages first")
    return combine_keyed(page, dst, lengths, sums, unit)


def combine_keyed(
    keys: np.ndarray, order: np.ndarray, lengths: np.ndarray, sums: np.ndarray, unit: int
) -> tuple[np.ndarray, np.ndarray]:
    """The regions' checksums from their runs' where a region is named by a key rather
    than by a page of one buffer (a vLLM block spread over several layers' tensors):
    ``(keys, checksums)``, one entry per key, ascending. Region ``k`` is the runs with
    ``keys == k`` concatenated in increasing ``order`` (the destination's position of
    each run: its offset, with the buffer's number above it where there are several);
    runs of one region must not overlap in ``order``. ``sums[i]`` is run ``i``'s checksum
    (:func:`run_checksums`), in any order of the runs."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    sums = np.asarray(sums, dtype=np.int64).reshape(-1)
    if not len(keys) == len(order) == len(lengths) == len(sums):
        raise ValueError(
            f"{len(keys)} keys, {len(order)} offsets, {len(lengths)} lengths, {len(sums)} sums"
        )
    some = lengths > 0  # an empty run is no part of any region
    keys, order, lengths, sums = keys[some], order[some], lengths[some], sums[some]
    if len(keys) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    by = lexsort_order(order, keys)
    keys, order, lengths, sums = keys[by], order[by], lengths[by], sums[by]
    same = keys[1:] == keys[:-1]
    if bool((same & (order[1:] < order[:-1] + lengths[:-1])).any()):
        raise ValueError("runs of one region overlap")
    words = lengths // unit
    starts = np.flatnonzero(np.r_[True, ~same])  # first run of each region
    before = np.cumsum(words) - words  # words of earlier runs, over all regions
    k = (before - np.repeat(before[starts], np.diff(np.r_[starts, len(keys)]))) % MODULUS
    s1 = sums >> 31
    s2 = sums & MODULUS
    shifted = (s2 + (k * s1) % MODULUS) % MODULUS
    s1_region = np.add.reduceat(s1, starts) % MODULUS
    s2_region = np.add.reduceat(shifted, starts) % MODULUS
    return keys[starts], s1_region * (1 << 31) + s2_region


def region_checksums(
    buf: torch.Tensor, runs: Runs, page_bytes: int, unit: int, *, read: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(pages, checksums)``: per destination page (of ``page_bytes``) the checksum of the
    region ``runs`` write into it, reading the bytes from ``buf`` at the runs' column
    ``read`` (0: a writer's source offsets; 1: an owner reading what landed)."""
    runs = split_at_pages(runs, page_bytes)
    sums = run_checksums(buf, runs[:, read], runs[:, 2], unit)
    return combine(runs[:, 1], runs[:, 2], sums, page_bytes, unit)
