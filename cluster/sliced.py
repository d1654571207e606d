"""Long work in slices, so that a rank keeps answering while it computes.

A million-token prompt takes seconds to prefill, checksum and verify on a CPU rank. Done in
one go inside a message handler, it would hold back every message meanwhile (an ABORT
waits for all of it) and the rank's heartbeats (the router marks it unhealthy after 5 s
and refuses every other request). Such work is written as an iterator whose every ``next``
is a bounded piece (a layer, a chunk of tokens, a slice of pages); :func:`run_in_slices`
runs pieces until ``slice_s`` has passed, then defers the rest to the rank's next pump, so
the loop polls in between. Work that fits in one slice never yields.

The first slice is deferred too: it never runs inside its caller's frame. Its callers are
a protocol row's effects (START_PREFILL, the owner's checks), and a step feeds events to
that same driver (a part is ready, a part is corrupt). Fed from inside a row, an event
waits behind the row's other effects, so a step that ran on would read the state from
before its own events: a whole short prefill ran in the row's frame, checksummed every
page, and only then did the queued parts post, finding their pages checksummed already.
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
    """Run ``steps`` to the end in slices of ``slice_s`` seconds, from the rank's next pump
    on (never in the caller's frame: see the module's docstring), then defer ``then`` (so
    a message that arrived during the last slice is handled first). Between slices, and
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

    rt.defer(run, rid=rid)
