"""engine/reshard.py: any prefill shape into any decode shape, as byte runs.

The main check (:func:`check_plan`) builds every rank's pool as a byte array in which each
(layer, K/V, head, token, dim) element of the request has a value of its own, applies the
plan's runs byte for byte, and reads every owner's pool back at its logical positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvferry.cluster.topology import HeadSplit
from kvferry.engine import reshard
from kvferry.engine.pool import KVPool, PoolConfig
from kvferry.engine.reshard import (
    KVShape,
    Order,
    PoolLayout,
    ReshardError,
    ReshardPlan,
    assign_heads,
    head_span,
    heads_between_pools,
    normalize,
    page_runs,
    plan,
    plan_reference,
)

DTYPES = {2: np.uint16, 4: np.uint32}
PAGE_SIZES = [16, 32, 64, 2, 3, 4, 8]
TPS = [1, 2, 4]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    """One request: shapes, token count, each rank's page list and pool size (pages)."""

    shape: KVShape
    src: PoolLayout
    dst: PoolLayout
    tokens: int
    src_pages: tuple[tuple[int, ...], ...]
    dst_pages: tuple[tuple[int, ...], ...]
    src_pool_pages: tuple[int, ...]
    dst_pool_pages: tuple[int, ...]

    def plan(self) -> ReshardPlan:
        return plan(self.shape, self.src, self.dst, self.tokens, self.src_pages, self.dst_pages)


