"""Byte runs between two unlike vLLM engines: any TP sizes, block sizes and KV layouts.

A prefill worker writes the rows (one layer's K|V of one head at one token) of the heads
it is assigned (:func:`pairs`, the rule of :func:`kvferry.engine.reshard.assign_heads`)
into each decode worker that holds them. Where a row lives on either side is that side's
:class:`~.layout.LayerRows`; :func:`plan_pair` lays the rows of one (writer, owner) pair
for one request side by side and merges those contiguous on both sides into runs
``(local offset, remote offset, length)``, per (local buffer, remote buffer), once per
request (numpy, no loop over tokens). A run never crosses a decode block, so the owner's
I5 check is per block: the *region* a writer wrote into a block is its runs into that
block concatenated in the decode's byte order, and its checksum is put together from the
runs' (:func:`kvferry.engine.run_checksum.combine_keyed`) on the writer's source bytes and
on the owner's landed bytes alike (:func:`region_checksums`). Two engines whose layouts,
block sizes and TP sizes agree still go the homogeneous way (whole blocks, page
checksums), and so do two that differ only in the order of heads and tokens inside each
layer's span (HND against NHD, :func:`turnable_blocks`): the decode checks the blocks as
they landed, then turns them into its order (:func:`turn_blocks`). This module is for
the pairs that differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.engine.integrity import page_checksums
from kvferry.engine.keysort import lexsort_order
from kvferry.engine.pool import turn_rows
from kvferry.engine.reshard import KVShape, PoolLayout, ReshardError, assign_heads, head_span
from kvferry.engine.run_checksum import combine_keyed, run_checksums, word_unit

from .layout import KVRegions, LayerRows, LayoutError

ORDER_SHIFT = 48  # a run's place in its block's region: (buffer << 48) | offset


@dataclass(frozen=True)
class EngineShape:
    """What one engine's TP group holds: ``kv_heads`` in all, over ``tp`` workers."""

    kv_heads: int
    tp: int

    def heads_of(self, rank: int) -> tuple[int, int]:
        """The global KV heads ``[lo, hi)`` that worker ``rank`` holds (replicated GQA:
        one head, shared by consecutive workers)."""
        return head_span(KVShape(1, self.kv_heads, 1, 1), self.tp, rank)


def pairs(prefill: EngineShape, decode: EngineShape) -> dict[tuple[int, int], tuple[int, ...]]:
    """``(prefill rank, decode rank) -> global heads`` the first writes into the second;
    every head a decode worker holds comes from exactly one prefill worker."""
    if prefill.kv_heads != decode.kv_heads:
        raise LayoutError(
            f"the prefill engine holds {prefill.kv_heads} KV heads, the decode "
            f"{decode.kv_heads}: not the same model"
        )
    try:
        return assign_heads(
            KVShape(1, prefill.kv_heads, 1, 1),
            PoolLayout(prefill.tp, 1),
            PoolLayout(decode.tp, 1),
        )
    except ReshardError as exc:
        raise LayoutError(str(exc)) from exc


def writers_of(prefill: EngineShape, decode: EngineShape, rank: int) -> list[int]:
    """The prefill ranks that write into decode worker ``rank``, ascending."""
    return sorted(p for p, d in pairs(prefill, decode) if d == rank)


def owners_of(prefill: EngineShape, decode: EngineShape, rank: int) -> list[int]:
    """The decode ranks prefill worker ``rank`` writes into, ascending (empty: its heads
    are all taken from other holders, and it writes nothing)."""
    return sorted(d for p, d in pairs(prefill, decode) if p == rank)


