"""What a connector worker's polling keeps: its timers and its tombstones.

A vLLM worker runs no event loop of its own: the connector is called by the model runner
(``start_load_kv``, ``get_finished``) and does its work there. So the protocol's timers
(the owner's transfer timeout, retry, abort deadline and proof check; the writer's hold
timeout) are a list the connector's poll fires when due (:meth:`PollTimers.fire_due`):
they are late by at most one engine step, never early, and they run on the worker thread
like everything else the connector does, so no lock is needed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.engine.protocol.ports import Clock

log = logging.getLogger("kvferry.vllm")

TOMBSTONE_S = 600.0  # far past any request's deadline
TOMBSTONES_SWEPT_AT = 4096  # tombstones kept before a sweep looks for old ones


@dataclass(order=True)
class Timer:
    """One armed timer; ``cancel()`` makes it never fire."""

    at: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    rid: str | None = field(compare=False, default=None)
    cancelled: bool = field(compare=False, default=False)

    def cancel(self) -> None:
        self.cancelled = True


class PollTimers:
    """One-shot timers fired from the connector's poll (the protocol's ``Timers`` port).

    ``on_error(rid, exc)`` is told of an exception a timer of request ``rid`` raised (the
    host fails that request through the protocol); the other timers still fire."""

    def __init__(
        self, clock: Clock, on_error: Callable[[str | None, Exception], None] | None = None
    ) -> None:
        self.clock = clock
        self.on_error = on_error
        self._heap: list[Timer] = []
        self._seq = itertools.count()

    def call_later(self, delay_s: float, fn: Callable[[], None], rid: str | None = None) -> Timer:
        timer = Timer(self.clock.now() + max(0.0, delay_s), next(self._seq), fn, rid)
        heapq.heappush(self._heap, timer)
        return timer

    def fire_due(self) -> int:
        """Run every timer due now, earliest first; how many ran. One that a timer arms
        meanwhile waits for the next poll, even if due at once: a poll always ends."""
        now = self.clock.now()
        due: list[Timer] = []
        while self._heap and self._heap[0].at <= now:
            due.append(heapq.heappop(self._heap))
        ran = 0
        for timer in due:
            if timer.cancelled:  # an earlier timer of this poll may have cancelled it
                continue
            ran += 1
            try:
                timer.fn()
            except Exception as exc:
                if self.on_error is None:
                    raise
                self.on_error(timer.rid, exc)
        return ran

    def pending(self) -> int:
        """Timers armed and not cancelled."""
        return sum(1 for t in self._heap if not t.cancelled)


class Tombstones:
    """Request ids that ended here (I2): a late message for one never revives it. The
    drivers' ``Tombstones`` port; swept of ids older than ``TOMBSTONE_S``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.at: dict[str, float] = {}

    def tombstone(self, rid: str, at: float) -> None:
        self.at[rid] = at

    def __contains__(self, rid: object) -> bool:
        return rid in self.at

    def sweep(self) -> None:
        if len(self.at) > TOMBSTONES_SWEPT_AT:
            cut = self.clock.now() - TOMBSTONE_S
            self.at = {r: t for r, t in self.at.items() if t > cut}
