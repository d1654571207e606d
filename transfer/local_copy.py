"""Byte runs copied between two of this process's host segments, in C with the GIL
released: a gather into staging memory before a write, so that the wire sees one piece
where the target's bytes are contiguous. Nothing here posts or knows a peer."""

from __future__ import annotations

from typing import Any

from ._native import ffi, lib
from .errors import TransferError
from .runs import as_runs, check_runs
from .segment import Segment


def copy_runs(dst: Segment, src: Segment, runs: Any) -> int:
    """Copy ``runs`` (``[n, 3]``: offset in ``src``, offset in ``dst``, length) and return
    the bytes copied. Every run is checked against both segments first
    (:class:`~.errors.SegmentBoundsError` with the numbers, nothing copied); host
    segments only (a CUDA segment is refused: its bytes have no host address)."""
    if dst.is_cuda or src.is_cuda:
        raise TransferError("copy_runs copies between host segments; a CUDA segment was given")
    arr = as_runs(runs)
    total = check_runs(arr, src.length, dst.length)
    if arr.shape[0]:
        lib.kvf_memcpy_pages(  # releases the GIL
            ffi.cast("char *", dst.base),
            ffi.cast("const char *", src.base),
            ffi.from_buffer("int64_t[]", arr),
            arr.shape[0],
            0,
        )
    return total
