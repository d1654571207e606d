"""The simulated clock: one heap of timed callbacks, run in time order.

Events at the same instant run in the order they were scheduled (a sequence number breaks
ties), so a run is a pure function of its inputs and seed. An event is a list
``[time, seq, fn, args]``; cancelling it clears ``fn`` (the heap is not searched).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

Event = list  # [time, seq, fn or None, args]


class Timer:
    """What :meth:`Clock.after` returns: ``cancel()`` stops it if it has not run yet."""

    __slots__ = ("event",)

    def __init__(self, event: Event) -> None:
        self.event = event

    def cancel(self) -> None:
        self.event[2] = None

    @property
    def when(self) -> float:
        return float(self.event[0])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # callbacks run so far
        self._heap: list[Event] = []
        self._seq = itertools.count()
        self._stopped = False

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> Timer:
        event: Event = [max(when, self.now), next(self._seq), fn, args]
        heapq.heappush(self._heap, event)
        return Timer(event)

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> Timer:
        return self.at(self.now + max(0.0, delay_s), fn, *args)

    def stop(self) -> None:
        """End :meth:`run` after the event that calls this."""
        self._stopped = True

    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float) -> None:
        """Run every event due before ``until`` (or until :meth:`stop`)."""
        heap, pop = self._heap, heapq.heappop
        self._stopped = False
        while heap and not self._stopped:
            event = heap[0]
            if event[0] > until:
                break
            pop(heap)
            fn = event[2]
            if fn is None:
                continue
            self.now = event[0]
            self.events += 1
            fn(*event[3])
        if not self._stopped:
            self.now = max(self.now, until)
