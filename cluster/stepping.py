"""Decode steps off the rank's loop thread, so that a long step never starves the rank.

A decode step over a long context costs what its attention costs: seconds for a batch of
million-token requests on a CPU rank. Run on the loop's thread, it held back everything
else the rank does: the STATS that are its heartbeat (the router marks a rank silent for
5 s unhealthy and routes nothing more to it), ABORTs and acks of other requests, and over
tcp the progress that moves its writers' bytes. So a step predicted to be long runs on one
step thread while the loop goes on pumping; the loop takes the step's results when it
ends. A short step runs inline: handing it to a thread costs more than it saves.

Only the compute leaves the loop's thread (:meth:`DecodeRank.run_step`: the model over the
pool, no request, book or message). Planning the step and applying its results stay on
it, and the step's requests are pinned in the owner's driver meanwhile: their events
(an ABORT, a timer) wait for the step, which reads their pages and writes the new token's
KV into them. Everything else the rank does goes on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

STEP_INLINE_S = 0.01  # a step predicted to take less runs on the loop's thread
FIRST_GUESS_TOKENS = 65_536  # untimed yet: a batch reading more context goes to the thread
STEP_POLL_S = 0.001  # how long the loop sleeps on its engine between looks at the step


class Steps(Protocol):
    """What :class:`Stepper` needs of a decode rank."""

    def begin_step(self) -> Any: ...

    def run_step(self, plan: Any) -> list[int] | None: ...

    def end_step(self, plan: Any, out: list[int] | None, error: BaseException | None) -> None: ...


def context_tokens(plan: Any) -> int:
    """The tokens a step of ``plan`` reads: every request's context so far."""
    return sum(r.prompt_len + len(r.generated) for r in plan.batch)


class Stepper:
    """Runs a rank's decode steps, long ones on one step thread. ``threaded=False`` runs
    every step inline (the rank as it was: the broken mode of its test)."""

    def __init__(self, worker: Steps, *, threaded: bool = True) -> None:
        self.worker = worker
        self.threaded = threaded
        self._pool: ThreadPoolExecutor | None = None
        self._running: tuple[Any, Future, float] | None = None
        self.seconds_per_token: float | None = None  # the last timed step's cost
        self.threaded_steps = 0
        self.inline_steps = 0

    @property
    def running(self) -> bool:
        """A step runs on the step thread now."""
        return self._running is not None

    def poll(self) -> bool:
        """End the step thread's step if it finished; then start the next step if the
        rank has one, inline or on the thread. False when nothing runs or ran."""
        if self._running is not None:
            plan, future, started = self._running
            if not future.done():
                return True
            self._running = None
            failed = future.exception()
            self._timed(plan, time.monotonic() - started)
            self.worker.end_step(plan, None if failed else future.result(), failed)
        plan = self.worker.begin_step()
        if plan is None:
            return False
        started = time.monotonic()
        if self._off_thread(plan):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvferry-step")
            self._running = (plan, self._pool.submit(self.worker.run_step, plan), started)
            self.threaded_steps += 1
            return True
        out: list[int] | None = None
        error: BaseException | None = None
        try:
            out = self.worker.run_step(plan)
        except Exception as exc:
            error = exc
        self._timed(plan, time.monotonic() - started)
        self.inline_steps += 1
        self.worker.end_step(plan, out, error)
        return True

    def close(self) -> None:
        """Leave a running step to end on its own (the process is stopping)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _off_thread(self, plan: Any) -> bool:
        if not self.threaded:
            return False
        tokens = context_tokens(plan)
        if self.seconds_per_token is None:
            return tokens > FIRST_GUESS_TOKENS
        return tokens * self.seconds_per_token > STEP_INLINE_S

    def _timed(self, plan: Any, seconds: float) -> None:
        tokens = context_tokens(plan)
        if tokens > 0:
            self.seconds_per_token = seconds / tokens
