"""A writer's source pages shared by the jobs of one prompt (a writer into several members
of a decode group computes the prompt once for all of them): I4 on the writer's side,
that no job's end frees pages another job's writes may still read.

A property walk (hypothesis) holds and ends jobs under shares in any order and checks,
after every call, that a share's pages stay allocated while any of its jobs holds them,
that they are freed by the last hold's end and reported once, under the share, with
their count, and that every other end reports nothing. Broken mode: a source that frees
a share's pages at its first job's end (what one allocation per job did, with the
pages shared) is caught by the same checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster.ports import SharedSource
from kvferry.engine.allocator import PageAllocator
from kvferry.engine.protocol.ports import SourceFreed

POOL = 64


class FreesAtFirstEnd(SharedSource):
    """Broken mode: the first job whose hold ends frees the share's pages."""

    def free(self, rid: str) -> SourceFreed | None:
        share = self._share_of.pop(rid, rid)
        self._holders.pop(share, None)
        pages = self.allocator.pages_of(share)
        if pages:
            self.allocator.free(share)
        return SourceFreed(share, len(pages)) if pages else None


# (job index, share index, pages) holds, then the order in which the jobs end
walks = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8)), min_size=1, max_size=6).flatmap(
    lambda holds: st.tuples(st.just(holds), st.permutations(range(len(holds))))
)


def _walk(source: SharedSource, holds: list[tuple[int, int]], order: list[int]) -> None:
    """Hold job ``j`` under share ``holds[j][0]`` (its pages ``holds[j][1]``, the first
    hold's count for every later job of the share), then end them in ``order``; assert
    I4's rules after every call."""
    allocator = source.allocator
    pages_of: dict[str, int] = {}
    holding: dict[str, set[str]] = {}
    for j, (s, n) in enumerate(holds):
        rid, share = f"r{j}", f"s{s}"
        n = pages_of.setdefault(share, n)
        pages, _ = source.hold(rid, share, n)
        assert pages == allocator.pages_of(share) and len(pages) == n
        holding.setdefault(share, set()).add(rid)
    reported: list[SourceFreed] = []
    for j in order:
        rid, share = f"r{j}", f"s{holds[j][0]}"
        freed = source.free(rid)
        holding[share].discard(rid)
        if holding[share]:
            assert freed is None, f"{rid} ended, {sorted(holding[share])} still hold {share}"
            assert len(allocator.pages_of(share)) == pages_of[share], (
                f"{share}'s pages freed while {sorted(holding[share])} hold them"
            )
        else:
            assert freed == SourceFreed(share, pages_of[share])
            assert not allocator.pages_of(share)
            reported.append(freed)
        allocator.check_invariants()
    assert sorted(f.held_under for f in reported) == sorted(pages_of)
    assert allocator.free_pages == POOL


@settings(max_examples=300, deadline=None)
@given(walks)
def test_a_shares_pages_are_freed_by_its_last_hold_and_reported_once(walk):
    holds, order = walk
    _walk(SharedSource(PageAllocator(POOL)), holds, list(order))


def test_broken_a_source_that_frees_at_the_first_end_is_caught():
    """Two members' jobs share a prompt's pages; the broken source frees them when the
    first job ends, while the second's writes may still read them."""
    with pytest.raises(AssertionError, match="still hold"):
        _walk(FreesAtFirstEnd(PageAllocator(POOL)), [(0, 4), (0, 4)], [0, 1])


def test_a_job_that_held_nothing_ends_with_nothing_freed():
    source = SharedSource(PageAllocator(POOL))
    assert source.free("never") == SourceFreed("never", 0)


def test_a_job_that_held_nothing_keeps_a_share_it_names_held():
    """A job ends before its prompt was whole (it never held pages), under an id another
    job holds pages under: nothing is freed or reported."""
    source = SharedSource(PageAllocator(POOL))
    source.hold("r.1", "r", 5)
    assert source.free("r") is None
    assert len(source.allocator.pages_of("r")) == 5


def test_a_share_held_for_another_prompt_length_is_refused_with_both_counts():
    source = SharedSource(PageAllocator(POOL))
    source.hold("r", "r", 5)
    with pytest.raises(ValueError, match=r"r\.1: its prompt takes 6 source pages, but the 5"):
        source.hold("r.1", "r", 6)
    assert source.free("r.1") == SourceFreed("r.1", 0)  # it holds nothing under "r"
    assert source.free("r") == SourceFreed("r", 5)
