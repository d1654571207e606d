"""engine/run_checksum.py: a region's checksum put together from its runs'.

The writer's value (read from its source at the runs' source offsets) must equal the
owner's (read from what landed) and the plain function of :mod:`kvferry.engine.integrity`
on the region's bytes gathered in destination order; native and torch run sums agree bit
for bit; and every way I5 says a write can go wrong (torn, short, misplaced, another
request's bytes) changes the owner's value. Each check also runs against a deliberately
broken combination and must catch it.
"""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.engine import run_checksum
from kvferry.engine.integrity import MODULUS, native_supports, page_checksums_reference
from kvferry.engine.reshard import KVShape, Order, PoolLayout, head_span, plan
from kvferry.engine.run_checksum import (
    combine,
    region_checksums,
    run_checksums_native,
    run_checksums_reference,
    split_at_pages,
    word_unit,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NATIVE = native_supports(torch.zeros(1, 4))
needs_native = pytest.mark.skipif(not NATIVE, reason="the native checksum module is not built")


@st.composite
def transfers(draw):
    """A source and a destination buffer, pages of the destination, and non-overlapping
    runs between them whose cuts fall on words of ``unit`` bytes (some runs cross pages)."""
    unit = draw(st.sampled_from([1, 2]))
    page_bytes = unit * draw(st.integers(1, 24))
    dst_pages = draw(st.integers(1, 6))
    dst_bytes = page_bytes * dst_pages
    cuts = sorted(set(draw(st.lists(st.integers(0, dst_bytes // unit), max_size=12))))
    bounds = [0, *(c * unit for c in cuts), dst_bytes]
    pieces = [(a, b - a) for a, b in itertools.pairwise(bounds) if b > a]
    kept = [p for p in pieces if draw(st.booleans())] or pieces[:1]
    src_bytes = sum(n for _, n in kept) + draw(st.integers(0, 16))
    src_order = draw(st.permutations(range(len(kept))))
    runs, at = [], 0
    for i in src_order:
        runs.append((at, kept[i][0], kept[i][1]))
        at += kept[i][1]
    runs = np.array(runs, dtype=np.int64).reshape(-1, 3)
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (src_bytes,), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (dst_bytes,), dtype=torch.uint8, generator=g)
    return unit, page_bytes, src, dst, runs


def _land(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray) -> torch.Tensor:
    out = dst.clone()
    for s, d, n in runs.tolist():
        out[d : d + n] = src[s : s + n]
    return out


def _fletcher(words: list[int]) -> int:
    """The function of kvferry.engine.integrity, written out: s1 = sum w, s2 = sum (i+1) w
    (mod 2^31 - 1), packed s1 * 2^31 + s2."""
    s1 = sum(words) % MODULUS
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % MODULUS
    return s1 * (1 << 31) + s2


def _reference_regions(dst: torch.Tensor, runs: np.ndarray, page_bytes: int, unit: int) -> dict:
    """The definition itself: per destination page, the region's bytes gathered in
    destination order, read as words of ``unit`` bytes and checksummed."""
    pieces = split_at_pages(runs, page_bytes)
    out = {}
    for page in sorted({int(d) // page_bytes for d in pieces[:, 1]}):
        mine = pieces[pieces[:, 1] // page_bytes == page]
        mine = mine[np.argsort(mine[:, 1])]
        region = torch.cat([dst[d : d + n] for _, d, n in mine.tolist()])
        words = region.view(torch.int16).to(torch.int64) & 0xFFFF if unit == 2 else region
        out[page] = _fletcher(words.tolist())
    return out


def _as_dict(pages_sums: tuple[np.ndarray, np.ndarray]) -> dict:
    pages, sums = pages_sums
    return dict(zip(pages.tolist(), sums.tolist(), strict=True))


@SETTINGS
@given(transfers())
def test_writer_owner_and_definition_agree(t):
    unit, page_bytes, src, dst, runs = t
    landed = _land(src, dst, runs)
    writer = _as_dict(region_checksums(src, runs, page_bytes, unit, read=0))
    owner = _as_dict(region_checksums(landed, runs, page_bytes, unit, read=1))
    assert writer == owner == _reference_regions(landed, runs, page_bytes, unit)


@needs_native
@SETTINGS
@given(transfers())
def test_native_and_torch_run_sums_agree_bit_for_bit(t):
    unit, page_bytes, src, _, runs = t
    runs = split_at_pages(runs, page_bytes)
    native = run_checksums_native(src, runs[:, 0], runs[:, 2], unit)
    reference = run_checksums_reference(src, runs[:, 0], runs[:, 2], unit)
    assert native.tolist() == reference.tolist()


@SETTINGS
@given(transfers(), st.data())
def test_the_cut_does_not_matter(t, data):
    """The owner's plan may cut a region into other runs than the writer's."""
    unit, page_bytes, src, dst, runs = t
    landed = _land(src, dst, runs)
    pieces = split_at_pages(runs, page_bytes)
    i = data.draw(st.integers(0, len(pieces) - 1))
    s, d, n = pieces[i].tolist()
    cut = unit * data.draw(st.integers(0, n // unit))
    recut = np.concatenate(
        [pieces[:i], [[s, d, cut], [s + cut, d + cut, n - cut]], pieces[i + 1 :]]
    ).astype(np.int64)
    assert _as_dict(region_checksums(landed, recut, page_bytes, unit, read=1)) == _as_dict(
        region_checksums(landed, runs, page_bytes, unit, read=1)
    )


@SETTINGS
@given(transfers(), st.data())
def test_every_bad_landing_is_caught(t, data):
    """A torn byte, a short write (one run never landed), two runs landed in each other's
    place, another request's bytes: the owner's region differs from the writer's."""
    unit, page_bytes, src, dst, runs = t
    writer = _as_dict(region_checksums(src, runs, page_bytes, unit, read=0))
    landed = _land(src, dst, runs)
    how = data.draw(st.sampled_from(["torn", "short", "swapped", "foreign"]))
    i = data.draw(st.integers(0, len(runs) - 1))
    s, d, n = runs[i].tolist()
    if how == "torn":
        at = d + data.draw(st.integers(0, n - 1))
        landed[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "short":
        if bool((landed[d : d + n] == dst[d : d + n]).all()):
            return  # the stale bytes happen to be the right ones: nothing to catch
        landed[d : d + n] = dst[d : d + n]
    elif how == "swapped":
        j = data.draw(st.integers(0, len(runs) - 1))
        s2, d2, n2 = runs[j].tolist()
        if j == i or n2 != n or bool((src[s : s + n] == src[s2 : s2 + n]).all()):
            return  # nothing would move
        landed[d : d + n], landed[d2 : d2 + n] = src[s2 : s2 + n], src[s : s + n]
    else:
        other = torch.randint(0, 256, (n,), dtype=torch.uint8)
        if bool((other == src[s : s + n]).all()):
            return
        landed[d : d + n] = other
    assert _as_dict(region_checksums(landed, runs, page_bytes, unit, read=1)) != writer


def _broken_combine(dst_offsets, lengths, sums, page_bytes, unit):
    """The broken mode: the run's place in its region is ignored (no shift of index)."""
    pages, _ = combine(dst_offsets, lengths, sums, page_bytes, unit)
    s1, s2 = np.asarray(sums) >> 31, np.asarray(sums) & MODULUS
    page = np.asarray(dst_offsets) // page_bytes
    return pages, np.array(
        [
            (s1[page == p].sum() % MODULUS) * (1 << 31) + s2[page == p].sum() % MODULUS
            for p in pages
        ],
        dtype=np.int64,
    )


def test_broken_combination_is_caught_by_the_definition():
    """Combining runs without their shift gives values the definition disowns, and a
    run swap it does not see: the agreement test above would fail."""
    src = torch.arange(64, dtype=torch.uint8)
    runs = np.array([[0, 0, 8], [8, 8, 8]], dtype=np.int64)
    landed = _land(src, torch.zeros(16, dtype=torch.uint8), runs)
    with mock.patch.object(run_checksum, "combine", _broken_combine):
        broken = _as_dict(region_checksums(landed, runs, 16, 2, read=1))
        swapped = _land(src, landed, np.array([[8, 0, 8], [0, 8, 8]], dtype=np.int64))
        assert _as_dict(region_checksums(swapped, runs, 16, 2, read=1)) == broken
    assert broken != _reference_regions(landed, runs, 16, 2)
    assert _as_dict(region_checksums(landed, runs, 16, 2, read=1)) == _reference_regions(
        landed, runs, 16, 2
    )


@needs_native
def test_native_changed_by_one_bit_is_caught():
    """One implementation off by one bit in one run's sum: the agreement test sees it."""
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    offsets, lengths = np.array([0, 1024, 2048]), np.array([1024, 1024, 2048])
    native = run_checksums_native(src, offsets, lengths, 2)
    native[1] ^= 1
    assert native.tolist() != run_checksums_reference(src, offsets, lengths, 2).tolist()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_homogeneous_hnd_region_is_the_heads_slice_of_the_page(tp, dtype):
    """Same shape on both sides, HND, whole pages: the region one writer writes into a
    page is its heads' slice of it, and its checksum the one a prefill writer takes of
    that slice today (integrity.page_checksums over the heads' view)."""
    layers, heads, page, dim, pages = 2, 4, 16, 8, 5
    shape = KVShape(layers, heads, dim, torch.tensor([], dtype=dtype).element_size())
    layout = PoolLayout(tp, page, Order.HND)
    tokens = page * 3
    src_tables = [list(range(3)) for _ in range(tp)]
    dst_tables = [[4, 0, 2] for _ in range(tp)]
    p = plan(shape, layout, layout, tokens, src_tables, dst_tables)
    whole = torch.randn(pages, layers, 2, heads, page, dim).to(dtype)
    for w in range(tp):
        lo, hi = head_span(shape, tp, w)
        mine = whole[:, :, :, lo:hi].contiguous()  # rank w's own pool
        runs = p.runs_between(w, w)
        page_bytes = mine[0].numel() * mine.element_size()
        got = _as_dict(
            region_checksums(mine, runs, page_bytes, word_unit(shape.vector_bytes), read=0)
        )
        expected = page_checksums_reference(mine, [0, 1, 2]).tolist()
        # source pages 0, 1, 2 land in destination pages 4, 0, 2
        assert got == {4: expected[0], 0: expected[1], 2: expected[2]}


def test_split_at_pages_moves_both_offsets():
    runs = np.array([[100, 10, 30]], dtype=np.int64)
    assert split_at_pages(runs, 16).tolist() == [[100, 10, 6], [106, 16, 16], [122, 32, 8]]


def test_refusals_name_the_run_and_the_numbers():
    buf = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(
        IndexError, match=r"run 1 \(offset 30, 8 bytes\) is outside the buffer of 32"
    ):
        run_checksums_reference(buf, np.array([0, 30]), np.array([4, 8]), 2)
    with pytest.raises(IndexError, match="not whole 2-byte words"):
        run_checksums_reference(buf, np.array([0]), np.array([5]), 2)
    with pytest.raises(ValueError, match="word unit 4: 1 or 2"):
        run_checksums_reference(buf, np.array([0]), np.array([4]), 4)
    with pytest.raises(ValueError, match="crosses a destination page"):
        combine(np.array([12]), np.array([8]), np.array([0]), 16, 2)
    with pytest.raises(ValueError, match="overlap"):
        combine(np.array([0, 4]), np.array([8, 4]), np.array([0, 0]), 16, 2)