@dataclass(frozen=True)
class PairRuns:
    """One writer's runs into one owner for one request. ``runs`` ``[n, 3]`` int64
    (local offset, remote offset, length); per run its local and remote buffer and
    ``block``: the index, in the owner's planned blocks, of the block it lands in."""

    runs: np.ndarray
    src_buffer: np.ndarray
    dst_buffer: np.ndarray
    block: np.ndarray
    unit: int

    @property
    def bytes(self) -> int:
        return int(self.runs[:, 2].sum())

    def within(self, keep: np.ndarray) -> PairRuns:
        """The runs that land in the planned blocks ``keep`` marks (``[blocks]`` bool,
        by the blocks' places in the plan): a part of the request, or what its parts left."""
        which = np.flatnonzero(keep[self.block])
        return PairRuns(
            self.runs[which],
            self.src_buffer[which],
            self.dst_buffer[which],
            self.block[which],
            self.unit,
        )

    def batches(self, max_bytes: int) -> list[tuple[int, int, np.ndarray]]:
        """``(local buffer, remote buffer, runs)`` of at most ``max_bytes`` each (a run
        longer than that goes alone), in plan order: as many runs a batch as the longest
        run of the buffer pair allows."""
        out: list[tuple[int, int, np.ndarray]] = []
        pair = self.src_buffer * (1 << 20) + self.dst_buffer
        for key in np.unique(pair):
            which = np.flatnonzero(pair == key)
            runs = self.runs[which]
            per = max(1, max_bytes // max(1, int(runs[:, 2].max())))
            src, dst = int(self.src_buffer[which[0]]), int(self.dst_buffer[which[0]])
            out += [(src, dst, runs[lo : lo + per]) for lo in range(0, len(runs), per)]
        return out


def part_ranges(blocks: int, nbytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """A load of ``blocks`` planned decode blocks holding ``nbytes`` cut into parts of
    whole blocks, about ``part_bytes`` each (one part when ``part_bytes`` <= 0): each
    part's ``[lo, hi)`` places in the plan, in order."""
    per_block = max(1, nbytes // max(1, blocks))
    step = max(1, blocks if part_bytes <= 0 else part_bytes // per_block)
    return [(lo, min(blocks, lo + step)) for lo in range(0, blocks, step)]


def same_blocks(a: KVRegions, b: KVRegions) -> bool:
    """Two workers' blocks are alike (whole blocks move as they are): the same layout,
    runs per block, and every layer's rows at the same bytes of the block (heads, kernel
    blocks per scheduler block and their tokens, row, offset and strides). Block size,
    heads and runs alone do not say: a block of 16 tokens in one kernel block and one in
    two kernel blocks of 8 hold the same bytes in another order, and moved whole, the
    decode would read other rows, past the prompt those of whatever the block held
    before."""

    def rows(r: KVRegions) -> list[tuple[int, ...]]:
        return [
            (
                x.buffer,
                x.offset,
                x.block_stride,
                x.head_stride,
                x.token_stride,
                x.heads,
                x.kernel_tokens,
                x.ratio,
                x.row_bytes,
            )
            for x in r.layers
        ]

    return a.layout == b.layout and a.signature() == b.signature() and rows(a) == rows(b)


def _layer_dense(r: LayerRows) -> bool:
    """Each kernel block of the layer is one span of its rows, heads-major or token-major,
    and the next kernel block starts right after it (a layer-outermost HND or NHD cache)."""
    grid = r.heads * r.kernel_tokens * r.row_bytes
    heads_major = (r.head_stride, r.token_stride) == (r.kernel_tokens * r.row_bytes, r.row_bytes)
    token_major = (r.head_stride, r.token_stride) == (r.row_bytes, r.heads * r.row_bytes)
    return r.block_stride == grid and (heads_major or token_major)


def turnable_blocks(a: KVRegions, b: KVRegions) -> bool:
    """Two workers' blocks hold the same spans (every buffer's runs per block, every
    layer's heads, tokens and row) and differ only in how each layer's span orders its
    rows (HND against NHD): whole blocks move as they lie at the writer, and the owner
    turns them into its order after its checks (:func:`turn_blocks`) instead of taking a
    run per head and token."""
    if a.signature() != b.signature() or len(a.layers) != len(b.layers) or not a.layers:
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        shape = (x.buffer, x.heads, x.kernel_tokens, x.ratio, x.row_bytes)
        if shape != (y.buffer, y.heads, y.kernel_tokens, y.ratio, y.row_bytes):
            return False
        if not (_layer_dense(x) and _layer_dense(y)):
            return False
    return True


def whole_blocks(a: KVRegions, b: KVRegions) -> bool:
    """Whole blocks move between the two workers (of one TP rank and size): alike
    (:func:`same_blocks`), or alike but for the order inside each layer's span
    (:func:`turnable_blocks`, turned by the owner). Both sides ask this of the same two
    geometries, so they agree."""
    return same_blocks(a, b) or turnable_blocks(a, b)


def turned_pair(a: KVRegions, b: KVRegions) -> bool:
    """Whole blocks move between the two workers and the owner turns them: turnable
    (:func:`turnable_blocks`) but not alike (:func:`same_blocks`)."""
    return turnable_blocks(a, b) and not same_blocks(a, b)


def writers_outer(theirs: LayerRows, mine: LayerRows) -> bool:
    """How a layer's kernel span of ``mine`` lands when it holds ``q`` kernel spans of
    ``theirs`` from each of ``writers`` writers: ``[writers, q, span]`` (True) or ``[q,
    writers, span]`` (heads-major spans into a token-major one). Either way the owner's
    turn is one pass (:func:`turn_blocks`), and writer-major gives each writer one remote
    piece per decode kernel block where it can; with ``q`` = 1 the two are the same."""
    return not (theirs.token_stride == theirs.row_bytes and mine.token_stride != mine.row_bytes)


def turn_blocks(
    mine: KVRegions, theirs: KVRegions, blocks: Sequence[int], writers: int = 1
) -> None:
    """Turn ``blocks`` (scheduler blocks of ``mine``) into ``mine``'s order, in place, per
    layer, in one pass (:func:`~kvferry.engine.pool.turn_rows`). Each layer's kernel span
    holds ``q`` (``mine``'s kernel tokens over ``theirs``') kernel spans of ``theirs``
    from each of ``writers`` writers (each holding ``share`` of the heads), laid as
    ``theirs`` orders them, landed as :func:`writers_outer` says: whole blocks
    (:func:`turnable_blocks`, one writer and ``q`` = 1) or slots (:func:`slot_of`).

    - heads-major into token-major: landed ``[q, heads, tokens, row]``, the heads and
      tokens swapped;
    - heads-major into heads-major: landed ``[writers, q, share, tokens * row]``, ``q``
      and the share swapped;
    - token-major into token-major: landed ``[writers, q * tokens, share * row]``, the
      writers and the tokens swapped;
    - token-major into heads-major: landed ``[writers, q * tokens, share, row]``, each
      writer's tokens and heads swapped.

    A span that landed in ``mine``'s order (heads-major both, ``q`` = 1 or one head a
    writer; token-major both, one writer) is left."""
    if not len(blocks):
        return
    for x, y in zip(theirs.layers, mine.layers, strict=True):
        q = y.kernel_tokens // x.kernel_tokens
        tokens, row, heads = x.kernel_tokens, y.row_bytes, y.heads
        share = heads // writers
        src_heads_major = x.token_stride == x.row_bytes
        dst_heads_major = y.token_stride == y.row_bytes
        landed: tuple[int, ...]
        if src_heads_major and not dst_heads_major:
            landed, axis = (q, heads, tokens, row), 1
        elif src_heads_major:
            if q == 1:
                continue
            landed, axis = (writers, q, share, tokens * row), 1
        elif not dst_heads_major:
            if writers == 1:
                continue
            landed, axis = (writers, q * tokens, share * row), 0
        else:
            landed, axis = (writers, q * tokens, share, row), 1
        if 1 in landed[axis : axis + 2]:
            continue  # swapping an axis of one: in mine's order already
        buf = mine.buffers[y.buffer].tensor
        kernel = torch.from_numpy(
            (np.asarray(blocks, dtype=np.int64)[:, None] * y.ratio + np.arange(y.ratio)).reshape(-1)
        ).to(buf.device)
        span = y.heads * y.kernel_tokens * y.row_bytes  # dense (_layer_dense)
        spans = buf.as_strided((mine.num_blocks * y.ratio, span), (y.block_stride, 1), y.offset)
        turn_rows(spans, kernel, landed, axis=axis)


def slot_of(
    src: KVRegions, dst: KVRegions, prefill: EngineShape, decode: EngineShape, p: int, d: int
) -> int | None:
    """Where prefill worker ``p``'s spans go in decode worker ``d``'s, when the pair goes
    by slots, else None. A fan-in (prefill TP a multiple of the decode's, no head held by
    two prefill workers) of one row, whose decode kernel blocks hold a whole number ``q``
    of the prefill's (``q`` >= 1: block sizes alike, or the decode's larger), both sides'
    layers dense spans (:func:`_layer_dense`): each of the ``k = prefill.tp // decode.tp``
    writers of a decode worker holds a contiguous share of its heads, so each writes every
    kernel block's span whole, as it lies, into its slot of the owner's kernel span that
    holds it: ``(p % k) * q + u`` or ``u * k + p % k`` (``u``: its place among the ``q``),
    as :func:`writers_outer` says. The owner's turn puts the span into its order after
    the checks (:func:`turn_blocks` with ``writers=k``); spans already in the owner's order
    need none. A remote piece a decode kernel block and writer (writer-major) or a prefill
    kernel block and writer, where rows would make one per token and head in a token-major
    span. Returns ``p % k``. Both sides ask this of the same geometries, so they agree."""
    if not (prefill.tp > decode.tp and prefill.tp % decode.tp == 0):
        return None
    k = prefill.tp // decode.tp
    if decode.kv_heads % prefill.tp or p // k != d:
        return None
    share = decode.kv_heads // prefill.tp
    if len(src.layers) != len(dst.layers) or not src.layers:
        return None
    for x, y in zip(src.layers, dst.layers, strict=True):
        if x.row_bytes != y.row_bytes or y.kernel_tokens % x.kernel_tokens:
            return None
        if x.heads != share or y.heads != share * k:
            return None
        if not (_layer_dense(x) and _layer_dense(y)):
            return None
    return p % k


def slots_agree(slots: Sequence[int | None]) -> bool:
    """Whether one decode worker's writers of a load (their :func:`slot_of`) can land
    together: all by slots, each its own, so that one turn covers every slot of a span,
    or none by slots. A mix would have the turn scramble the rows' bytes; the owner
    refuses it before planning."""
    taken = [s for s in slots if s is not None]
    return not taken or (len(taken) == len(slots) and len(set(taken)) == len(taken))


def slotted_alike(writers: Sequence[KVRegions]) -> bool:
    """Whether the writers that land in one decode worker's slots lay their layers out
    alike (heads, kernel tokens, blocks per scheduler block, row, and the strides that
    make a span heads- or token-major): the owner turns every slot of a span by the
    first one's geometry, so writers that differ (engines whose workers disagree, a
    handshake that lies) would have it scramble their bytes; the owner refuses them."""

    def geometry(regions: KVRegions) -> list[tuple[int, ...]]:
        return [
            (x.heads, x.kernel_tokens, x.ratio, x.row_bytes, x.head_stride, x.token_stride)
            for x in regions.layers
        ]

    return all(geometry(w) == geometry(writers[0]) for w in writers[1:])


def plan_slots(
    src: KVRegions,
    dst: KVRegions,
    slot: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    tokens: int,
) -> PairRuns:
    """The runs of a pair that goes by slots (:func:`slot_of`, ``slot`` its answer): per
    layer, planned decode block, kernel block and each of the ``q`` prefill kernel blocks
    it holds, the writer's whole span into its place ``u`` among them in its slot of the
    owner's kernel span (:func:`writers_outer`: ``slot * q + u``, else ``u * k + slot``).
    The owner's blocks hold the prompt's last blocks, as in :func:`plan_pair`; a prefill
    kernel block wholly past the prompt is not written (its place in the owner's span
    holds tokens past the prompt once turned)."""
    _blocks_needed(src, dst, src_blocks, dst_blocks, tokens)
    first = _first_planned_token(dst.layers[0].block_tokens, tokens, len(dst_blocks))
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    which = np.arange(len(db), dtype=np.int64)
    parts = []
    for x, y in zip(src.layers, dst.layers, strict=True):
        q, k = y.kernel_tokens // x.kernel_tokens, y.heads // x.heads
        span = x.heads * x.kernel_tokens * x.row_bytes
        j = np.arange(y.ratio, dtype=np.int64)[None, :, None]
        u = np.arange(q, dtype=np.int64)[None, None, :]
        # [planned blocks, kernel blocks, q]: the prefill kernel block each place holds
        g = first // x.kernel_tokens + (which[:, None, None] * y.ratio + j) * q + u
        place = slot * q + u if writers_outer(x, y) else u * k + slot
        do = y.offset + (db[:, None, None] * y.ratio + j) * y.block_stride + place * span
        key = np.broadcast_to(which[:, None, None], g.shape)
        keep = g * x.kernel_tokens < tokens
        g, do, key = g[keep], do[keep], key[keep]
        so = x.offset + (sb[g // x.ratio] * x.ratio + g % x.ratio) * x.block_stride
        n = so.size
        parts.append(
            (
                so,
                do,
                np.full(n, span, dtype=np.int64),
                np.full(n, x.buffer, dtype=np.int64),
                np.full(n, y.buffer, dtype=np.int64),
                key,
            )
        )
    so, do, ln, sbuf, dbuf, key = (np.concatenate(c) for c in zip(*parts, strict=True))
    runs, sbuf, dbuf, key = _coalesce(so, do, ln, sbuf, dbuf, key)
    return PairRuns(runs, sbuf, dbuf, key, word_unit(src.layers[0].row_bytes))


def _blocks_needed(
    src: KVRegions,
    dst: KVRegions,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    tokens: int,
) -> int:
    """The decode blocks a prompt of ``tokens`` fills, once the two engines pair
    (:func:`_check_pair`), the writer holds all the blocks it fills and the owner plans at
    most all of its (its last ones; it may hold the first already); else LayoutError."""
    _check_pair(src, dst)
    p_src, p_dst = src.layers[0].block_tokens, dst.layers[0].block_tokens
    need_src, need_dst = -(-tokens // p_src), -(-tokens // p_dst)
    if len(src_blocks) < need_src:
        raise LayoutError(f"{len(src_blocks)} prefill blocks of {p_src} for {tokens} tokens")
    if not 0 < len(dst_blocks) <= need_dst:
        raise LayoutError(
            f"{len(dst_blocks)} decode blocks of {p_dst} tokens planned for a prompt of "
            f"{tokens} (at most {need_dst})"
        )
    return need_dst


def _first_planned_token(block_tokens: int, tokens: int, planned: int) -> int:
    """The first token of a plan of ``planned`` decode blocks of ``block_tokens``: the
    prompt's last blocks (the owner may hold its first tokens already)."""
    return (-(-tokens // block_tokens) - planned) * block_tokens


def source_blocks(
    src: KVRegions, dst: KVRegions, planned: int, tokens: int, lo: int, hi: int
) -> tuple[int, int]:
    """``[a, b)``: the places, in the writer's block list (from token 0), of the source
    blocks that decode blocks ``[lo, hi)`` of a plan of ``planned`` blocks read (the plan
    holds the prompt's last blocks, as in :func:`plan_pair`)."""
    p_src, p_dst = src.layers[0].block_tokens, dst.layers[0].block_tokens
    first = _first_planned_token(p_dst, tokens, planned)
    start, end = first + lo * p_dst, min(tokens, first + hi * p_dst)
    return start // p_src, -(-end // p_src)


def _check_pair(src: KVRegions, dst: KVRegions) -> None:
    if not src.layers or not dst.layers:
        raise LayoutError("an engine sent no row geometry (a kvferry too old to reshape)")
    if len(src.layers) != len(dst.layers):
        raise LayoutError(
            f"the prefill has {len(src.layers)} KV layers, the decode {len(dst.layers)}"
        )
    for a, b in zip(src.layers, dst.layers, strict=True):
        if a.row_bytes != b.row_bytes:
            raise LayoutError(
                f"layer {a.name}: a K|V row of {a.row_bytes} bytes at the prefill, "
                f"{b.row_bytes} at the decode (head size or dtype differ)"
            )


def _segments(first: int, end: int, grains: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[first, end)`` cut at every multiple of each grain: (starts, lengths)."""
    cuts = [np.arange(-(-first // g) * g, end, g, dtype=np.int64) for g in grains]
    starts = np.unique(np.concatenate([np.array([first], dtype=np.int64), *cuts]))
    return starts, np.diff(np.r_[starts, end])


def _offsets(
    rows: LayerRows, blocks: np.ndarray, first: int, starts: np.ndarray, heads: np.ndarray
) -> np.ndarray:
    """``[heads, segments]``: byte offsets of each head's row at each segment's start,
    for a block table whose first block holds token ``first``."""
    p = rows.block_tokens
    rel = starts - first
    block = blocks[rel // p]
    kernel = block * rows.ratio + (starts % p) // rows.kernel_tokens
    slot = starts % rows.kernel_tokens
    base = rows.offset + kernel * rows.block_stride + slot * rows.token_stride
    return base[None, :] + heads[:, None] * rows.head_stride


def plan_pair(
    src: KVRegions,
    dst: KVRegions,
    heads: Sequence[int],
    src_first_head: int,
    dst_first_head: int,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    tokens: int,
) -> PairRuns:
    """The runs that move the rows of global ``heads`` for a prompt of ``tokens`` from
    the writer's ``src_blocks`` (from token 0) into the owner's ``dst_blocks``, which
    hold the prompt's last blocks (the owner may hold its first tokens already). Each
    side's local head of global head ``h`` is ``h - *_first_head``."""
    p_src, p_dst = src.layers[0].block_tokens, dst.layers[0].block_tokens
    _blocks_needed(src, dst, src_blocks, dst_blocks, tokens)
    first = _first_planned_token(p_dst, tokens, len(dst_blocks))
    contiguous = all(r.token_stride == r.row_bytes for r in (*src.layers, *dst.layers))
    grains = [r.kernel_tokens for r in (*src.layers, *dst.layers)] + [p_src, p_dst]
    starts, lengths = _segments(first, tokens, grains if contiguous else [1])
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    h = np.asarray(heads, dtype=np.int64)
    block = (starts - first) // p_dst
    parts = []
    for a, b in zip(src.layers, dst.layers, strict=True):
        so = _offsets(a, sb, 0, starts, h - src_first_head)
        do = _offsets(b, db, first, starts, h - dst_first_head)
        n = so.size
        parts.append(
            (
                so.reshape(-1),
                do.reshape(-1),
                np.broadcast_to(lengths[None, :] * a.row_bytes, so.shape).reshape(-1),
                np.full(n, a.buffer, dtype=np.int64),
                np.full(n, b.buffer, dtype=np.int64),
                np.broadcast_to(block[None, :], so.shape).reshape(-1),
            )
        )
    so, do, ln, sbuf, dbuf, key = (np.concatenate(c) for c in zip(*parts, strict=True))
    runs, sbuf, dbuf, key = _coalesce(so, do, ln, sbuf, dbuf, key)
    return PairRuns(runs, sbuf, dbuf, key, word_unit(src.layers[0].row_bytes))


def _coalesce(
    so: np.ndarray,
    do: np.ndarray,
    ln: np.ndarray,
    sbuf: np.ndarray,
    dbuf: np.ndarray,
    key: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sorted by (buffers, block, remote offset); neighbours contiguous on both sides, in
    the same buffers and the same decode block, merged. Remote order, since a decode
    block's pieces then follow each other there: the cross-memory copy moves pieces
    contiguous on one side as one, and a remote piece is what costs it (the kernel pins
    the target's pages for each); local pieces are cheap."""
    by = lexsort_order(do, key, dbuf, sbuf)
    so, do, ln, sbuf, dbuf, key = so[by], do[by], ln[by], sbuf[by], dbuf[by], key[by]
    follows = (
        (sbuf[1:] == sbuf[:-1])
        & (dbuf[1:] == dbuf[:-1])
        & (key[1:] == key[:-1])
        & (so[1:] == so[:-1] + ln[:-1])
        & (do[1:] == do[:-1] + ln[:-1])
    )
    starts = np.flatnonzero(np.r_[True, ~follows])
    merged = np.add.reduceat(ln, starts) if len(ln) else ln
    runs = np.stack([so[starts], do[starts], merged], axis=1)
    return runs, sbuf[starts], dbuf[starts], key[starts]


def region_checksums(regions: KVRegions, plan: PairRuns, column: int, blocks: int) -> np.ndarray:
    """``[blocks]`` int64: per planned decode block, the checksum of the region the
    pair's runs write into it, reading ``regions``' buffers at the runs' ``column``
    (0: the writer's source; 1: the owner's landed bytes). A block the runs miss is 0."""
    runs = plan.runs
    buffers = plan.src_buffer if column == 0 else plan.dst_buffer
    sums = np.zeros(len(runs), dtype=np.int64)
    for i in np.unique(buffers):
        which = np.flatnonzero(buffers == i)
        sums[which] = run_checksums(
            regions.buffers[int(i)].tensor, runs[which, column], runs[which, 2], plan.unit
        )
    order = (plan.dst_buffer << ORDER_SHIFT) | runs[:, 1]
    keys, values = combine_keyed(plan.block, order, runs[:, 2], sums, plan.unit)
    out = np.zeros(blocks, dtype=np.int64)
    out[keys] = values
    return out


def block_checksums(regions: KVRegions, blocks: Sequence[int]) -> np.ndarray:
    """``[len(blocks)]`` int64: each block's checksum, the function of
    :func:`kvferry.engine.integrity.page_checksums` over the block's bytes as
    :meth:`.layout.KVRegions.block_bytes_of` lays them out (every buffer's runs, in
    order), read in place: each run's checksum put together by its place in the block
    (:func:`kvferry.engine.run_checksum.combine_keyed`). A gather of the bytes costs a
    byte index as large as the load and runs at a few tens of MB/s; this reads them at
    memory speed. Where a run's length is not whole 16-bit words but the block's is (no
    vLLM layout: a K|V row is whole words), the runs cannot be put together and the
    bytes are gathered."""
    n = len(blocks)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    per_buffer = [b.block_runs(blocks).reshape(n, -1, 2) for b in regions.buffers]
    lengths = np.concatenate([r[:, :, 1] for r in per_buffer], axis=1)  # [n, runs]
    unit = 2 if regions.block_bytes % 2 == 0 else 1
    if bool((lengths % unit).any()):
        data = regions.block_bytes_of(blocks)
        return page_checksums(data, list(range(n))).cpu().numpy()
    sums = np.concatenate(
        [
            run_checksums(b.tensor, r[:, :, 0].reshape(-1), r[:, :, 1].reshape(-1), unit).reshape(
                n, -1
            )
            for b, r in zip(regions.buffers, per_buffer, strict=True)
        ],
        axis=1,
    )
    place = np.cumsum(lengths, axis=1) - lengths  # each run's byte offset in its block
    keys = np.repeat(np.arange(n, dtype=np.int64), lengths.shape[1])
    found, values = combine_keyed(
        keys, place.reshape(-1), lengths.reshape(-1), sums.reshape(-1), unit
    )
    out = np.zeros(n, dtype=np.int64)
    out[found] = values
    return out
