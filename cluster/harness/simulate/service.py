"""The ranks' own time: each simulated rank (the router, a prefill, a decode rank) is a
single server.

What reaches a rank (a message, a timer, a settled batch's callback, the router's HTTP
events) waits in the rank's queue while the rank is busy, in arrival order. Handling a
message costs a service time drawn from its role's distribution, and its effects (the
messages it sends) happen when that service ends; a timer or a callback runs at once when
the rank is free and occupies it for ``callback_s`` afterwards. A rank that was idle
(no request in flight for longer than its busy-poll window) first wakes on its event fd;
the router, an asyncio loop sleeping on its engine's fd, always does.

Background work occupies a rank in pieces, as the real loops run it: a decode rank with
requests decoding steps them back to back (one step of ``RankTimes.decode_step`` for the
batch, which an ABORT arriving meanwhile waits out), and a prefill compute or the
owner's checks run in slices (``PREFILL_SLICE_S``, ``VERIFY_SLICE_S`` or one model step,
whichever is longer), one job after another. Only time is modelled: what a rank does is
decided by its real code, in the order the queue gives.

The background's own end is not pushed back by the messages handled between its pieces
(a prefill ends when its compute would alone; a rank's messages are short next to it).

:data:`MEASURED` holds the figures fitted on this machine (:mod:`.calibrate`);
``Scenario.service = None`` (``--no-service-model``) turns the model off: every event
runs the instant it arrives and computes take no rank time, as before the model.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Draw:
    """``LogNormal(median_s, sigma)``, plus with probability ``tail_p`` an exponential
    extra of mean ``tail_mean_s``."""

    median_s: float
    sigma: float = 0.0
    tail_p: float = 0.0
    tail_mean_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        s = self.median_s
        if self.sigma:
            s *= math.exp(self.sigma * rng.gauss(0.0, 1.0))
        if self.tail_p and rng.random() < self.tail_p:
            s += rng.expovariate(1.0 / self.tail_mean_s)
        return s


def _us(median: float, sigma: float, tail_p: float = 0.0, tail_mean: float = 0.0) -> Draw:
    return Draw(median * 1e-6, sigma, tail_p, tail_mean * 1e-6)


@dataclass(frozen=True)
class ServiceModel:
    message: dict[str, Draw]  # by role: "router", "prefill", "decode"
    callback_s: float  # a timer's or a settled batch's callback
    wake_worker: Draw  # an idle prefill or decode rank, asleep on its engine's event fd
    wake_router: Draw  # the router's asyncio loop (add_reader on the engine's fd)
    idle_after_s: float = 0.001  # a worker polls this long after its last event (busy_poll_us)
    source: str = ""


# Measured on this machine (2 cores, shared with other work while measuring) with
# ``python -m kvferry.cluster.harness.simulate --calibrate`` (module .calibrate):
# - message: the real codec (encode of what a handler sends, decode of what it got) and
#   the ranks' real handlers, per message, in a 10x10 steady run of 300 requests (1,203
#   decode, 1,602 prefill, 2,400 router messages): decode median 91 us (p99 675 us; its
#   ASSIGN, which allocates and plans, costs several times its ABORT), prefill 68 us
#   (p99 305 us), router 35 us (p99 94 us); sigma from p90 / p50, the share past p99
#   and its mean excess as the tail;
# - callback: a timer's or a settled write's handler, taken as a small message's cost;
# - wake: a process asleep in select() on a pipe another process wrote to: median 138 us,
#   p99 2.7 ms (a rank on its engine's event fd); an asyncio loop with add_reader:
#   median 304 us, p99 1.7 ms (the router);
# - decode step and prefill compute (RankTimes): scenarios.REPLAY_TIMES.
MEASURED = ServiceModel(
    message={
        "router": _us(34.9, 0.393, 0.0096, 200.1),
        "decode": _us(91.3, 1.175, 0.01, 1461.2),
        "prefill": _us(68.4, 0.547, 0.01, 912.0),
    },
    callback_s=20e-6,
    wake_worker=_us(137.9, 0.704, 0.0069, 411.3),
    wake_router=_us(303.8, 0.259, 0.0069, 1161.3),
    idle_after_s=0.001,
    source="measured on this machine (simulate --calibrate)",
)


class Background:
    """A rank's background work, as pieces no event can interrupt: its decode steps (back
    to back while requests decode) and its computes (one after another, in slices)."""

    __slots__ = ("_anchor", "_jobs", "_step", "_until", "compute_free_at")

    def __init__(self) -> None:
        self._anchor: float | None = None  # a step boundary while stepping
        self._step = 0.0
        self._until = 0.0  # the last step's end, once stepping stopped
        self._jobs: list[tuple[float, float, float]] = []  # (start, end, slice)
        self.compute_free_at = 0.0

    # -------------------------------------------------------------- decode steps
    def _step_end(self, t: float) -> float:
        a = self._anchor
        if a is None:
            return max(t, self._until)
        if t <= a:
            return a
        k = math.ceil((t - a) / self._step - 1e-12)
        return a + k * self._step

    def stepping(self, t: float, step_s: float | None) -> None:
        """From ``t`` the batch steps take ``step_s`` each (None: no request decodes); the
        step in progress ends as it began."""
        end = self._step_end(t)
        if step_s is None:
            self._anchor, self._until = None, end
        elif self._anchor is None and end <= t:
            self._anchor, self._step = t, step_s  # the first step starts now
        else:
            self._anchor, self._step = end, step_s

    def resume(self, t: float) -> None:
        """The rank's queue is empty at ``t``: the next step starts now."""
        if self._anchor is not None and self._anchor < t:
            self._anchor = t

    # -------------------------------------------------------------- computes
    def compute(self, t: float, seconds: float, slice_s: float) -> float:
        """Queue a compute of ``seconds``; returns when it ends."""
        start = max(t, self.compute_free_at)
        end = start + seconds
        self.compute_free_at = end
        jobs = self._jobs
        while jobs and jobs[0][1] <= t:
            jobs.pop(0)
        jobs.append((start, end, max(slice_s, 1e-9)))
        return end

    def _compute_end(self, t: float) -> float:
        jobs = self._jobs
        while jobs and jobs[0][1] <= t:
            jobs.pop(0)
        if not jobs or jobs[0][0] > t:
            return t
        start, end, sl = jobs[0]
        return min(end, start + math.ceil((t - start) / sl - 1e-12) * sl)

    def free_at(self, t: float) -> float:
        """When the piece in progress at ``t`` ends (``t`` if none is)."""
        return max(self._step_end(t), self._compute_end(t))

    def active(self, t: float) -> bool:
        return self._anchor is not None or self.compute_free_at > t


def slices_of(seconds: float, steps: int, slice_s: float) -> float:
    """The piece a sliced compute of ``steps`` equal model steps runs before it polls
    (``run_in_slices``: steps until ``slice_s`` passed)."""
    step = seconds / max(1, steps)
    return min(seconds, step * max(1, math.ceil(slice_s / step - 1e-12))) if step else seconds


__all__ = ["MEASURED", "Background", "Draw", "ServiceModel", "slices_of"]
