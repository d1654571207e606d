import logging

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.engine import (
    AllocatorInvariantError,
    OutOfPages,
    PageAllocator,
    PageOwnershipError,
    PageState,
)


def test_allocate_is_all_or_nothing_and_lowest_first():
    alloc = PageAllocator(8)
    grants = alloc.allocate("a", 3)
    assert [g.page for g in grants] == [0, 1, 2]
    with pytest.raises(OutOfPages) as err:
        alloc.allocate("b", 6)
    assert (err.value.request_id, err.value.wanted, err.value.free) == ("b", 6, 5)
    assert alloc.pages_of("b") == [] and alloc.counts()["free"] == 5


def test_allocating_pages_alone_grants_what_allocate_would():
    """Same pages in the same order and the same generation numbers as grants would have,
    for a short request (heap pops) and a long one (one sort)."""
    with_grants, pages_only = PageAllocator(200), PageAllocator(200)
    for rid, n in (("a", 3), ("b", 150), ("c", 0), ("d", 20)):
        grants = with_grants.allocate(rid, n)
        pages = pages_only.allocate_pages(rid, n)
        assert pages == [g.page for g in grants]
        assert [pages_only.generation(p) for p in pages] == [g.generation for g in grants]
    with_grants.free("b")
    pages_only.free("b")
    assert pages_only.allocate_pages("e", 40) == [g.page for g in with_grants.allocate("e", 40)]


def test_generations_increase_at_every_allocation():
    alloc = PageAllocator(4)
    first = alloc.allocate("a", 2)
    alloc.free("a")
    second = alloc.allocate("b", 2)
    assert [g.page for g in first] == [g.page for g in second]
    assert all(s.generation > f.generation for f, s in zip(first, second, strict=True))
    assert alloc.generation(0) == second[0].generation


def test_only_the_owner_frees():
    alloc = PageAllocator(4)
    alloc.allocate("a", 2)
    with pytest.raises(PageOwnershipError) as err:
        alloc.free("b", [0])
    assert err.value.request_id == "b" and err.value.owner == "a" and err.value.page == 0
    with pytest.raises(PageOwnershipError):
        alloc.free("a", [0, 3])  # page 3 is free: nothing is freed
    assert alloc.owned_pages_of("a") == [0, 1]


def test_quarantine_then_release():
    alloc = PageAllocator(4)
    alloc.allocate("a", 3)
    assert alloc.quarantine("a") == [0, 1, 2]
    assert alloc.state(1) is PageState.QUARANTINED and alloc.owner(1) == "a"
    assert alloc.counts() == dict(free=1, owned=0, quarantined=3, total=4)
    with pytest.raises(PageOwnershipError):
        alloc.free("a", [0])  # quarantined pages leave only through release
    with pytest.raises(OutOfPages):
        alloc.allocate("b", 2)
    assert alloc.release("a") == [0, 1, 2]
    assert alloc.counts()["free"] == 4


def test_unsafe_quarantine_frees_and_logs(caplog):
    with caplog.at_level(logging.CRITICAL):
        alloc = PageAllocator(4, unsafe=True)
        alloc.allocate("a", 2)
        assert alloc.quarantine("a") == [0, 1]
    assert alloc.counts()["quarantined"] == 0 and alloc.counts()["free"] == 4
    assert any("UNSAFE" in r.message for r in caplog.records)


def test_invariant_check_catches_corrupted_books():
    """The check the stateful test relies on can fail: corrupt the books, it must notice."""
    alloc = PageAllocator(4)
    alloc.allocate("a", 2)
    alloc.check_invariants()
    alloc._state[3] = PageState.OWNED  # a page marked owned behind the books' back
    with pytest.raises(AllocatorInvariantError):
        alloc.check_invariants()
    alloc = PageAllocator(4)
    alloc.allocate("a", 2)
    alloc._free_heap.append(0)  # a page both owned and on the free list
    with pytest.raises(AllocatorInvariantError):
        alloc.check_invariants()


REQUESTS = st.sampled_from(["r0", "r1", "r2", "r3"])


class AllocatorMachine(RuleBasedStateMachine):
    """Allocator against a plain model: who holds which page in which state."""

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(12)
        self.model: dict[int, tuple[PageState, str]] = {}  # page -> (state, owner); absent = free
        self.last_generation: dict[int, int] = {}

    def _free_count(self):
        return 12 - len(self.model)

    @rule(rid=REQUESTS, n=st.integers(0, 14), pages_only=st.booleans())
    def allocate(self, rid, n, pages_only):
        """``allocate`` or ``allocate_pages`` (the pages alone): the same books either way
        (owned, a fresh generation, read back through ``generation``)."""
        grant = self.alloc.allocate_pages if pages_only else self.alloc.allocate
        if n > self._free_count():
            with pytest.raises(OutOfPages):
                grant(rid, n)
            return
        got = grant(rid, n)
        pages = got if pages_only else [g.page for g in got]
        assert len(pages) == n == len(set(pages))
        for i, page in enumerate(pages):
            assert page not in self.model
            generation = self.alloc.generation(page)
            if not pages_only:
                assert got[i].generation == generation
            assert generation > self.last_generation.get(page, 0)
            self.last_generation[page] = generation
            self.model[page] = (PageState.OWNED, rid)

    @rule(rid=REQUESTS)
    def free_all(self, rid):
        freed = self.alloc.free(rid)
        assert sorted(freed) == sorted(
            p for p, (s, o) in self.model.items() if o == rid and s is PageState.OWNED
        )
        for p in freed:
            del self.model[p]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), rid=REQUESTS)
    def free_one(self, data, rid):
        page = data.draw(st.sampled_from(sorted(self.model)))
        state, owner = self.model[page]
        if state is PageState.OWNED and owner == rid:
            self.alloc.free(rid, [page])
            del self.model[page]
        else:
            with pytest.raises(PageOwnershipError):
                self.alloc.free(rid, [page])

    @rule(rid=REQUESTS)
    def quarantine(self, rid):
        pages = self.alloc.quarantine(rid)
        assert sorted(pages) == sorted(
            p for p, (s, o) in self.model.items() if o == rid and s is PageState.OWNED
        )
        for p in pages:
            self.model[p] = (PageState.QUARANTINED, rid)

    @rule(rid=REQUESTS)
    def release(self, rid):
        pages = self.alloc.release(rid)
        assert sorted(pages) == sorted(
            p for p, (s, o) in self.model.items() if o == rid and s is PageState.QUARANTINED
        )
        for p in pages:
            del self.model[p]

    @invariant()
    def books_balance(self):
        self.alloc.check_invariants()
        counts = self.alloc.counts()
        assert counts["free"] + counts["owned"] + counts["quarantined"] == counts["total"] == 12
        assert counts["free"] == self._free_count()
        for page in range(12):
            state, owner = self.model.get(page, (PageState.FREE, None))
            assert self.alloc.state(page) is state and self.alloc.owner(page) == owner


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase
