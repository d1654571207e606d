"""The router's loop sleeps on the engine's event fd (EngineWaker) instead of polling on a
tick: a message ends the sleep at once, new work from an HTTP handler too, and the runtime
bounds every sleep by what it has pending. The broken mode (the loop not watching the fd)
sleeps through the message, which shows the wake-up test can fail."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvferry.cluster.runtime import WATCH_POLL_S, RankRuntime
from kvferry.cluster.wakeup import EngineWaker
from kvferry.transfer import BatchStatus, TransferConfig, TransferEngine

SLEEP_S = 1.0
SEND_AFTER_S = 0.05


@pytest.fixture
def engines():
    with (
        TransferEngine(TransferConfig(transports="shm", name="sender")) as a,
        TransferEngine(TransferConfig(transports="shm", name="router")) as b,
    ):
        got: list = []
        b.set_message_handler(lambda sender, payload: got.append(payload))
        peer = a.connect(b.address)
        a.send(peer, b"wire-up")
        deliver(a, b, got)
        got.clear()
        yield a, b, peer, got


def deliver(a, b, got: list) -> None:
    deadline = time.monotonic() + 10
    while not got:
        assert time.monotonic() < deadline, "message not delivered within 10 s"
        a.progress(0)
        b.progress(0)


def settle(engine: TransferEngine) -> None:
    """Progress until no event is pending, as the router's pump does before it sleeps."""
    for _ in range(1000):
        if engine.arm():
            return
        engine.progress(0)
    raise AssertionError("the engine never settled: events pending after 1000 progress calls")


async def sleep_until_message(a, b, peer, watched: bool) -> float:
    loop = asyncio.get_running_loop()
    waker = EngineWaker(b, loop)
    if not watched:
        loop.remove_reader(b.fileno())  # the loop no longer watches the engine's fd
    try:
        settle(b)
        loop.call_later(SEND_AFTER_S, lambda: a.send(peer, b"PREFILL"))
        t0 = time.monotonic()
        await waker.sleep(SLEEP_S)
        return time.monotonic() - t0
    finally:
        waker.close()


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "broken-unwatched"])
def test_a_message_ends_the_sleep(engines, watched):
    a, b, peer, got = engines
    slept = asyncio.run(sleep_until_message(a, b, peer, watched))
    deliver(a, b, got)
    assert got == [b"PREFILL"]
    if watched:
        assert slept < SLEEP_S / 2, (
            f"slept {slept:.3f} s through a message sent after {SEND_AFTER_S} s"
        )
    else:
        assert slept >= SLEEP_S * 0.9, f"an unwatched fd still woke the loop after {slept:.3f} s"


def test_wake_ends_the_sleep_and_pending_work_skips_it(engines):
    a, b, peer, got = engines

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        waker = EngineWaker(b, loop)
        try:
            settle(b)
            loop.call_later(SEND_AFTER_S, waker.wake)
            t0 = time.monotonic()
            await waker.sleep(SLEEP_S)
            woken = time.monotonic() - t0
            a.send(peer, b"queued")  # an event not yet progressed: no sleep at all
            # block the loop on purpose: the message reaches the socket, unprogressed
            time.sleep(0.01)  # noqa: ASYNC251
            t0 = time.monotonic()
            while not got:
                await waker.sleep(SLEEP_S)
                b.progress(0)
            return woken, time.monotonic() - t0
        finally:
            waker.close()

    woken, pending = asyncio.run(run())
    assert woken < SLEEP_S / 2
    assert pending < SLEEP_S / 2
    assert got == [b"queued"]


class PendingBatch:
    def peek(self) -> BatchStatus:
        return BatchStatus.PENDING


def test_sleep_bound_and_new_work_hook():
    with TransferEngine(TransferConfig(transports="shm", name="rt")) as engine:
        rt = RankRuntime(0, engine, {})
        calls: list[str] = []
        rt.on_new_work = lambda: calls.append("new")
        assert rt.sleep_bound(1.0) == 1.0
        rt.call_later(0.2, lambda: None)
        assert 0.1 < rt.sleep_bound(1.0) <= 0.2
        rt.watch(PendingBatch(), lambda b: None)
        assert rt.sleep_bound(1.0) == WATCH_POLL_S
        rt.defer(lambda: None)
        assert rt.sleep_bound(1.0) == 0.0
        assert calls == ["new"] * 3
