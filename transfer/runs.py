"""Runs: int64 arrays of shape ``[n, 3]`` = (local offset, remote offset, length), the
byte runs a batch moves between two segments. Above the transfer engine a "page" is a
pool index; here it is only ever a run of bytes.

:func:`check_runs` validates a run list against both segments before anything is
posted, so a bad offset is refused with the numbers and never reaches UCX (a put to the
wrong remote offset would land in memory another request owns: see I4/I5). The hot path
runs the same checks natively inside ``kvf_put_pages``/``kvf_get_pages`` and defers to
:func:`check_runs` for the error and its numbers.
"""

from __future__ import annotations

import numpy as np

from .errors import SegmentBoundsError

LOCAL, REMOTE, LENGTH = 0, 1, 2


def as_runs(pages: object) -> np.ndarray:
    """The run list as a C-contiguous int64 array of shape [n, 3] (copied if needed)."""
    if (
        type(pages) is np.ndarray
        and pages.dtype == np.int64
        and pages.ndim == 2
        and pages.shape[1] == 3
        and pages.flags.c_contiguous
    ):
        return pages
    arr = np.asarray(pages)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"pages must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"pages must have shape [n, 3], got {list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError("page offsets exceed int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_runs(pages: np.ndarray, local_len: int, remote_len: int) -> int:
    """Raise SegmentBoundsError on the first run outside either segment; return total
    bytes. Lengths must be positive; offsets non-negative; end offsets within bounds
    (computed without overflow: ``off <= seg_len - length``)."""
    if pages.shape[0] == 0:
        return 0
    loc, rem, ln = pages[:, LOCAL], pages[:, REMOTE], pages[:, LENGTH]
    checks = (
        (ln <= 0, "has a non-positive length"),
        (loc < 0, "has a negative local offset"),
        (rem < 0, "has a negative remote offset"),
        (ln > local_len, "is longer than the local segment"),
        (ln > remote_len, "is longer than the remote segment"),
    )
    for bad, why in checks:
        if bad.any():
            _raise(pages, int(np.argmax(bad)), local_len, remote_len, why)
    bad_local = loc > (local_len - ln)
    if bad_local.any():
        _raise(
            pages, int(np.argmax(bad_local)), local_len, remote_len, "ends past the local segment"
        )
    bad_remote = rem > (remote_len - ln)
    if bad_remote.any():
        _raise(
            pages, int(np.argmax(bad_remote)), local_len, remote_len, "ends past the remote segment"
        )
    return int(ln.sum())


def _raise(pages: np.ndarray, i: int, local_len: int, remote_len: int, why: str) -> None:
    lo, ro, ln = (int(x) for x in pages[i])
    raise SegmentBoundsError(i, lo, ro, ln, local_len, remote_len, why)
