"""Adaptive polling: after traffic a worker keeps polling for ``busy_poll_us`` (no wake-up
per message), then sleeps on its event fd, so an idle engine burns no CPU. The same
measurement run with a window longer than the wait (the deliberately burning setting)
must show the CPU being burnt, which shows that the measurement can fail."""

from __future__ import annotations

import time

import pytest

from kvferry.transfer import TransferConfig, TransferEngine

WAIT_S = 0.3
IDLE_CPU_LIMIT_S = 0.03  # a sleeping wait uses ~0; a spinning one gets far more than this


def exchange_one_message(a: TransferEngine, b: TransferEngine) -> None:
    got: list = []
    b.set_message_handler(lambda sender, payload: got.append(payload))
    peer = a.connect(b.address)
    batch = a.send(peer, b"wake")
    deadline = time.monotonic() + 10.0
    while not (got and batch.done()):
        assert time.monotonic() < deadline, "message not delivered within 10 s"
        a.progress(0)
        b.progress(0)


def cpu_of_wait(b: TransferEngine) -> float:
    c0 = time.process_time()
    b.progress(WAIT_S)
    return time.process_time() - c0


@pytest.mark.parametrize("busy_poll_us,burns", [(1000, False), (10_000_000, True)])
def test_worker_sleeps_after_its_busy_window(busy_poll_us, burns):
    with (
        TransferEngine(TransferConfig(transports="shm", name="a")) as a,
        TransferEngine(TransferConfig(transports="shm", name="b", busy_poll_us=busy_poll_us)) as b,
    ):
        exchange_one_message(a, b)
        cpu = cpu_of_wait(b)  # right after traffic: at most the window is spent polling
        if burns:
            assert cpu > IDLE_CPU_LIMIT_S, f"expected a burning wait, used {cpu:.3f} s"
        else:
            assert cpu < IDLE_CPU_LIMIT_S, f"idle wait used {cpu:.3f} s of CPU"
            assert cpu_of_wait(b) < IDLE_CPU_LIMIT_S  # and every later idle wait


def test_zero_window_still_delivers():
    """busy_poll_us=0 (sleep at once) only costs wake-ups, never messages."""
    with (
        TransferEngine(TransferConfig(transports="shm", name="a", busy_poll_us=0)) as a,
        TransferEngine(TransferConfig(transports="shm", name="b", busy_poll_us=0)) as b,
    ):
        exchange_one_message(a, b)
        assert b.counters.messages_received == 1
