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

from kvferry.cluster.fencing import (
    FenceOrder,
    FenceRefused,
    fence_order,
    fence_ordered,
    order_fence,
)
from kvferry.cluster.rendezvous import RankCard, card_key, seal_card
from kvferry.cluster.supervise import FenceWatch, _wait_fenced
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


def _card(pid: int, incarnation: int = INCARNATION) -> RankCard:
    return dataclasses.replace(rank_card(RANK, "prefill"), pid=pid, incarnation=incarnation)


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
