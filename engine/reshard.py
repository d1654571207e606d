"""Any prefill shape into any decode shape, as byte runs planned once per request.

A prefill side and a decode side each hold the KV of a request in paged pools, one pool per
tensor-parallel rank. The two sides may differ in TP size, page size and the order of the
axes inside a page; :func:`plan` turns one request's page tables into, for every
(writer, owner) pair that exchanges bytes, an int64 array ``[n, 3]`` of runs
``(local offset, remote offset, length)``: what the writer copies from its own pool into
the owner's with one-sided writes. Pure: numpy and the standard library, no I/O.

**A rank's page.** With ``n`` the rank's local heads, ``P`` its page size and ``D`` the head
dim, one page is

- :attr:`Order.HND` ``[layers, 2, n, P, D]`` (today's :class:`~kvferry.engine.pool.KVPool`
  page: a head's tokens are contiguous), or
- :attr:`Order.NHD` ``[layers, 2, P, n, D]`` (a token's heads are contiguous),

where axis 1 is (0 = K, 1 = V). A pool is ``[pages, *page]``; offsets in runs are bytes from
the start of that rank's pool, ``page * page_bytes + offset_in_page``, with ``page_bytes``
the rank's own (ranks with more heads have bigger pages).

**Which heads a rank holds** (:func:`head_span`), for ``K = kv_heads`` over ``tp`` ranks:

- split, ``tp <= K``: rank ``r`` holds ``[r*K // tp, (r+1)*K // tp)``; contiguous ranges
  that cover every head once: ``K/tp`` heads each when ``tp`` divides ``K`` (the
  cluster's ``HeadSplit`` uses this span on both sides); when it does not, some ranks
  hold one head more (``K=3, tp=2``: ``[0, 1)`` and ``[1, 3)``).
- replicated GQA, ``tp > K``: rank ``r`` holds the one head ``r*K // tp``; consecutive
  ranks share a head (``K=2, tp=4``: heads 0, 0, 1, 1), as vLLM partitions GQA weights
  and as its NixlConnector reads them (``_physical_head_range``).
- replicated KV (:attr:`KVShape.replicated`, MLA's latent cache, usually one "head"):
  every rank holds all heads.

**Who writes what** (:func:`assign_heads`). Every owner needs every token of every head it
holds, and every destination byte gets exactly one writer. For head ``h``, let ``W_h`` be
the prefill ranks that hold it and ``O_h`` the decode ranks that hold it, both ascending;
the ``j``-th owner of ``O_h`` takes ``h`` from writer ``W_h[j * |W_h| // |O_h|]``. With
one holder that is the only choice; with replicas it spreads owners over holders in
blocks, the pairing vLLM's NixlConnector makes (decode rank ``d`` reads from prefill rank
``d // (D/P)`` when ``D >= P``, and from the first holder of each head among prefill ranks
``[d*P/D, (d+1)*P/D)`` when ``P > D``). A writer that holds a head no owner takes from it
writes nothing and no owner waits for it (:meth:`ReshardPlan.writers_of`).

**How** (:func:`plan`). The page boundaries of both sides repeat every
``lcm(P_src, P_dst)`` tokens, so the in-page offsets of one such period are the same for
every period; only the page numbers change. For each pair, the runs of one period are
enumerated on a grid of (token or page-aligned segment, layer x K/V, head), sorted by
source offset and coalesced (runs that are contiguous on both sides and stay inside one
source and one destination page merge); that pattern is then broadcast over the periods
with the page tables (numpy gather), a shorter pattern covers the last partial period, and
a last coalescing pass merges runs across pages that happen to be adjacent in both pools.
Cost: the pattern is ``O(min(lcm, tokens) x 2 x layers x heads)`` per pair (bounded by the
shape, not by the prompt) and the rest is linear in the runs it returns.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

Runs = npt.NDArray[np.int64]
"""``[n, 3]`` int64: (local offset, remote offset, length) in bytes."""

IntArray = npt.NDArray[np.int64]


class ReshardError(ValueError):
    """The shapes or the page tables given to :func:`plan` cannot describe the request."""


class Order(enum.Enum):
    """The order of the axes inside one page of a rank's pool."""

    HND = "HND"
    """``[layers, 2, local_heads, page_size, head_dim]``: today's KVPool page."""
    NHD = "NHD"
    """``[layers, 2, page_size, local_heads, head_dim]``."""


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReshardError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVShape:
    """The model's KV: per token, ``[layers, 2, kv_heads, head_dim]`` elements of
    ``element_size`` bytes. ``replicated``: every TP rank holds all heads (MLA's latent
    cache) instead of splitting them."""

    layers: int
    kv_heads: int
    head_dim: int
    element_size: int
    replicated: bool = False

    def __post_init__(self) -> None:
        _check_positive(
            "KVShape",
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            element_size=self.element_size,
        )

    @property
    def vector_bytes(self) -> int:
        """Bytes of one ``[head_dim]`` vector: the smallest run there is."""
        return self.head_dim * self.element_size


