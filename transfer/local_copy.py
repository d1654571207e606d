"""Byte runs copied between two of this process's buffers: a gather into staging memory
before a write, so that the wire sees one piece where the target's bytes are contiguous.
Host segments are copied in C with the GIL released (:func:`copy_runs`); torch tensors of
one device, CUDA memory among them, by torch on that device (:func:`copy_tensor_runs`).
Nothing here posts or knows a peer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._native import ffi, lib
from .errors import TransferError
from .runs import as_runs, check_runs
from .segment import Segment

if TYPE_CHECKING:
    import torch

COPY_UNIT_MAX = 4096  # the torch copy's widest unit: an index of 8 bytes per unit moved


def copy_runs(dst: Segment, src: Segment, runs: Any) -> int:
    """Copy ``runs`` (``[n, 3]``: offset in ``src``, offset in ``dst``, length) and return
    the bytes copied. Every run is checked against both segments first
    (:class:`~.errors.SegmentBoundsError` with the numbers, nothing copied); host
    segments only (a CUDA segment is refused: its bytes have no host address)."""
    if dst.is_cuda or src.is_cuda:
        raise TransferError("copy_runs copies between host segments; a CUDA segment was given")
    if not (dst.registered and src.registered):
        which = "destination" if not dst.registered else "source"
        raise TransferError(
            f"copy_runs: the {which} segment was deregistered; its memory may be gone"
        )
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


def copy_unit(runs: np.ndarray) -> int:
    """The widest power of two, at most :data:`COPY_UNIT_MAX`, dividing every offset and
    length of ``runs``: the unit :func:`copy_tensor_runs` moves."""
    g = int(np.gcd.reduce(runs.reshape(-1))) if runs.size else COPY_UNIT_MAX
    return min(COPY_UNIT_MAX, g & -g) if g else COPY_UNIT_MAX


def copy_word(unit: int, *tensors: torch.Tensor) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides ``unit`` and every tensor's
    address: what each unit is read and written as (one load of 8 bytes, not eight of
    one, per thread on a GPU)."""
    word = 8
    while word > 1 and (unit % word or any(t.data_ptr() % word for t in tensors)):
        word //= 2
    return word


def copy_tensor_runs(dst: torch.Tensor, src: torch.Tensor, runs: Any) -> int:
    """Copy ``runs`` (``[n, 3]``: offset in ``src``, offset in ``dst``, length) between
    two flat uint8 tensors of one device, in torch (on a CUDA device, queued on the
    current stream), and return the bytes copied. Every run is checked against both
    tensors first (:class:`~.errors.SegmentBoundsError` with the numbers, nothing
    copied). The bytes move in units of :func:`copy_unit`, read and written as words of
    :func:`copy_word`: one index_select of the source's units and one index_copy into
    the destination's. It writes the same bytes as :func:`copy_runs`, which a test holds
    it to."""
    import torch

    arr = as_runs(runs)
    total = check_runs(arr, src.numel(), dst.numel())
    if not len(arr):
        return 0
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.device != dst.device:
        raise TypeError(
            f"copy_tensor_runs copies between uint8 tensors of one device: {src.dtype} on "
            f"{src.device} into {dst.dtype} on {dst.device}"
        )
    if not dst.is_contiguous():  # reshape would copy it, and the bytes land in the copy
        raise TypeError(
            f"copy_tensor_runs writes into a contiguous tensor; got strides {dst.stride()}"
        )
    unit = copy_unit(arr)
    word = copy_word(unit, src, dst)
    as_words = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    counts = arr[:, 2] // unit
    place = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    src_units = torch.from_numpy(np.repeat(arr[:, 0] // unit, counts) + place)
    dst_units = torch.from_numpy(np.repeat(arr[:, 1] // unit, counts) + place)
    source = src.reshape(-1)[: src.numel() // unit * unit].view(as_words).view(-1, unit // word)
    target = dst.reshape(-1)[: dst.numel() // unit * unit].view(as_words).view(-1, unit // word)
    target.index_copy_(
        0, dst_units.to(dst.device), source.index_select(0, src_units.to(src.device))
    )
    return total
