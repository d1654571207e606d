"""Long lists in chunks (kvferry.cluster.chunks): any arrival order and duplicates rebuild
the list; a chunk off the grid is refused; the largest chunk of each kind encodes under the
transfer engine's message limit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster import messages as m
from kvferry.cluster.chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK, ChunkError, Reassembly, spans
from kvferry.transfer.protocol import MAX_PAYLOAD

HEADER = dict(src=1, inc=(1 << 64) - 1, seq=(1 << 64) - 1)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 200), size=st.integers(1, 17), data=st.data())
def test_chunks_in_any_order_with_duplicates_rebuild_the_lists(total, size, data):
    pages = list(range(1000, 1000 + total))
    gens = [p * 7 for p in pages]
    chunks = [(lo, pages[lo:hi], gens[lo:hi]) for lo, hi in spans(total, size)]
    order = data.draw(
        st.permutations(chunks + data.draw(st.lists(st.sampled_from(chunks), max_size=3)))
    )
    parts = Reassembly("r", "PLAN", total, size, width=2)
    done = [parts.add(lo, total, p, g) for lo, p, g in order]
    assert done[-1] and parts.complete
    every = {lo for lo, _, _ in chunks}
    assert done == [{lo for lo, _, _ in order[: i + 1]} == every for i in range(len(order))]
    assert [a.tolist() for a in parts.joined()] == [pages, gens]


@pytest.mark.parametrize(
    "offset, total, length, why",
    [
        (3, 10, 4, "offset"),  # not on the chunk grid
        (0, 10, 3, "items"),  # a short chunk
        (8, 10, 4, "items"),  # the last chunk too long
        (12, 10, 4, "offset"),  # past the end
        (-4, 10, 4, "offset"),
    ],
)
def test_a_chunk_off_the_grid_is_refused_with_the_numbers(offset, total, length, why):
    parts = Reassembly("r1", "NOTICE", total, 4)
    with pytest.raises(ChunkError, match=why) as exc:
        parts.add(offset, total, list(range(length)))
    assert "r1" in str(exc.value)


def test_a_chunk_that_changes_the_total_is_refused():
    parts = Reassembly("r1", "PREFILL", 10, 4)
    parts.add(0, 10, [1, 2, 3, 4])
    with pytest.raises(ChunkError, match="total 11"):
        parts.add(4, 11, [5, 6, 7, 8])


def test_an_optional_list_may_arrive_empty_and_the_others_may_not():
    parts = Reassembly("r", "NOTICE", 2, 4, width=3, optional=frozenset({2}))
    assert parts.add(0, 2, [1, 2], [3, 4], [])
    with pytest.raises(ChunkError):
        Reassembly("r", "NOTICE", 2, 4, width=3, optional=frozenset({2})).add(0, 2, [1, 2], [], [])


def test_the_largest_chunk_of_each_kind_fits_one_message():
    worst = (1 << 63) - 1
    big = [worst] * PAGES_PER_CHUNK
    samples = [
        m.PREFILL.make(
            **HEADER,
            rid="r" * m.MAX_REQUEST_ID,
            tokens=b"\xff" * (4 * TOKENS_PER_CHUNK),
            offset=worst,
            total=worst,
            owner=worst,
            owner_inc=(1 << 64) - 1,
        ),
        m.PLAN.make(
            **HEADER,
            rid="r" * m.MAX_REQUEST_ID,
            offset=worst,
            total=worst,
            pages=big,
            generations=big,
        ),
        m.NOTICE.make(
            **HEADER,
            rid="r" * m.MAX_REQUEST_ID,
            tokens=worst,
            offset=worst,
            total=worst,
            pages=big,
            generations=big,
            checksums=big,
            bytes=worst,
            prefill_ms=1e300,
        ),
    ]
    for msg in samples:
        assert len(m.encode(msg)) < MAX_PAYLOAD, msg.kind


def test_prompt_tokens_rebuild_from_array_chunks():
    tokens = np.arange(10, dtype="<i4")
    parts = Reassembly("r", "PREFILL", 10, 4)
    for lo, hi in reversed(list(spans(10, 4))):
        parts.add(lo, 10, tokens[lo:hi])
    assert parts.joined_array().tolist() == tokens.tolist()
