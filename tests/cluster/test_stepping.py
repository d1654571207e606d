"""A long decode step never starves its rank (cluster/stepping.py), each rule with its
broken mode.

- The rank's loop goes on pumping (heartbeats, ABORTs, other requests' bytes) while a long
  step runs on the step thread; run inline (the rank as it was) the same step sees no
  pump at all.
- A short step runs inline; a long one (by its context, then by the last step's cost per
  token) goes to the thread.
- The step's requests are pinned in the driver: an event for one of them waits for the
  step's end, then is carried out in order; other requests' events go on meanwhile. A
  driver that does not pin carries the event out under the step.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import pytest

from kvferry.cluster import launch
from kvferry.cluster.stepping import FIRST_GUESS_TOKENS, Stepper
from kvferry.engine.protocol.driver import Driver
from kvferry.engine.protocol.table import Move

PUMPS_WANTED = 5  # pumps the slow step waits to see while it runs
STEP_WAIT_S = 2.0  # its deadline: inline, no pump can come, and it gives up then


@dataclass
class Req:
    prompt_len: int
    generated: list[int] = field(default_factory=list)


@dataclass
class Plan:
    batch: list[Req]


class Loop:
    """The rank's runtime, as far as the loop uses it: counts pumps, and lets a step
    waiting for them go once ``PUMPS_WANTED`` came while it ran."""

    def __init__(self) -> None:
        self.pumps = 0
        self.step_started_at: int | None = None
        self.enough = threading.Event()

    def pump(self, timeout_s: float = 0.0, stay_awake: bool = False) -> int:
        self.pumps += 1
        started = self.step_started_at
        if started is not None and self.pumps - started >= PUMPS_WANTED:
            self.enough.set()
        return 0

    def progress_for(self, budget_s: float) -> None:
        self.pump()


class SlowRank:
    """One request of a million tokens decoding; its step waits for the loop's pumps."""

    def __init__(self, loop: Loop, steps: int = 1) -> None:
        self.loop = loop
        self.left = steps
        self.ended: list[tuple[list[int] | None, BaseException | None]] = []
        self.pumps_during_step: list[int] = []

    def busy(self) -> bool:
        return self.left > 0

    def in_flight(self) -> bool:
        return False

    def awaiting_peers(self) -> bool:
        return False

    def begin_step(self) -> Plan | None:
        if self.left <= 0:
            return None
        self.left -= 1
        self.loop.enough.clear()
        self.loop.step_started_at = self.loop.pumps
        return Plan([Req(prompt_len=1_000_000)])

    def run_step(self, plan: Plan) -> list[int]:
        start = self.loop.step_started_at or 0
        self.loop.enough.wait(STEP_WAIT_S)
        self.pumps_during_step.append(self.loop.pumps - start)
        return [7]

    def end_step(self, plan: Plan, out: list[int] | None, error: BaseException | None) -> None:
        self.loop.step_started_at = None
        self.ended.append((out, error))


def _run(step_thread: bool) -> SlowRank:
    loop = Loop()
    rank = SlowRank(loop)
    launch.run_worker(
        loop,  # type: ignore[arg-type]
        rank,
        decode=True,
        stopped=lambda: bool(rank.ended),
        step_thread=step_thread,
    )
    return rank


def test_the_loop_pumps_while_a_long_step_runs_on_the_step_thread():
    rank = _run(step_thread=True)
    assert rank.ended == [([7], None)]
    assert rank.pumps_during_step[0] >= PUMPS_WANTED


def test_broken_mode_a_long_step_inline_starves_the_loop():
    rank = _run(step_thread=False)
    assert rank.ended == [([7], None)]
    assert rank.pumps_during_step == [0]  # caught: nothing pumped while it ran


class Quick:
    def __init__(self, tokens: list[int]) -> None:
        self.plans = [Plan([Req(prompt_len=n)]) for n in tokens]
        self.threads: list[str] = []
        self.ended = 0

    def begin_step(self) -> Plan | None:
        return self.plans.pop(0) if self.plans else None

    def run_step(self, plan: Plan) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return [1]

    def end_step(self, plan, out, error) -> None:
        assert error is None and out == [1]
        self.ended += 1


def _drain(stepper: Stepper) -> None:
    for _ in range(1000):
        if not stepper.poll() and not stepper.running:
            return
    raise AssertionError("the stepper never ran dry")


@pytest.mark.parametrize(
    ("tokens", "seconds_per_token", "threaded"),
    [
        (100, None, False),  # untimed yet: a short context runs inline
        (FIRST_GUESS_TOKENS + 1, None, True),  # untimed yet: a long one goes to the thread
        (1000, 1e-9, False),  # timed: 1 µs predicted, inline
        (1000, 1.0, True),  # timed: 1000 s predicted, the thread
    ],
)
def test_a_step_runs_inline_or_on_the_thread_by_its_predicted_cost(
    tokens, seconds_per_token, threaded
):
    rank = Quick([tokens])
    stepper = Stepper(rank)
    stepper.seconds_per_token = seconds_per_token
    _drain(stepper)
    stepper.close()
    assert rank.ended == 1
    on_thread = rank.threads[0].startswith("kvferry-step")
    assert on_thread is threaded, rank.threads
    assert (stepper.threaded_steps, stepper.inline_steps) == ((1, 0) if threaded else (0, 1))


# ---------------------------------------------------------------- pinned subjects
class S(enum.Enum):
    LIVE = "live"
    GONE = "gone"


class E(enum.Enum):
    ABORT = "abort"


class Do(enum.Enum):
    FREE = "free"


TABLE = {(S.LIVE, E.ABORT): Move(S.GONE, (Do.FREE,)), (S.GONE, E.ABORT): Move(S.GONE, ())}


@dataclass
class Book:
    state: S = S.LIVE


@dataclass
class Subject:
    name: str
    book: Book = field(default_factory=Book)


class NoPinDriver(Driver):
    """The broken mode: pinning does nothing."""

    def pin(self, subject) -> None:
        pass


@pytest.mark.parametrize("broken", [False, True])
def test_a_pinned_requests_events_wait_for_the_step_and_others_go_on(broken):
    freed: list[str] = []
    cls = NoPinDriver if broken else Driver
    driver = cls(TABLE, lambda do, subj: freed.append(subj.name))
    stepping, other = Subject("stepping"), Subject("other")
    driver.pin(stepping)
    driver.feed(stepping, E.ABORT)
    driver.feed(other, E.ABORT)
    if broken:
        assert freed == ["stepping", "other"]  # caught: freed under the running step
        return
    assert freed == ["other"] and stepping.book.state is S.LIVE
    driver.unpin(stepping)
    assert freed == ["other", "stepping"] and stepping.book.state is S.GONE