@dataclass(frozen=True)
class PoolLayout:
    """One side's pools: ``tp`` ranks, each a pool of pages of ``page_size`` tokens whose
    axes are in ``order`` (see :class:`Order`)."""

    tp: int
    page_size: int
    order: Order = Order.HND

    def __post_init__(self) -> None:
        _check_positive("PoolLayout", tp=self.tp, page_size=self.page_size)
        if not isinstance(self.order, Order):
            raise ReshardError(f"PoolLayout.order must be an Order, got {self.order!r}")


def head_span(shape: KVShape, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` that TP rank ``rank`` of ``tp`` holds (module docstring:
    split, split unevenly, replicated GQA, replicated KV)."""
    if not 0 <= rank < tp:
        raise ReshardError(f"rank {rank} outside a TP group of {tp}")
    if shape.replicated:
        return 0, shape.kv_heads
    lo = rank * shape.kv_heads // tp
    return lo, max((rank + 1) * shape.kv_heads // tp, lo + 1)


@dataclass(frozen=True)
class RankGeometry:
    """Where a ``[head_dim]`` vector lives in one rank's page, in bytes: at
    ``lc * lc_stride + (head - lo) * head_stride + slot * token_stride`` for
    ``lc = layer * 2 + kv``, of a page of ``page_bytes``."""

    lo: int
    hi: int
    page_size: int
    page_bytes: int
    lc_stride: int
    head_stride: int
    token_stride: int

    @property
    def heads(self) -> int:
        return self.hi - self.lo


def rank_geometry(shape: KVShape, layout: PoolLayout, rank: int) -> RankGeometry:
    """The byte strides of rank ``rank``'s page (``[layers, 2, n, P, D]`` or
    ``[layers, 2, P, n, D]``, ``n`` its local heads)."""
    lo, hi = head_span(shape, layout.tp, rank)
    return span_geometry(shape, layout.page_size, (lo, hi), layout.order)


def span_geometry(
    shape: KVShape, page_size: int, heads: tuple[int, int], order: Order = Order.HND
) -> RankGeometry:
    """The byte strides of a page of ``page_size`` tokens that holds KV heads
    ``[lo, hi)`` in ``order``."""
    lo, hi = heads
    if not 0 <= lo < hi <= shape.kv_heads:
        raise ReshardError(f"heads [{lo}, {hi}) outside the {shape.kv_heads} KV heads")
    n, p, vb = hi - lo, page_size, shape.vector_bytes
    if order is Order.HND:
        head_stride, token_stride = p * vb, vb
    else:
        head_stride, token_stride = vb, n * vb
    lc_stride = n * p * vb
    return RankGeometry(
        lo, hi, p, 2 * shape.layers * lc_stride, lc_stride, head_stride, token_stride
    )


def assign_heads(
    shape: KVShape, src: PoolLayout, dst: PoolLayout
) -> dict[tuple[int, int], tuple[int, ...]]:
    """``(writer, owner) -> heads``: the heads (ascending) that prefill rank ``writer``
    writes into decode rank ``owner``'s pool; every head an owner holds appears under
    exactly one writer. Pairs that exchange nothing are absent. The rule is in the module
    docstring ("Who writes what"). Loops over heads and ranks: bounded by the shape."""
    writers = [head_span(shape, src.tp, w) for w in range(src.tp)]
    owners = [head_span(shape, dst.tp, o) for o in range(dst.tp)]
    out: dict[tuple[int, int], list[int]] = {}
    for h in range(shape.kv_heads):
        holders = [w for w, (lo, hi) in enumerate(writers) if lo <= h < hi]
        takers = [o for o, (lo, hi) in enumerate(owners) if lo <= h < hi]
        for j, o in enumerate(takers):
            w = holders[j * len(holders) // len(takers)]
            out.setdefault((w, o), []).append(h)
    return {pair: tuple(heads) for pair, heads in sorted(out.items())}


def coalesce(runs: Runs) -> Runs:
    """Merge each run into the one before it when both its offsets continue that run's:
    ``[n, 3] -> [m, 3]``, ``m <= n``. Only neighbours in array order merge, so sort by the
    local offset first for the fewest runs."""
    if len(runs) < 2:
        return runs
    local, remote, length = runs[:, 0], runs[:, 1], runs[:, 2]
    follows = (local[1:] == local[:-1] + length[:-1]) & (remote[1:] == remote[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    merged = np.add.reduceat(length, starts)
    return np.stack([local[starts], remote[starts], merged], axis=1)


def normalize(runs: Runs) -> Runs:
    """Sorted by local offset and coalesced: one canonical form of the same byte mapping
    (the local ranges of one pair never overlap), to compare two plans."""
    return coalesce(runs[np.argsort(runs[:, 0], kind="stable")])


@dataclass(frozen=True)
class ReshardPlan:
    """One request's writes: for every (writer, owner) pair that exchanges bytes (TP
    positions on the prefill and the decode side), ``runs[(writer, owner)]`` is
    ``[n, 3]`` int64 ``(writer pool offset, owner pool offset, length)``, read-only, and
    ``heads[(writer, owner)]`` the heads those bytes carry."""

    shape: KVShape
    src: PoolLayout
    dst: PoolLayout
    tokens: int
    runs: Mapping[tuple[int, int], Runs]
    heads: Mapping[tuple[int, int], tuple[int, ...]]

    def pairs(self) -> list[tuple[int, int]]:
        """Every (writer, owner) with runs, sorted."""
        return sorted(self.runs)

    def writers_of(self, owner: int) -> tuple[int, ...]:
        """The writers ``owner`` must wait for (ack after flush): exactly those with runs
        into its pool."""
        if not 0 <= owner < self.dst.tp:
            raise ReshardError(f"owner {owner} outside a decode TP group of {self.dst.tp}")
        return tuple(w for w, o in self.pairs() if o == owner)

    def owners_of(self, writer: int) -> tuple[int, ...]:
        """The owners ``writer`` writes into (and must ack)."""
        if not 0 <= writer < self.src.tp:
            raise ReshardError(f"writer {writer} outside a prefill TP group of {self.src.tp}")
        return tuple(o for w, o in self.pairs() if w == writer)

    def runs_between(self, writer: int, owner: int) -> Runs:
        """``[n, 3]`` runs of one pair; ``[0, 3]`` for a pair that exchanges nothing."""
        return self.runs.get((writer, owner), np.zeros((0, 3), dtype=np.int64))

    @property
    def run_count(self) -> int:
        return sum(len(r) for r in self.runs.values())

    @property
    def total_bytes(self) -> int:
        return sum(int(r[:, 2].sum()) for r in self.runs.values())


def _pages_needed(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _page_table(
    pages: Sequence[int] | IntArray, tokens: int, page_size: int, side: str, rank: int
) -> IntArray:
    """The first ``ceil(tokens / page_size)`` pages of one rank's list, as int64, after
    checking they exist, are not negative and are distinct (a repeated page would be
    written twice)."""
    table = np.asarray(pages, dtype=np.int64).reshape(-1)
    needed = _pages_needed(tokens, page_size)
    if len(table) < needed:
        raise ReshardError(
            f"{side} rank {rank}: {len(table)} pages given, {needed} needed for {tokens} "
            f"tokens at page size {page_size}"
        )
    table = table[:needed]
    if needed and int(table.min()) < 0:
        raise ReshardError(f"{side} rank {rank}: negative page {int(table.min())}")
    uniq, counts = np.unique(table, return_counts=True)
    if len(uniq) != needed:
        raise ReshardError(
            f"{side} rank {rank}: page {int(uniq[np.argmax(counts > 1)])} listed "
            f"{int(counts.max())} times among the {needed} pages the request uses"
        )
    return table


def _token_units(
    span: int, src_page: int, dst_page: int, contiguous: bool
) -> tuple[IntArray, IntArray]:
    """``(start, count)`` of the token units of ``[0, span)``: single tokens, or when a
    head's tokens are contiguous on both sides, the segments between page boundaries of
    either side (inside one, both pages stay the same)."""
    if not contiguous:
        return np.arange(span, dtype=np.int64), np.ones(span, dtype=np.int64)
    cuts = np.union1d(np.arange(0, span, src_page), np.arange(0, span, dst_page))
    ends = np.append(cuts[1:], span)
    return cuts.astype(np.int64), (ends - cuts).astype(np.int64)


@dataclass(frozen=True)
class _Pattern:
    """The runs of one period (or of the last, partial one) with page numbers relative to
    the period: ``src_index``/``dst_index`` into the period's pages, in-page offsets and
    lengths, all ``[r]`` int64."""

    src_index: IntArray
    src_offset: IntArray
    dst_index: IntArray
    dst_offset: IntArray
    length: IntArray


def _pattern(
    shape: KVShape, gw: RankGeometry, go: RankGeometry, heads: IntArray, span: int
) -> _Pattern:
    """The coalesced runs that carry tokens ``[0, span)`` of ``heads`` from a writer's
    pages to an owner's, pages numbered from the period's start. Grid
    ``[units, 2 * layers, heads]``: bounded by the shape and ``span <= lcm(pages)``."""
    vb = shape.vector_bytes
    contiguous = gw.token_stride == vb and go.token_stride == vb
    start, count = _token_units(span, gw.page_size, go.page_size, contiguous)
    t = start[:, None, None]
    lc = np.arange(2 * shape.layers, dtype=np.int64)[None, :, None]
    h = heads[None, None, :]
    grid = (len(start), 2 * shape.layers, len(heads))

    def pseudo(g: RankGeometry) -> IntArray:
        # Pages spaced page_bytes + 1 apart, so no run is contiguous across two pages.
        offset = lc * g.lc_stride + (h - g.lo) * g.head_stride + (t % g.page_size) * g.token_stride
        return np.broadcast_to((t // g.page_size) * (g.page_bytes + 1) + offset, grid).reshape(-1)

    local, remote = pseudo(gw), pseudo(go)
    length = np.broadcast_to(count[:, None, None] * vb, grid).reshape(-1)
    order = np.argsort(local, kind="stable")
    runs = coalesce(np.stack([local[order], remote[order], length[order]], axis=1))
    si, so = np.divmod(runs[:, 0], gw.page_bytes + 1)
    di, do = np.divmod(runs[:, 1], go.page_bytes + 1)
    return _Pattern(si, so, di, do, runs[:, 2])


def _materialise(
    pat: _Pattern,
    periods: IntArray,
    per_period: tuple[int, int],
    tables: tuple[IntArray, IntArray],
    page_bytes: tuple[int, int],
) -> Runs:
    """Broadcast a pattern over ``periods`` with the page tables: ``[len(periods) * r, 3]``,
    period-major."""
    (ms, md), (src_table, dst_table), (pbs, pbd) = per_period, tables, page_bytes
    src_pages = src_table[periods[:, None] * ms + pat.src_index[None, :]]
    dst_pages = dst_table[periods[:, None] * md + pat.dst_index[None, :]]
    local = src_pages * pbs + pat.src_offset[None, :]
    remote = dst_pages * pbd + pat.dst_offset[None, :]
    length = np.broadcast_to(pat.length[None, :], local.shape)
    return np.stack([local.reshape(-1), remote.reshape(-1), length.reshape(-1)], axis=1)


def _pair_runs(
    shape: KVShape,
    gw: RankGeometry,
    go: RankGeometry,
    heads: IntArray,
    tokens: int,
    tables: tuple[IntArray, IntArray],
) -> Runs:
    """All runs of one (writer, owner) pair: full periods of ``lcm(P_src, P_dst)`` tokens,
    then the partial one, coalesced across pages that are adjacent on both sides."""
    period = math.lcm(gw.page_size, go.page_size)
    per_period = (period // gw.page_size, period // go.page_size)
    page_bytes = (gw.page_bytes, go.page_bytes)
    full, rest = divmod(tokens, period)
    parts: list[Runs] = []
    if full:
        pat = _pattern(shape, gw, go, heads, period)
        parts.append(
            _materialise(pat, np.arange(full, dtype=np.int64), per_period, tables, page_bytes)
        )
    if rest:
        pat = _pattern(shape, gw, go, heads, rest)
        last = np.array([full], dtype=np.int64)
        parts.append(_materialise(pat, last, per_period, tables, page_bytes))
    return coalesce(np.concatenate(parts)) if parts else np.zeros((0, 3), dtype=np.int64)


def _check_tables(
    tokens: int, layout: PoolLayout, pages: Sequence[Sequence[int]], side: str
) -> list[IntArray]:
    if len(pages) != layout.tp:
        raise ReshardError(f"{side}: {len(pages)} page lists for a TP group of {layout.tp}")
    return [_page_table(p, tokens, layout.page_size, side, r) for r, p in enumerate(pages)]


def _check_coverage(plan: ReshardPlan) -> None:
    """Every owner receives exactly ``tokens x 2 x layers x its heads`` vectors' bytes: a
    cheap guard against a planner bug (not a proof: the tests are)."""
    vb = plan.shape.vector_bytes
    for o in range(plan.dst.tp):
        lo, hi = head_span(plan.shape, plan.dst.tp, o)
        want = plan.tokens * 2 * plan.shape.layers * (hi - lo) * vb
        got = sum(int(plan.runs[(w, o)][:, 2].sum()) for w in plan.writers_of(o))
        if got != want:
            raise RuntimeError(f"reshard plan gives owner {o} {got} bytes, it needs {want}")


def plan(
    shape: KVShape,
    src: PoolLayout,
    dst: PoolLayout,
    tokens: int,
    src_pages: Sequence[Sequence[int]],
    dst_pages: Sequence[Sequence[int]],
) -> ReshardPlan:
    """Plan the writes of one request of ``tokens`` tokens: ``src_pages[w]`` is prefill
    rank ``w``'s page list, ``dst_pages[o]`` decode rank ``o``'s (each at least
    ``ceil(tokens / page_size)`` distinct pages; further pages are ignored). Only slots of
    tokens ``< tokens`` are written. Raises :class:`ReshardError` with the numbers when a
    table cannot hold the request."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ReshardError(f"tokens must be an int >= 0, got {tokens!r}")
    src_tables = _check_tables(tokens, src, src_pages, "prefill")
    dst_tables = _check_tables(tokens, dst, dst_pages, "decode")
    runs: dict[tuple[int, int], Runs] = {}
    heads: dict[tuple[int, int], tuple[int, ...]] = {}
    if tokens:
        for (w, o), pair_heads in assign_heads(shape, src, dst).items():
            gw, go = rank_geometry(shape, src, w), rank_geometry(shape, dst, o)
            hs = np.asarray(pair_heads, dtype=np.int64)
            pair = _pair_runs(shape, gw, go, hs, tokens, (src_tables[w], dst_tables[o]))
            pair.setflags(write=False)
            runs[(w, o)], heads[(w, o)] = pair, pair_heads
    result = ReshardPlan(shape, src, dst, tokens, MappingProxyType(runs), MappingProxyType(heads))
    _check_coverage(result)
    return result


def heads_between_pools(
    shape: KVShape,
    heads: tuple[int, int],
    tokens: int,
    src: tuple[int, Sequence[int] | IntArray],
    dst: tuple[int, Sequence[int] | IntArray],
    dst_heads: tuple[int, int] | None = None,
    orders: tuple[Order, Order] = (Order.HND, Order.HND),
) -> Runs:
    """The runs that carry heads ``[lo, hi)`` of a request's ``tokens`` tokens from one
    pool to another (a cluster's prefill and decode ranks): the source pool holds every
    KV head, the destination pool ``dst_heads`` (default every head: a member of a decode
    TP group holds its share), and their page sizes may differ: ``src`` and ``dst`` are
    each ``(page_size, page list)``; ``orders`` are the (source, destination) pages' axis
    orders. Only slots of tokens ``< tokens`` are written. The destination offsets depend
    only on ``dst`` (an owner that does not know the writer's pages can plan the same
    bytes with any source list of the right length, and any source order)."""
    lo, hi = heads
    dlo, dhi = dst_heads or (0, shape.kv_heads)
    if not 0 <= lo < hi <= shape.kv_heads:
        raise ReshardError(f"heads [{lo}, {hi}) outside the {shape.kv_heads} KV heads")
    if not dlo <= lo < hi <= dhi:
        raise ReshardError(f"heads [{lo}, {hi}) outside the destination's heads [{dlo}, {dhi})")
    (src_size, src_pages), (dst_size, dst_pages) = src, dst
    gw = span_geometry(shape, src_size, (0, shape.kv_heads), orders[0])
    go = span_geometry(shape, dst_size, (dlo, dhi), orders[1])
    tables = (
        _page_table(src_pages, tokens, src_size, "prefill", 0),
        _page_table(dst_pages, tokens, dst_size, "decode", 0),
    )
    if not tokens:
        return np.zeros((0, 3), dtype=np.int64)
    hs = np.arange(lo, hi, dtype=np.int64)
    return _pair_runs(shape, gw, go, hs, tokens, tables)


def page_for_page(src: tuple[int, Order], dst: tuple[int, Order]) -> bool:
    """Whether a writer's pool and an owner's, each ``(page_size, order)``, map page to
    page: one page size. The writer then writes each page as it lies in its own memory
    (one page's runs, :func:`page_runs`, repeated; a whole page is one run when it sends
    every head), and an owner of the other order turns each landed page into its own
    after its checks (:meth:`~.pool.KVPool.relayout`, two local passes at memory speed)
    instead of taking a run per token and head. Pools of two page sizes are planned per
    request with :func:`heads_between_pools`."""
    return src[0] == dst[0]


def page_runs(
    shape: KVShape,
    page_size: int,
    heads: tuple[int, int],
    dst_heads: tuple[int, int],
    order: Order = Order.HND,
) -> Runs:
    """``[r, 3]``: the runs (offset in the source page, offset in the destination page,
    length) that carry heads ``[lo, hi)`` of one whole page between two pages of the
    same page size laid in ``order``, the source holding every head and the destination
    ``dst_heads``:
    what a writer repeats for each page of a prompt (``page * page_bytes`` added on each
    side). Runs merge only where both sides are contiguous."""
    lo, hi = heads
    dlo, dhi = dst_heads
    if not (0 <= lo < hi <= shape.kv_heads and dlo <= lo and hi <= dhi <= shape.kv_heads):
        raise ReshardError(
            f"heads [{lo}, {hi}) outside the destination's heads [{dlo}, {dhi}) of {shape.kv_heads}"
        )
    gw = span_geometry(shape, page_size, (0, shape.kv_heads), order)
    go = span_geometry(shape, page_size, (dlo, dhi), order)
    pat = _pattern(shape, gw, go, np.arange(lo, hi, dtype=np.int64), page_size)
    assert not pat.src_index.any() and not pat.dst_index.any(), "one page, one page"
    return np.stack([pat.src_offset, pat.dst_offset, pat.length], axis=1)


# --- the reference: slow and obviously correct, for the tests only ---------------------


def _reference_offset(
    shape: KVShape, layout: PoolLayout, rank: int, page: int, index: tuple[int, int, int, int]
) -> int:
    """Byte offset in rank ``rank``'s pool of the vector (layer, kv, head, slot) of
    ``page``, from the page shape itself (``np.ravel_multi_index``)."""
    layer, kv, head, slot = index
    lo, hi = head_span(shape, layout.tp, rank)
    n, p = hi - lo, layout.page_size
    if layout.order is Order.HND:
        dims, at = (shape.layers, 2, n, p, shape.head_dim), (layer, kv, head - lo, slot, 0)
    else:
        dims, at = (shape.layers, 2, p, n, shape.head_dim), (layer, kv, slot, head - lo, 0)
    elements = int(np.ravel_multi_index(at, dims)) + page * math.prod(dims)
    return elements * shape.element_size


def _reference_writer(
    shape: KVShape, src: PoolLayout, dst: PoolLayout, head: int, owner: int
) -> int:
    holders = [w for w in range(src.tp) if head in range(*head_span(shape, src.tp, w))]
    takers = [o for o in range(dst.tp) if head in range(*head_span(shape, dst.tp, o))]
    return holders[takers.index(owner) * len(holders) // len(takers)]


def plan_reference(
    shape: KVShape,
    src: PoolLayout,
    dst: PoolLayout,
    tokens: int,
    src_pages: Sequence[Sequence[int]],
    dst_pages: Sequence[Sequence[int]],
) -> ReshardPlan:
    """:func:`plan` the slow way: one run of ``head_dim`` elements per (owner, head,
    token, layer, K/V), uncoalesced. Compare with :func:`normalize` on both sides."""
    found: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    found_heads: dict[tuple[int, int], set[int]] = {}
    for o in range(dst.tp):
        for h in range(*head_span(shape, dst.tp, o)):
            w = _reference_writer(shape, src, dst, h, o)
            for t in range(tokens):
                sp, dp = src_pages[w][t // src.page_size], dst_pages[o][t // dst.page_size]
                for layer in range(shape.layers):
                    for kv in range(2):
                        at_src = (layer, kv, h, t % src.page_size)
                        at_dst = (layer, kv, h, t % dst.page_size)
                        local = _reference_offset(shape, src, w, sp, at_src)
                        remote = _reference_offset(shape, dst, o, dp, at_dst)
                        found.setdefault((w, o), []).append((local, remote, shape.vector_bytes))
                        found_heads.setdefault((w, o), set()).add(h)
    runs = {pair: np.array(rows, dtype=np.int64).reshape(-1, 3) for pair, rows in found.items()}
    heads = {pair: tuple(sorted(hs)) for pair, hs in found_heads.items()}
    return ReshardPlan(shape, src, dst, tokens, MappingProxyType(runs), MappingProxyType(heads))
