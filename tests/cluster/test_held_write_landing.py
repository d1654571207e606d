"""When the fault suite's held (in-flight) write lands: right after the writer's next write
of another request into any of the same remote bytes, or once another request's writes to
that owner ended (its final notice) without touching them; never on another request's
write elsewhere while that request may still write. The fault suite's unsafe rows show a
leak only if the late write lands over the reused pages after their new owner's bytes;
landing on the next write to the owner, whatever pages it carried, left the reused pages
to a later batch on a loaded machine (smaller batches), which wrote them over the late
write and hid the leak. Its safe rows need the late write to land before the owner's
abort deadline, which the other request's end of writing gives them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster.faults import FaultPlan, HeldWrite

PAGE = 4096


def held(rid: str, remote_pages: list[int], owner: int = 1) -> HeldWrite:
    triples = np.array([[i * PAGE, p * PAGE, PAGE] for i, p in enumerate(remote_pages)])
    return HeldWrite(rid, owner, 7, None, triples.astype(np.int64), None, None)


def runs(remote: list[tuple[int, int]]) -> np.ndarray:
    return np.array([[0, start, length] for start, length in remote], dtype=np.int64)


def brute_force(h: HeldWrite, posted: np.ndarray) -> bool:
    return any(
        a < c + m and c < a + n for _, a, n in h.triples.tolist() for _, c, m in posted.tolist()
    )


@settings(max_examples=300, deadline=None)
@given(
    held_pages=st.lists(st.integers(0, 40), min_size=0, max_size=12, unique=True),
    posted=st.lists(st.tuples(st.integers(0, 41 * PAGE), st.integers(1, 3 * PAGE)), max_size=8),
)
def test_overlap_is_any_shared_remote_byte(held_pages, posted):
    h = held("A", held_pages)
    p = runs(posted)
    assert h.overlaps(p) == brute_force(h, p)


def test_edges_touching_do_not_overlap():
    h = held("A", [2, 3])
    assert not h.overlaps(runs([(0, 2 * PAGE)]))  # ends where the held run starts
    assert not h.overlaps(runs([(4 * PAGE, PAGE)]))  # starts where it ends
    assert h.overlaps(runs([(4 * PAGE - 1, 2)]))  # one byte of page 3


def test_the_next_write_lands_only_the_held_writes_it_covers(monkeypatch):
    landed: list[str] = []
    monkeypatch.setattr(HeldWrite, "land", lambda self, rt: landed.append(self.rid))
    plan = FaultPlan.parse([])
    a, c = held("A", [4, 5]), held("C", [9])
    other_owner = held("D", [4], owner=2)
    plan._in_flight = {1: [a, c], 2: [other_owner]}
    plan.wrote(None, 1, "B", runs([(0, 4 * PAGE)]))  # B's first batch: pages 0-3
    assert landed == []
    plan.wrote(None, 1, "A", runs([(4 * PAGE, 2 * PAGE)]))  # A's own write never lands A's
    assert landed == []
    plan.wrote(None, 1, "B", runs([(4 * PAGE, 2 * PAGE)]))  # B's next batch: pages 4-5
    assert landed == ["A"] and plan._in_flight[1] == [c]
    plan.wrote(None, 1, "B", runs([(9 * PAGE, PAGE)]))
    assert landed == ["A", "C"] and plan._in_flight[2] == [other_owner]


def test_another_requests_final_notice_lands_what_it_did_not_touch(monkeypatch):
    landed: list[str] = []
    monkeypatch.setattr(HeldWrite, "land", lambda self, rt: landed.append(self.rid))
    plan = FaultPlan.parse([])
    a, elsewhere = held("A", [4, 5]), held("D", [4], owner=2)
    plan._in_flight = {1: [a], 2: [elsewhere]}
    plan.wrote(None, 1, "B", runs([(0, 4 * PAGE)]))  # B's pages are others (a quarantine)
    plan.noticed(None, 1, "A")  # A's own notice lands nothing of A's
    assert landed == []
    plan.noticed(None, 1, "B")  # B wrote all it writes there
    assert landed == ["A"] and plan._in_flight == {1: [], 2: [elsewhere]}
