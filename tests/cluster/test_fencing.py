"""Fence orders (cluster/fencing.py) and the launcher that carries them out
(cluster/supervise.py), without a cluster: a real child process, a store in a dict.

A genuine order naming the child's incarnation kills it; an order written without the
cluster's secret, or naming another incarnation, stops nothing (each the broken mode of
the first: were either taken, a stranger or a stale order could kill a healthy rank).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess

import pytest
from test_protocol_units import _card as rank_card

from kvferry.cluster import runtime as runtime_mod
from kvferry.cluster import store as store_mod
from kvferry.cluster import supervise
from kvferry.cluster.fencing import (
    FenceOrder,
    FenceRefused,
    fence_order,
    fence_ordered,
    order_fence,
)
from kvferry.cluster.hostid import this_host
from kvferry.cluster.rendezvous import (
    ExitRecord,
    RankCard,
    card_key,
    exit_record,
    publish_exit,
    seal_card,
)
from kvferry.cluster.runtime import DRAIN_S, RankRuntime
from kvferry.cluster.supervise import FenceWatch, _publish, _wait_fenced
from kvferry.cluster.trust import Trust

RANK, INCARNATION = 1, 0x51
TRUST = Trust(b"s" * 32)
STRANGER = Trust(b"x" * 32)


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value


def _card(pid: int, incarnation: int = INCARNATION, host: str | None = None) -> RankCard:
    """Rank 1's card of ``incarnation``: its process ``pid`` on ``host`` (default this
    launcher's)."""
    return dataclasses.replace(
        rank_card(RANK, "prefill"), pid=pid, incarnation=incarnation, host=host or this_host()
    )


def _watched(child: subprocess.Popen, store: DictStore) -> FenceWatch:
    store.set(card_key(RANK), seal_card(_card(child.pid), TRUST))
    watch = FenceWatch(RANK, child.pid, "127.0.0.1:1", TRUST)
    watch.store = store  # no store process: the dict stands for it
    return watch


def test_an_order_round_trips_and_a_forged_or_misfiled_one_is_refused():
    store = DictStore()
    assert fence_ordered(store, RANK, INCARNATION, TRUST) is None
    order = fence_order(RANK, INCARNATION, "no ABORT_ACK within 2.0 s")
    order_fence(store, order, TRUST)
    assert fence_ordered(store, RANK, INCARNATION, TRUST) == order
    with pytest.raises(FenceRefused, match="does not verify"):
        fence_ordered(store, RANK, INCARNATION, STRANGER)
    other = FenceOrder(RANK, INCARNATION + 1, "x", 0.0)
    key = next(iter(store.data.keys() - {card_key(RANK)}))
    store.set(key, TRUST.sign_record("kvferry/fence-order", other.pack()))
    with pytest.raises(FenceRefused, match="holds the order for rank 1 incarnation 0x52"):
        fence_ordered(store, RANK, INCARNATION, TRUST)


def test_the_launcher_kills_its_child_on_a_genuine_order():
    store = DictStore()
    child = subprocess.Popen(["sleep", "30"])
    watch = _watched(child, store)
    order_fence(store, fence_order(RANK, INCARNATION, "severed"), TRUST)
    status = _wait_fenced(child.pid, watch)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


@pytest.mark.parametrize("order", ["forged", "another incarnation", "none"])
def test_broken_modes_an_order_it_must_not_take_stops_nothing(order):
    store = DictStore()
    child = subprocess.Popen(["sleep", "1"])
    watch = _watched(child, store)
    if order == "forged":
        order_fence(store, fence_order(RANK, INCARNATION, "severed"), STRANGER)
    elif order == "another incarnation":
        order_fence(store, fence_order(RANK, INCARNATION + 1, "severed"), TRUST)
    status = _wait_fenced(child.pid, watch)
    assert os.waitstatus_to_exitcode(status) == 0  # it ran to its end
    if order == "forged":
        assert "refused" in watch.complained, watch.complained


def test_a_card_of_an_earlier_incarnation_names_nobody():
    """Until the child published its own card, the card in the store is its predecessor's
    (another pid): an order for that incarnation is not the child's."""
    store = DictStore()
    child = subprocess.Popen(["sleep", "1"])
    watch = _watched(child, store)
    store.set(card_key(RANK), seal_card(_card(pid=child.pid + 100_000), TRUST))
    order_fence(store, fence_order(RANK, INCARNATION, "severed"), TRUST)
    status = _wait_fenced(child.pid, watch)
    assert os.waitstatus_to_exitcode(status) == 0


