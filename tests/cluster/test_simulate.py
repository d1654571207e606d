"""The simulator (kvferry.cluster.harness.simulate) at its small scale.

- Every scenario at 10 x 10 passes every safety check with the protocol as shipped: no
  page released while a simulated write could still land, none overwritten, every page
  free at the end (but those I4 must hold for a crashed writer on another host), every
  request answered.
- The broken modes are caught: ``owner_table(unsafe=True)`` and ``release_on_sever``
  release pages with a write still in flight in the slow-writer scenario, and the late
  write lands in another request's page; with a slower link the abort storm catches the
  unsafe table too.
- A run is a function of its seed.
- The network model loses, duplicates and reorders messages at the configured rates.

No sleeps and no timing assertions: the clock is simulated.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from kvferry.cluster.harness.simulate import scenarios
from kvferry.cluster.harness.simulate.clock import Clock
from kvferry.cluster.harness.simulate.network import Layout, NetConfig, Network
from kvferry.cluster.harness.simulate.world import run

SMALL = "10x10"
REQUESTS = 200


def small(name: str, mode: str = "safe", **kw) -> scenarios.Scenario:
    return scenarios.build(name, SMALL, requests=REQUESTS, mode=mode, **kw)


@pytest.mark.parametrize("name", scenarios.NAMES)
def test_every_scenario_is_safe_at_the_small_scale(name):
    r = run(small(name))
    assert r["checks"] == {
        "no_release_while_landing": True,
        "no_page_overwritten": True,
        "every_page_free_at_end": True,
        "every_request_answered": True,
    }, r["examples"]
    assert r["requests"] == REQUESTS and r["unanswered"] == 0
    assert r["served"] > 0
    if name in ("partition", "slow"):
        assert r["severed_ranks"] >= 1, "the fault reaches the abort deadline"
        assert r["releases"].get("severed", 0) >= 1, "released on proof after severing"
    if name == "crash":
        assert r["crash"]["crashes"] >= 2


def test_the_real_tables_run_the_rank_code():
    """The simulated ranks are the service's rank classes (their handlers and effects)."""
    from kvferry.cluster.decode import DecodeRank
    from kvferry.cluster.harness.simulate.ranks import SimDecodeRank, SimPrefillRank
    from kvferry.cluster.prefill import PrefillRank

    assert issubclass(SimDecodeRank, DecodeRank) and issubclass(SimPrefillRank, PrefillRank)
    for name in ("_do", "_on_assign", "_on_notice", "_on_abort", "_on_ack", "_arm_retry"):
        assert getattr(SimDecodeRank, name) is getattr(DecodeRank, name)
    for name in ("_do", "_feed", "_on_plan", "_on_abort", "_send_notice", "_on_written"):
        assert getattr(SimPrefillRank, name) is getattr(PrefillRank, name)


@pytest.mark.parametrize("mode", ["unsafe", "release-on-sever"])
def test_each_broken_mode_leaks_where_a_write_can_still_land(mode):
    """The slow writer stalls with a write in flight past the abort deadline: the unsafe
    table frees at the abort, release_on_sever at the deadline; the write lands later."""
    r = run(small("slow", mode))
    assert r["leak"] and not r["safe"]
    assert r["released_while_landing_pages"] > 0
    assert r["overwritten_pages"] + r["landed_in_free_pages"] > 0
    assert not r["checks"]["no_release_while_landing"]


def test_the_unsafe_table_leaks_in_an_abort_storm_on_a_slow_link():
    sc = small("storm", "unsafe")
    sc = replace(sc, net=replace(sc.net, bandwidth_gbps=1.0))
    r = run(sc)
    assert r["released_while_landing_pages"] > 0 and r["overwritten_pages"] > 0
    safe = run(replace(sc, unsafe=False))
    assert safe["safe"], safe["examples"]


def test_same_seed_same_result():
    a, b = run(small("storm", seed=3)), run(small("storm", seed=3))
    for r in (a, b):
        for k in ("wall_s", "events_per_s"):
            r.pop(k)
    assert a == b
    c = run(small("storm", seed=4))
    assert c["abort_from_router"] != a["abort_from_router"]


def test_loss_duplication_and_reordering_happen_at_their_rates():
    n = 20_000
    clock = Clock()
    cfg = NetConfig(loss=0.05, dup=0.03, reorder=0.1, reorder_ms=5.0)
    net = Network(clock, cfg, Layout(1, 1, 1, 1), random.Random(11))
    got: list[tuple[int, bool]] = []
    for i in range(n):
        clock.at(i * 1e-3, net.message, 1, 2, lambda twin, i=i: got.append((i, twin)))
    clock.run(n)
    c = net.counters
    assert c.messages == n
    assert c.lost / n == pytest.approx(0.05, abs=0.006)
    assert c.duplicated / (n - c.lost) == pytest.approx(0.03, abs=0.005)
    assert c.reordered / (n - c.lost) == pytest.approx(0.1, abs=0.01)
    assert len(got) == n - c.lost + c.duplicated
    assert sum(twin for _, twin in got) == 2 * c.duplicated
    order = [i for i, _ in got]
    overtaken = sum(1 for a, b in itertools.pairwise(order) if b < a)
    assert overtaken > 0.5 * c.reordered, "a held-back message is overtaken"
    # seeded: the same seed gives the same deliveries
    clock2 = Clock()
    net2 = Network(clock2, cfg, Layout(1, 1, 1, 1), random.Random(11))
    got2: list[tuple[int, bool]] = []
    for i in range(n):
        clock2.at(i * 1e-3, net2.message, 1, 2, lambda twin, i=i: got2.append((i, twin)))
    clock2.run(n)
    assert got2 == got


def test_a_partition_holds_within_the_failure_horizon_and_cuts_past_it():
    clock = Clock()
    layout = Layout(2, 2, ranks_per_host=1, hosts_per_rack=1)
    net = Network(clock, NetConfig(failure_horizon_s=4.0), layout, random.Random(1))
    racks = frozenset({layout.rack[1]})
    net.partition(racks, 0.0, 10.0)
    arrived, failed = [], []
    clock.at(7.0, net.message, 1, 3, lambda twin: arrived.append(clock.now), lambda: None)
    clock.at(
        1.0,
        net.message,
        1,
        3,
        lambda twin: arrived.append(clock.now),
        lambda: failed.append(clock.now),
    )
    clock.at(1.0, net.message, 2, 3, lambda twin: arrived.append(clock.now))
    clock.run(100)
    assert len(arrived) == 2 and min(arrived) < 1.1 and max(arrived) >= 10.0
    assert failed == [pytest.approx(5.0)]
