"""bench-abort's floor: the bare two-hop exchange between three processes' engines."""

from __future__ import annotations

from kvferry.cluster.harness.benchabort import run_relay


def test_relay_times_every_exchange_on_one_clock():
    summary = run_relay(4, "shm")
    assert summary["count"] == 4
    assert 0 < summary["p50_ms"] <= summary["max_ms"] < 10_000