# A rank restarted in a fresh pid namespace (a new container, another node) gets small pids
# again: the card still in the store may be its predecessor's, with the new child's pid.
OTHER_HOST = "node-a:deadbeef:4026531836"


def _pid_only(card: RankCard, pid: int) -> bool:
    return card.pid == pid


@pytest.mark.parametrize("broken", [False, True], ids=["pid-and-host", "broken-pid-only"])
def test_a_predecessors_card_with_the_childs_pid_on_another_host_names_nobody(monkeypatch, broken):
    """Its fence order is not the child's. Broken mode: the card matched by pid alone; the
    predecessor's order kills the new child."""
    if broken:
        monkeypatch.setattr(supervise, "_is_childs", _pid_only)
    store = DictStore()
    child = subprocess.Popen(["sleep", "1"])
    watch = _watched(child, store)
    store.set(card_key(RANK), seal_card(_card(child.pid, host=OTHER_HOST), TRUST))
    order_fence(store, fence_order(RANK, INCARNATION, "severed"), TRUST)
    status = _wait_fenced(child.pid, watch)
    assert os.waitstatus_to_exitcode(status) == (-signal.SIGKILL if broken else 0)


@pytest.mark.parametrize("broken", [False, True], ids=["pid-and-host", "broken-pid-only"])
def test_a_launcher_publishes_no_exit_for_a_predecessor_it_never_ran(monkeypatch, broken):
    """The new child dies before its card: the card in the store is the predecessor's
    (same pid, another host), which may be alive behind a partition. No exit record may
    say it is gone. Broken mode: matched by pid alone, its exit is published."""
    if broken:
        monkeypatch.setattr(supervise, "_is_childs", _pid_only)
    store = DictStore()
    monkeypatch.setattr(store_mod, "connect", lambda *a, **k: store)
    child = subprocess.Popen(["true"])
    child.wait()
    store.set(card_key(RANK), seal_card(_card(child.pid, host=OTHER_HOST), TRUST))
    _publish(RANK, child.pid, 3, "127.0.0.1:1", TRUST)
    assert (exit_record(store, RANK, INCARNATION, TRUST) is not None) is broken
    store.set(card_key(RANK), seal_card(_card(child.pid), TRUST))  # its own card: published
    _publish(RANK, child.pid, 3, "127.0.0.1:1", TRUST)
    assert exit_record(store, RANK, INCARNATION, TRUST) is not None


class _Engine:
    incarnation = 7

    def set_message_handler(self, fn) -> None:
        pass

    def failure_horizon(self):
        return type("Horizon", (), {"seconds": 4.0})()


@pytest.mark.parametrize("broken", [False, True], ids=["card-checked", "broken-taken"])
def test_an_exit_record_that_names_another_process_than_the_card_proves_nothing(
    monkeypatch, broken
):
    """An owner on a third host waits on rank 1's incarnation: a signed exit record for
    that incarnation naming another host or pid than its card (a launcher that took a
    predecessor's card for its child's) is refused and counted. Broken mode: any signed
    record is taken; the quarantine is released on it."""
    if broken:
        monkeypatch.setattr(RankRuntime, "_record_fits", lambda self, record: True)
    clock = [1000.0]
    monkeypatch.setattr(runtime_mod.time, "monotonic", lambda: clock[0])
    store = DictStore()
    writer = _card(4321, host=OTHER_HOST)
    record = ExitRecord(
        rank=RANK, incarnation=INCARNATION, pid=4321, host="node-b:1:1", status=-9, at=0.0
    )
    publish_exit(store, record, TRUST)
    cards = {
        2: dataclasses.replace(rank_card(2, "decode"), incarnation=7, host="node-c:1:1"),
        RANK: writer,
    }
    rt = RankRuntime(2, _Engine(), cards, store=store, trust=TRUST)
    rt.write_path_closed(RANK, INCARNATION)
    clock[0] += 4.0 + DRAIN_S + 0.01
    proof = rt.write_path_closed(RANK, INCARNATION)
    if broken:
        assert proof is not None  # the test catches the release on a record of another
        return
    assert proof is None and rt.counters.exit_records_refused >= 1
    assert rt.poll_exits() == [] and not rt.process_exited(RANK)
