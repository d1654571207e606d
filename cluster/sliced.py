"""Long work in slices, so that a rank keeps answering while it computes.

A million-token prompt takes seconds to prefill, checksum and verify on a CPU rank. Done in
one go inside a message handler, it would hold back every message meanwhile (an ABORT
waits for all of it) and the rank's heartbeats (the router marks it unhealthy after 5 s
and refuses every other request). Such work is written as an iterator whose every ``next``
is a bounded piece (a layer, a chunk of tokens, a slice of pages); :func:`run_in_slices`
runs pieces until ``slice_s`` has passed, then defers the rest to the rank's next pump, so
the loop polls in between. Work that fits in one slice never yields and costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol


class Defers(Protocol):
    def defer(self, fn: Callable[[], None], rid: str | None = None) -> None: ...


def run_in_slices(
    rt: Defers,
    rid: str,
    steps: Iterator[object],
    slice_s: float,
    *,
    wanted: Callable[[], bool],
    then: Callable[[], None],
) -> None:
    """Run ``steps`` to the end in slices of ``slice_s`` seconds, then defer ``then`` (so a
    message that arrived during the last slice is handled first). Between slices, and
    before ``then``, ``wanted()`` is asked: once it is False (the request was aborted
    meanwhile) nothing more is computed and ``then`` is not called. An exception in a
    step ends request ``rid`` (see ``RankRuntime.run_for``)."""

    def run() -> None:
        if not wanted():
            return
        until = time.monotonic() + slice_s
        for _ in steps:
            if time.monotonic() >= until:
                rt.defer(run, rid=rid)
                return
        rt.defer(lambda: then() if wanted() else None, rid=rid)

    run()