@st.composite
def page_lists(draw, tp: int, tokens: int, page_size: int):
    """Per rank: a list of distinct pages (some lists longer than needed), and the pool
    size they live in."""
    needed = -(-tokens // page_size)
    lists, sizes = [], []
    for _ in range(tp):
        listed = needed + draw(st.integers(0, 2))
        size = listed + draw(st.integers(0, 3))
        lists.append(tuple(draw(st.permutations(range(size)))[:listed]))
        sizes.append(size)
    return tuple(lists), tuple(sizes)


@st.composite
def cases(draw, *, replicated_only: bool = False, aligned: bool = False):
    """Shapes, TP pairs, page sizes, orders, random page tables; token counts that are
    not a multiple of either page size (``aligned``: a multiple of both)."""
    replicated = draw(st.booleans()) if not replicated_only else draw(st.sampled_from([0, 1]))
    src = PoolLayout(
        draw(st.sampled_from(TPS)), draw(st.sampled_from(PAGE_SIZES)), draw(st.sampled_from(Order))
    )
    dst = PoolLayout(
        draw(st.sampled_from(TPS)), draw(st.sampled_from(PAGE_SIZES)), draw(st.sampled_from(Order))
    )
    if replicated_only and not replicated:
        # GQA with fewer KV heads than the larger TP: replicated heads on some side.
        src = replace(src, tp=draw(st.sampled_from([2, 4])))
        kv_heads = draw(st.integers(1, src.tp - 1))
    else:
        kv_heads = draw(st.integers(1, 2 if replicated else 5))
    shape = KVShape(
        layers=draw(st.integers(1, 2)),
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([1, 2, 4])),
        element_size=draw(st.sampled_from(sorted(DTYPES))),
        replicated=bool(replicated),
    )
    if aligned:
        period = math.lcm(src.page_size, dst.page_size)
        tokens = period * draw(st.integers(1, max(1, 130 // period)))
    else:
        tokens = draw(st.integers(1, 130).filter(lambda t: t % src.page_size and t % dst.page_size))
    sp, ss = draw(page_lists(src.tp, tokens, src.page_size))
    dp, ds = draw(page_lists(dst.tp, tokens, dst.page_size))
    return Case(shape, src, dst, tokens, sp, dp, ss, ds)


# --- the byte-exact check ----------------------------------------------------------------


def _page_dims(shape: KVShape, layout: PoolLayout, rank: int) -> tuple[int, ...]:
    """A rank's page as the module docstring defines it."""
    lo, hi = head_span(shape, layout.tp, rank)
    n, p, d = hi - lo, layout.page_size, shape.head_dim
    if layout.order is Order.HND:
        return (shape.layers, 2, n, p, d)
    return (shape.layers, 2, p, n, d)


def _logical(pool: np.ndarray, shape: KVShape, layout: PoolLayout, rank: int) -> np.ndarray:
    return pool.reshape(-1, *_page_dims(shape, layout, rank))


def _positions(pages, tokens: int, page_size: int, order: Order):
    """The index tuple that selects ``[tokens, layers, 2, n, D]`` from a logical pool."""
    t = np.arange(tokens)
    pg, slot = np.asarray(pages)[t // page_size], t % page_size
    s = slice(None)
    if order is Order.HND:
        return (pg, s, s, s, slot, s)
    return (pg, s, s, slot, s, s)


def _expected(values: np.ndarray, lo: int, hi: int, tokens: int) -> np.ndarray:
    """``values`` is ``[layers, 2, kv_heads, tokens, D]``; ``[tokens, layers, 2, n, D]``."""
    return values[:, :, lo:hi, :tokens, :].transpose(3, 0, 1, 2, 4)


def _byte_indices(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every byte of runs ``(offset, length)``: ``[sum(lengths)]``."""
    starts = np.repeat(offsets, lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return starts + within


def check_plan(case: Case, p: ReshardPlan) -> list[str]:
    """What is wrong with ``p`` for ``case`` (empty: nothing). Applies the runs to pools
    with a unique value per element and checks: the values at every owner's logical
    positions, that nothing outside the request's slots changed, that no destination
    byte is written twice, and that writers_of/owners_of name exactly the pairs with runs."""
    shape, dtype = case.shape, DTYPES[case.shape.element_size]
    poison, sentinel = np.iinfo(dtype).max, np.iinfo(dtype).max - 1
    count = shape.layers * 2 * shape.kv_heads * case.tokens * shape.head_dim
    assert count < sentinel
    values = np.arange(1, count + 1, dtype=dtype).reshape(
        shape.layers, 2, shape.kv_heads, case.tokens, shape.head_dim
    )
    problems: list[str] = []

    src_pools = []
    for w in range(case.src.tp):
        pool = np.full(
            case.src_pool_pages[w] * math.prod(_page_dims(shape, case.src, w)), poison, dtype
        )
        lo, hi = head_span(shape, case.src.tp, w)
        at = _positions(case.src_pages[w], case.tokens, case.src.page_size, case.src.order)
        _logical(pool, shape, case.src, w)[at] = _expected(values, lo, hi, case.tokens)
        src_pools.append(pool)
    dst_pools = [
        np.full(case.dst_pool_pages[o] * math.prod(_page_dims(shape, case.dst, o)), sentinel, dtype)
        for o in range(case.dst.tp)
    ]
    writes = [np.zeros(pool.nbytes, dtype=np.int64) for pool in dst_pools]

    for (w, o), runs in p.runs.items():
        src_bytes, dst_bytes = src_pools[w].view(np.uint8), dst_pools[o].view(np.uint8)
        local, remote, length = runs[:, 0], runs[:, 1], runs[:, 2]
        if len(runs) and (
            local.min() < 0
            or remote.min() < 0
            or (local + length).max() > src_bytes.size
            or (remote + length).max() > dst_bytes.size
        ):
            problems.append(f"({w}, {o}): a run outside a pool")
            continue
        di = _byte_indices(remote, length)
        dst_bytes[di] = src_bytes[_byte_indices(local, length)]
        writes[o] += np.bincount(di, minlength=dst_bytes.size)

    for o in range(case.dst.tp):
        lo, hi = head_span(shape, case.dst.tp, o)
        at = _positions(case.dst_pages[o], case.tokens, case.dst.page_size, case.dst.order)
        got = _logical(dst_pools[o], shape, case.dst, o)[at]
        bad = int((got != _expected(values, lo, hi, case.tokens)).sum())
        if bad:
            problems.append(f"owner {o}: {bad} elements wrong at their logical positions")
        inside = np.zeros(dst_pools[o].shape, dtype=bool)
        _logical(inside, shape, case.dst, o)[at] = True
        outside = int((dst_pools[o][~inside] != sentinel).sum())
        if outside:
            problems.append(f"owner {o}: {outside} elements changed outside the request")
        twice = int((writes[o] > 1).sum())
        if twice:
            problems.append(f"owner {o}: {twice} bytes written more than once")
        with_runs = tuple(w for w, oo in sorted(p.runs) if oo == o and len(p.runs[(w, oo)]))
        if p.writers_of(o) != with_runs:
            problems.append(f"owner {o}: writers_of {p.writers_of(o)}, runs from {with_runs}")
    for w in range(case.src.tp):
        with_runs = tuple(o for ww, o in sorted(p.runs) if ww == w and len(p.runs[(ww, o)]))
        if p.owners_of(w) != with_runs:
            problems.append(f"writer {w}: owners_of {p.owners_of(w)}, runs to {with_runs}")
    return problems


# --- head ownership ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_heads", "tp", "replicated", "spans"),
    [
        (8, 1, False, [(0, 8)]),
        (8, 4, False, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (3, 2, False, [(0, 1), (1, 3)]),  # uneven: the later rank holds one more
        (5, 4, False, [(0, 1), (1, 2), (2, 3), (3, 5)]),
        (2, 4, False, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # GQA replicated in blocks
        (1, 2, False, [(0, 1), (0, 1)]),
        (3, 4, False, [(0, 1), (0, 1), (1, 2), (2, 3)]),
        (1, 4, True, [(0, 1)] * 4),  # MLA: all heads everywhere
        (2, 2, True, [(0, 2), (0, 2)]),
    ],
)
def test_head_span(kv_heads, tp, replicated, spans):
    shape = KVShape(1, kv_heads, 4, 2, replicated=replicated)
    assert [head_span(shape, tp, r) for r in range(tp)] == spans


@pytest.mark.parametrize(("kv_heads", "tp"), [(8, 1), (8, 2), (8, 4), (4, 4), (16, 4)])
def test_head_span_is_k_over_tp_each_when_tp_divides(kv_heads, tp):
    """When tp divides the heads, each rank holds K/tp of them, in rank order (the
    cluster's HeadSplit gives its members this same span)."""
    shape = KVShape(1, kv_heads, 4, 2)
    per = kv_heads // tp
    expected = [(r * per, (r + 1) * per) for r in range(tp)]
    assert [head_span(shape, tp, r) for r in range(tp)] == expected
    split = HeadSplit(kv_heads, tp)
    assert [split.writer_heads(r) for r in range(tp)] == expected


@pytest.mark.parametrize(
    ("kv_heads", "replicated", "src_tp", "dst_tp", "pairs"),
    [
        # split on both sides: the writer that holds a head is the only choice
        (8, False, 4, 2, {(0, 0): (0, 1), (1, 0): (2, 3), (2, 1): (4, 5), (3, 1): (6, 7)}),
        (8, False, 2, 4, {(0, 0): (0, 1), (0, 1): (2, 3), (1, 2): (4, 5), (1, 3): (6, 7)}),
        # vLLM's pairing: decode d reads from prefill d // (D/P) when D >= P ...
        (1, True, 2, 4, {(0, 0): (0,), (0, 1): (0,), (1, 2): (0,), (1, 3): (0,)}),
        # ... and from the first holder among [d*P/D, (d+1)*P/D) when P > D
        (1, True, 4, 2, {(0, 0): (0,), (2, 1): (0,)}),
        (2, False, 4, 2, {(0, 0): (0,), (2, 1): (1,)}),
        (2, False, 4, 4, {(0, 0): (0,), (1, 1): (0,), (2, 2): (1,), (3, 3): (1,)}),
        (1, True, 4, 4, {(w, w): (0,) for w in range(4)}),
        (3, False, 2, 1, {(0, 0): (0,), (1, 0): (1, 2)}),
    ],
)
def test_assign_heads(kv_heads, replicated, src_tp, dst_tp, pairs):
    shape = KVShape(1, kv_heads, 4, 2, replicated=replicated)
    assert assign_heads(shape, PoolLayout(src_tp, 16), PoolLayout(dst_tp, 16)) == pairs


# --- properties --------------------------------------------------------------------------


@SETTINGS
@given(cases())
def test_plan_reassembles_byte_exact(case):
    assert check_plan(case, case.plan()) == []


@SETTINGS
@given(cases(aligned=True))
def test_plan_reassembles_page_aligned_prompts(case):
    assert check_plan(case, case.plan()) == []


@SETTINGS
@given(cases())
def test_plan_equals_reference(case):
    fast = case.plan()
    slow = plan_reference(
        case.shape, case.src, case.dst, case.tokens, case.src_pages, case.dst_pages
    )
    assert fast.pairs() == slow.pairs()
    assert dict(fast.heads) == dict(slow.heads)
    for pair in fast.pairs():
        np.testing.assert_array_equal(normalize(fast.runs[pair]), normalize(slow.runs[pair]))
    assert fast.total_bytes == slow.total_bytes


@SETTINGS
@given(cases(replicated_only=True))
def test_replicated_heads_have_one_writer_per_byte(case):
    p = case.plan()
    assert check_plan(case, p) == []  # includes: no byte written twice
    for o in range(case.dst.tp):
        assert p.writers_of(o) == tuple(w for w, oo in p.pairs() if oo == o)
        assert all(len(p.runs[(w, o)]) for w in p.writers_of(o))
    for w in range(case.src.tp):
        assert p.owners_of(w) == tuple(o for ww, o in p.pairs() if ww == w)


# --- broken modes: each one must be caught ------------------------------------------------


@SETTINGS
@given(cases(), st.data())
def test_broken_remote_offset_shifted_by_one_element_is_caught(case, data):
    p = case.plan()
    pair = data.draw(st.sampled_from(p.pairs()))
    row = data.draw(st.integers(0, len(p.runs[pair]) - 1))
    tampered = p.runs[pair].copy()
    tampered[row, 1] += case.shape.element_size
    broken = replace(p, runs={**p.runs, pair: tampered})
    assert check_plan(case, broken) != []


def _every_holder_writes(shape, src, dst):
    """Broken: every holder of a replicated head writes it into every owner of it."""
    out: dict[tuple[int, int], list[int]] = {}
    for o in range(dst.tp):
        for h in range(*head_span(shape, dst.tp, o)):
            for w in range(src.tp):
                if h in range(*head_span(shape, src.tp, w)):
                    out.setdefault((w, o), []).append(h)
    return {pair: tuple(hs) for pair, hs in sorted(out.items())}


@SETTINGS
@given(cases(replicated_only=True))
def test_broken_two_holders_both_writing_is_caught(case):
    holders = [head_span(case.shape, case.src.tp, w) for w in range(case.src.tp)]
    assume(any(sum(lo <= h < hi for lo, hi in holders) > 1 for h in range(case.shape.kv_heads)))
    with mock.patch.object(reshard, "assign_heads", _every_holder_writes):
        with pytest.raises(RuntimeError, match="bytes, it needs"):
            case.plan()  # the planner's own guard
        with mock.patch.object(reshard, "_check_coverage", lambda p: None):
            broken = case.plan()
    problems = check_plan(case, broken)
    assert any("written more than once" in s for s in problems), problems


@SETTINGS
@given(cases())
def test_broken_dropped_last_partial_page_is_caught(case):
    assume(case.tokens > case.dst.page_size)
    short = case.tokens - case.tokens % case.dst.page_size
    broken = plan(case.shape, case.src, case.dst, short, case.src_pages, case.dst_pages)
    problems = check_plan(case, broken)
    assert any("wrong at their logical positions" in s for s in problems), problems


# --- the homogeneous case: as few runs as the cluster's writer makes today ---------------


def _triples_today(kv_heads: int, tp: int, writer: int, pages: int, src, dst) -> np.ndarray:
    """The cluster writer's runs of one page between full-width pools, worked out from the
    pool's strides here (one run per (layer, K/V), merged where they touch), repeated for
    each page as its ``_triples`` does."""
    config = PoolConfig(layers=2, kv_heads=kv_heads, head_dim=4, page_size=16, num_pages=64)
    pool = KVPool(config, zero=True)
    lo, hi = head_span(KVShape(1, kv_heads, 1, 1), tp, writer)
    size = pool.kv.element_size()
    s1, s2, s3 = (pool.kv.stride(i) * size for i in (1, 2, 3))
    per_lc = [
        (layer * s1 + kv * s2 + lo * s3, (hi - lo) * s3) for layer in range(2) for kv in (0, 1)
    ]
    runs: list[tuple[int, int]] = []
    for off, n in per_lc:
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((off, n))
    offsets = np.array([off for off, _ in runs], dtype=np.int64)
    lengths = np.array([n for _, n in runs], dtype=np.int64)
    pb = pool.page_bytes
    s, d = np.asarray(src[:pages]), np.asarray(dst[:pages])
    local = (s[:, None] * pb + offsets[None, :]).reshape(-1)
    remote = (d[:, None] * pb + offsets[None, :]).reshape(-1)
    return np.stack([local, remote, np.tile(lengths, pages)], axis=1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_homogeneous_hnd_runs_match_triples(tp):
    kv_heads, tokens = 8, 16 * 5 - 3
    shape = KVShape(layers=2, kv_heads=kv_heads, head_dim=4, element_size=4)
    src_pages = [[9, 3, 7, 1, 5]] * tp  # never adjacent: no merging across pages
    dst_pages = [[40, 20, 60, 10, 30]]
    p = plan(shape, PoolLayout(tp, 16), PoolLayout(1, 16), tokens, src_pages, dst_pages)
    assert p.writers_of(0) == tuple(range(tp))
    for w in range(tp):
        today = _triples_today(kv_heads, tp, w, 5, src_pages[w], dst_pages[0])
        ours = p.runs[(w, 0)]
        # Full pages: one run per page for a writer of every head, else one per (layer,
        # K/V), the same remote offsets and lengths (today's prefill pools are full-width,
        # so local offsets agree only at tp 1).
        per_page = 1 if tp == 1 else 2 * 2
        np.testing.assert_array_equal(ours[: 4 * per_page, 1:], today[: 4 * per_page, 1:])
        if tp == 1:
            np.testing.assert_array_equal(ours[:4], today[:4])
        # The partial last page: today's writer sends it whole; the plan sends the 13
        # tokens only, one run per (layer, K/V, head).
        assert len(ours) - 4 * per_page == 2 * 2 * (kv_heads // tp)
        assert int(ours[4 * per_page :, 2].sum()) == 13 * 2 * 2 * (kv_heads // tp) * 4 * 4


def test_adjacent_pages_coalesce_across_pages():
    shape = KVShape(layers=2, kv_heads=4, head_dim=8, element_size=2)
    p = plan(shape, PoolLayout(1, 16), PoolLayout(1, 16), 16 * 10, [range(10)], [range(3, 13)])
    assert p.runs[(0, 0)].tolist() == [[0, 3 * 16 * 2 * 2 * 4 * 8 * 2, 10 * 16 * 2 * 2 * 4 * 8 * 2]]


def test_nhd_to_nhd_of_all_heads_is_one_run_per_page():
    shape = KVShape(layers=2, kv_heads=4, head_dim=8, element_size=2)
    nhd = PoolLayout(1, 32, Order.NHD)
    p = plan(shape, nhd, nhd, 32 * 3, [[5, 1, 3]], [[2, 8, 6]])
    assert len(p.runs[(0, 0)]) == 3


# --- records and errors -------------------------------------------------------------------


def test_plan_runs_are_read_only():
    shape = KVShape(1, 2, 4, 2)
    p = plan(shape, PoolLayout(2, 16), PoolLayout(1, 32), 40, [[0, 1, 2]] * 2, [[4, 5]])
    with pytest.raises(ValueError):
        p.runs[(0, 0)][0, 0] = 1
    with pytest.raises(TypeError):
        p.runs[(9, 9)] = p.runs[(0, 0)]  # type: ignore[index]


def test_zero_tokens_is_an_empty_plan():
    p = plan(KVShape(1, 2, 4, 2), PoolLayout(2, 16), PoolLayout(2, 16), 0, [[], []], [[], []])
    assert p.pairs() == [] and p.writers_of(0) == () and p.owners_of(1) == ()


def test_short_page_list_names_rank_pages_given_and_needed():
    shape = KVShape(1, 2, 4, 2)
    with pytest.raises(
        ReshardError, match=r"decode rank 1: 2 pages given, 3 needed for 40 tokens at page size 16"
    ):
        plan(shape, PoolLayout(1, 64), PoolLayout(2, 16), 40, [[0]], [[0, 1, 2], [3, 4]])


def test_repeated_page_is_refused():
    shape = KVShape(1, 2, 4, 2)
    with pytest.raises(ReshardError, match=r"prefill rank 0: page 7 listed 2 times among the 3"):
        plan(shape, PoolLayout(1, 16), PoolLayout(1, 64), 40, [[7, 2, 7]], [[0]])


def test_page_lists_must_match_the_group():
    shape = KVShape(1, 2, 4, 2)
    with pytest.raises(ReshardError, match=r"prefill: 1 page lists for a TP group of 2"):
        plan(shape, PoolLayout(2, 16), PoolLayout(1, 16), 4, [[0]], [[0]])
    with pytest.raises(ReshardError, match=r"negative page -1"):
        plan(shape, PoolLayout(1, 16), PoolLayout(1, 16), 4, [[-1]], [[0]])


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVShape(0, 2, 4, 2),
        lambda: KVShape(1, 2, 4, 2.0),
        lambda: PoolLayout(0, 16),
        lambda: PoolLayout(1, -16),
        lambda: PoolLayout(1, 16, "HND"),
    ],
)
def test_records_refuse_bad_values(make):
    with pytest.raises(ReshardError):
        make()


def test_bad_tokens_and_ranks():
    shape = KVShape(1, 2, 4, 2)
    with pytest.raises(ReshardError, match="tokens must be an int"):
        plan(shape, PoolLayout(1, 16), PoolLayout(1, 16), -1, [[0]], [[0]])
    p = plan(shape, PoolLayout(1, 16), PoolLayout(1, 16), 4, [[0]], [[0]])
    with pytest.raises(ReshardError, match="owner 1 outside a decode TP group of 1"):
        p.writers_of(1)
    with pytest.raises(ReshardError, match="rank 4 outside a TP group of 4"):
        head_span(shape, 4, 4)


def test_torch_pools_reassemble_too():
    """The same runs copy torch bf16 pools (the KVPool's dtype and HND layout)."""
    shape = KVShape(layers=2, kv_heads=4, head_dim=8, element_size=2)
    src, dst, tokens = PoolLayout(2, 16), PoolLayout(1, 32, Order.NHD), 45
    src_pages, dst_pages = [[3, 0, 2], [1, 2, 0]], [[1, 0]]
    logical = torch.randn(tokens, 2, 2, 4, 8).to(torch.bfloat16)  # [T, layers, 2, heads, D]
    pools = []
    for w in range(2):
        pool = torch.zeros(4, 2, 2, 2, 16, 8, dtype=torch.bfloat16)
        for t in range(tokens):
            lo, hi = head_span(shape, 2, w)
            pool[src_pages[w][t // 16], :, :, :, t % 16] = logical[t, :, :, lo:hi]
        pools.append(pool)
    out = torch.zeros(2, 2, 2, 32, 4, 8, dtype=torch.bfloat16)
    p = plan(shape, src, dst, tokens, src_pages, dst_pages)
    flat = out.view(-1).view(torch.uint8)
    for (w, _), runs in p.runs.items():
        data = pools[w].view(-1).view(torch.uint8)
        for local, remote, n in runs.tolist():
            flat[remote : remote + n] = data[local : local + n]
    for t in range(tokens):
        assert torch.equal(out[dst_pages[0][t // 32], :, :, t % 32], logical[t])


# --- into a member of a decode group: a destination pool holding some of the heads -----
def _pool(pages: int, layers: int, heads: int, page_size: int, dim: int) -> np.ndarray:
    return np.zeros((pages, layers, 2, heads, page_size, dim), dtype=np.float32)


def _apply(runs: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for lo, ro, n in runs.tolist():
        d[ro : ro + n] = s[lo : lo + n]


def _tokens_of(pool: np.ndarray, pages: np.ndarray, tokens: int) -> np.ndarray:
    """``[layers, 2, heads, tokens, dim]``: the prompt's KV read through a page table."""
    page_size = pool.shape[4]
    rows = [pool[pages[t // page_size], :, :, :, t % page_size] for t in range(tokens)]
    return np.stack(rows, axis=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 2),  # layers
    st.integers(1, 5),  # kv heads
    st.sampled_from([1, 2, 4]),  # decode tp
    st.sampled_from([2, 4, 8]),  # source page size
    st.sampled_from([2, 4, 8]),  # destination page size
    st.integers(1, 40),  # tokens
    st.data(),
)
def test_heads_into_a_decode_members_pool_land_on_its_heads(
    layers, kv_heads, decode_tp, src_size, dst_size, tokens, data
):
    """Runs from a pool of every head into a member's pool of heads ``[dlo, dhi)``: each
    head of the pair lands at its place among the member's heads, for every token, and
    nothing else of the member's pool is touched; with equal page sizes, ``page_runs``
    repeated per page writes the same bytes (tokens past the prompt aside). Broken mode:
    the same runs planned as if the member held every head put bytes elsewhere."""
    dim = 3
    shape = KVShape(layers, kv_heads, dim, 4)
    member = data.draw(st.integers(0, decode_tp - 1))
    dlo, dhi = head_span(shape, decode_tp, member)
    lo = data.draw(st.integers(dlo, dhi - 1))
    hi = data.draw(st.integers(lo + 1, dhi))
    src_pages = np.array(
        data.draw(st.permutations(range(-(-tokens // src_size) + 2)))[: -(-tokens // src_size)]
    )
    dst_pages = np.array(
        data.draw(st.permutations(range(-(-tokens // dst_size) + 2)))[: -(-tokens // dst_size)]
    )
    src = (
        np.arange(
            (len(src_pages) + 2) * layers * 2 * kv_heads * src_size * dim, dtype=np.float32
        ).reshape(len(src_pages) + 2, layers, 2, kv_heads, src_size, dim)
        + 1
    )
    dst = _pool(len(dst_pages) + 2, layers, dhi - dlo, dst_size, dim)
    runs = heads_between_pools(
        shape, (lo, hi), tokens, (src_size, src_pages), (dst_size, dst_pages), dst_heads=(dlo, dhi)
    )
    _apply(runs, src, dst)
    got = _tokens_of(dst, dst_pages, tokens)
    want = _tokens_of(src, src_pages, tokens)
    assert np.array_equal(got[:, :, lo - dlo : hi - dlo], want[:, :, lo:hi])
    untouched = np.ones(dst.shape, dtype=bool)
    for t in range(tokens):
        untouched[dst_pages[t // dst_size], :, :, lo - dlo : hi - dlo, t % dst_size] = False
    assert not dst[untouched].any()
    if src_size == dst_size:
        per_page = _pool(len(dst_pages) + 2, layers, dhi - dlo, dst_size, dim)
        pattern = page_runs(shape, src_size, (lo, hi), (dlo, dhi))
        pb_src, pb_dst = src[0].nbytes, per_page[0].nbytes
        for s_page, d_page in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            shifted = pattern + np.array([s_page * pb_src, d_page * pb_dst, 0])
            _apply(shifted, src, per_page)
        assert np.array_equal(_tokens_of(per_page, dst_pages, tokens), got)
    if (dlo, dhi) != (0, kv_heads):  # broken: planned as if the member held every head
        wrong = _pool(len(dst_pages) + 2, layers, kv_heads, dst_size, dim)
        broken = heads_between_pools(
            shape, (lo, hi), tokens, (src_size, src_pages), (dst_size, dst_pages)
        )
        _apply(broken, src, wrong)
        flat = wrong.reshape(-1)[: dst.size].reshape(dst.shape)
        assert not np.array_equal(_tokens_of(flat, dst_pages, tokens), got)


def test_heads_outside_the_destinations_are_refused():
    shape = KVShape(1, 4, 8, 2)
    with pytest.raises(
        ReshardError, match=r"heads \[1, 3\) outside the destination's heads \[2, 4\)"
    ):
        heads_between_pools(shape, (1, 3), 4, (4, [0]), (4, [0]), dst_heads=(2, 4))
    with pytest.raises(ReshardError, match="outside the destination's heads"):
        page_runs(shape, 4, (0, 2), (1, 3))


def test_page_runs_cover_exactly_the_heads_of_a_page():
    """Into a pool of every head: the source side of ``page_runs`` covers exactly heads
    ``[lo, hi)`` of the page, one run per (layer, K/V) for some heads, and the whole page
    as one run for every head."""
    config = PoolConfig(
        layers=3, kv_heads=4, head_dim=4, page_size=2, num_pages=5, dtype=torch.bfloat16
    )
    pool = KVPool(config, zero=True)
    shape = KVShape(3, 4, 4, 2)
    lo, hi = 1, 3
    pool.kv[0, :, :, lo:hi] = 1.0
    raw = pool.kv[0].reshape(-1).view(torch.uint8)
    runs = page_runs(shape, 2, (lo, hi), (0, 4))
    assert len(runs) == 3 * 2
    assert np.array_equal(runs[:, 0], runs[:, 1])  # the same place in a pool of every head
    marked = torch.zeros_like(raw, dtype=torch.bool)
    for offset, _, nbytes in runs.tolist():
        marked[offset : offset + nbytes] = True
    assert bool((raw[~marked] == 0).all())  # every written byte is inside a run
    for offset, _, nbytes in runs.tolist():
        assert bool((raw[offset : offset + nbytes].view(torch.bfloat16) == 1.0).all())
    assert int(runs[:, 2].sum()) == 3 * 2 * 2 * 2 * 4 * 2
    page_bytes = pool.kv[0].numel() * pool.kv.element_size()
    assert page_runs(shape, 2, (0, 4), (0, 4)).tolist() == [[0, 0, page_bytes]]


def test_page_runs_of_token_major_pages_carry_each_token_s_heads():
    """NHD on both sides (one page size): a whole page of every head is one run; a share
    of the heads into a pool of every head is one run per token and (layer, K/V), each
    at the same place on both sides."""
    shape = KVShape(2, 4, 8, 2)
    page_bytes = 2 * 2 * 4 * 4 * 8 * 2
    assert page_runs(shape, 4, (0, 4), (0, 4), Order.NHD).tolist() == [[0, 0, page_bytes]]
    runs = page_runs(shape, 4, (1, 3), (0, 4), Order.NHD)
    assert len(runs) == 2 * 2 * 4 and set(runs[:, 2].tolist()) == {2 * 8 * 2}
    assert np.array_equal(runs[:, 0], runs[:, 1])
    token_stride = 4 * 8 * 2
    assert sorted(runs[:, 0].tolist())[:2] == [1 * 8 * 2, 1 * 8 * 2 + token_stride]
