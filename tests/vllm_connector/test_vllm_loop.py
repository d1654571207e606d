"""The connector's poll-fired timers and tombstones (kvferry.cluster.vllm.loop), on a
hand-moved clock. No vLLM needed."""

from __future__ import annotations

import pytest

from kvferry.cluster.vllm.loop import TOMBSTONE_S, TOMBSTONES_SWEPT_AT, PollTimers, Tombstones


class HandClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


def test_timers_fire_when_due_in_order_and_never_early():
    clock = HandClock()
    timers = PollTimers(clock)
    fired: list[str] = []
    timers.call_later(0.3, lambda: fired.append("late"))
    timers.call_later(0.1, lambda: fired.append("early"))
    cancelled = timers.call_later(0.2, lambda: fired.append("cancelled"))
    cancelled.cancel()
    assert timers.fire_due() == 0 and fired == []
    clock.t += 0.1
    assert timers.fire_due() == 1 and fired == ["early"]
    clock.t += 1.0
    assert timers.fire_due() == 1 and fired == ["early", "late"]
    assert timers.pending() == 0


def test_a_timer_armed_by_a_timer_waits_for_the_next_poll():
    clock = HandClock()
    timers = PollTimers(clock)
    runs: list[float] = []

    def again() -> None:
        runs.append(clock.now())
        timers.call_later(0.0, again)

    timers.call_later(0.0, again)
    assert timers.fire_due() == 1  # a poll ends even if a timer re-arms itself at once
    assert timers.fire_due() == 1 and len(runs) == 2


def test_a_failing_timer_is_told_with_its_request_and_the_others_still_fire():
    clock = HandClock()
    told: list[tuple[str | None, str]] = []
    timers = PollTimers(clock, on_error=lambda rid, exc: told.append((rid, str(exc))))
    fired: list[str] = []

    def boom() -> None:
        raise RuntimeError("request r-1: 3 blocks, state awaiting")

    timers.call_later(0.0, boom, rid="r-1")
    timers.call_later(0.0, lambda: fired.append("next"), rid="r-2")
    assert timers.fire_due() == 2
    assert told == [("r-1", "request r-1: 3 blocks, state awaiting")] and fired == ["next"]


def test_without_a_handler_a_failing_timer_raises():
    timers = PollTimers(HandClock())
    timers.call_later(0.0, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        timers.fire_due()


def test_tombstones_are_swept_only_when_many_and_old():
    clock = HandClock()
    stones = Tombstones(clock)
    stones.tombstone("old", clock.now())
    clock.t += TOMBSTONE_S + 1
    stones.sweep()
    assert "old" in stones  # few: kept
    for i in range(TOMBSTONES_SWEPT_AT):
        stones.tombstone(f"r-{i}", clock.now())
    stones.sweep()
    assert "old" not in stones and "r-0" in stones
