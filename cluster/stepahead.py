"""A long prefill's next model step, computed while the part its last step made final is
checksummed and written.

A pipelined prompt alternates two kinds of work on the writer: a model step (a chunk of
a layer's tokens, 65,536 by default) and, once a step made pages final, the part's
checksums (I5) and its write into the owner's pages. Both are long native calls that
leave the GIL (torch's kernels; the native checksum; the transfer engine's copy), so
with a core to spare they can overlap: :class:`StepAhead` starts the next step on a thread
of its own just before the part is posted, and waits for it once the part is posted.

What keeps this safe: the step ahead writes only the pages past the ones the part holds
(a page is final once every position in it is written in every layer, so no later step
touches it), and it has ended before anything else runs on the rank: the caller
:meth:`settle`s it right after the part's effects, before it yields to the rank's loop.
No message (an ABORT whose ack frees the source pages, a restart's fence) is handled
while a step computes, as before; the rank only learns of it one step later.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.engine.protocol.ports import Clock


@dataclass(frozen=True)
class Step:
    """One ``next()`` of a model's prefill generator."""

    yielded: int | None  # what it yielded: a layer's index, or None between pieces
    ended: bool  # the generator returned instead (``value`` is what it returned)
    value: Any
    seconds: float  # the step's own time, on whichever thread it ran


def take_step(steps: Generator[int | None, None, Any], clock: Clock) -> Step:
    """The generator's next step, here and now (without autograd: its mode is per
    thread)."""
    t0 = clock.now()
    with torch.no_grad():
        try:
            yielded = next(steps)
        except StopIteration as end:
            return Step(None, True, end.value, clock.now() - t0)
    return Step(yielded, False, None, clock.now() - t0)


class StepAhead:
    """One prefill's steps: each taken here, or started ahead on ``pool``'s thread
    (:meth:`start`) and joined before anything else runs (:meth:`settle`)."""

    def __init__(
        self, steps: Generator[int | None, None, Any], clock: Clock, pool: cf.Executor | None
    ) -> None:
        self.steps = steps
        self.clock = clock
        self.pool = pool  # None: every step here (no thread to spare)
        self._ahead: cf.Future[Step] | None = None

    def take(self) -> Step:
        """The next step: the one started ahead (settled), or one taken now."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead.result()  # a step's exception is raised here, as if taken now
        return take_step(self.steps, self.clock)

    def start(self) -> None:
        """Start the next step on the pool's thread (taken by the next :meth:`take`)."""
        if self.pool is not None and self._ahead is None:
            self._ahead = self.pool.submit(take_step, self.steps, self.clock)

    def settle(self) -> None:
        """Wait until the step started ahead has ended (its result stays for
        :meth:`take`): called before the caller yields to the rank's loop."""
        if self._ahead is not None:
            cf.wait([self._ahead])
