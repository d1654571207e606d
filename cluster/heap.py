"""A rank's large transient buffers stay mapped between uses.

A long prompt's control messages are megabytes each: a 2 MiB PREFILL chunk is encoded,
sealed and copied at the router, and opened, decoded and joined at the writer; a
million-token PLAN or NOTICE is 1-1.5 MB of page arrays. glibc serves every allocation
above its mmap threshold with a fresh ``mmap`` and gives it back with ``munmap`` when
freed (or trims the top of the heap past its trim threshold), so each such buffer is new
memory whose pages fault in one by one as they are first written: every page of a 2 MiB
message's encoded, sealed and opened copies, 250 faults per MiB. On a virtual machine a
fault costs microseconds (the hypervisor maps the page too), and a million-token prompt
was held at its writer 30-40 ms after the router dispatched it, its NOTICE decoded by the
owner 8 ms after it was sent, mostly in faults (11 ms and 2-4 ms with this).

:func:`keep_freed_buffers` raises both thresholds once, at a rank's start: blocks below
``MMAP_THRESHOLD_BYTES`` come from the heap and go back to it, and up to
``TRIM_THRESHOLD_BYTES`` of free heap stay mapped, so the next message of that size reuses
pages already in place (no fault at all for those copies of the next message). Pools and
other allocations above the threshold are mapped and unmapped as before. A rank's resident
memory can stay up to the trim threshold above what it holds live: its peak of transient
buffers, kept for reuse. It also writes ``WARM_BYTES`` of heap once and frees it, so the
first long prompt after a start (or a restart) finds its buffers' pages in place too
instead of paying for them. Operators who set glibc's own ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` keep theirs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
WARM_BYTES = 64 << 20  # a million-token prompt's messages in flight at once, with room
_WARM_BLOCK = 4 << 20  # each under the mmap threshold, so it comes from the heap
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@dataclass(frozen=True)
class HeapTuning:
    """What :func:`keep_freed_buffers` did, and why (for the rank's start-up log)."""

    applied: bool
    why: str

    def describe(self) -> str:
        return f"heap: {self.why}"


def keep_freed_buffers(
    environ: Mapping[str, str] = os.environ, warm_bytes: int = WARM_BYTES
) -> HeapTuning:
    """Raise glibc's mmap and trim thresholds for this process, then write ``warm_bytes``
    of heap and free them (see the module doc); does nothing where the C library is not
    glibc or the operator set either threshold."""
    chosen = [name for name in OPERATOR_VARIABLES if name in environ]
    if chosen:
        return HeapTuning(False, f"left as the operator set it ({', '.join(chosen)})")
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return HeapTuning(False, f"left as it is: no mallopt in the C library ({name})")
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ):
        return HeapTuning(False, f"left as it is: mallopt refused the thresholds ({name})")
    _warm(warm_bytes)
    return HeapTuning(
        True,
        f"freed blocks under {MMAP_THRESHOLD_BYTES >> 20} MiB stay in the heap for reuse, "
        f"up to {TRIM_THRESHOLD_BYTES >> 20} MiB of it kept mapped (mallopt "
        f"M_MMAP_THRESHOLD, M_TRIM_THRESHOLD); {warm_bytes >> 20} MiB of it faulted in now",
    )


def _warm(nbytes: int) -> None:
    """Write ``nbytes`` of heap in blocks under the mmap threshold, then free them all:
    the heap keeps them, mapped and faulted in, for the buffers to come."""
    blocks = [ctypes.create_string_buffer(_WARM_BLOCK) for _ in range(nbytes // _WARM_BLOCK)]
    for block in blocks:
        ctypes.memset(block, 1, _WARM_BLOCK)
    del blocks
