"""Paged decode attention in Triton: split-KV over the sequence, a combine kernel, and the
page ownership check at the read.

Same semantics as :func:`kvferry.engine.attention.paged_decode_attention`: pool
``[pages, layers, 2, kv_heads, page_size, head_dim]`` (any strides, head_dim contiguous;
read in place, never copied), page table ``[batch, width]`` int32, ``seq_lens`` ``[batch]``,
q ``[batch, q_heads, head_dim]``; returns ``[batch, q_heads, head_dim]`` in q.dtype, zeros
for an empty sequence. GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.

Work split: program ``(b, kv_head, split)`` attends the query heads of one KV head over one
slice of ``split_len`` positions (a multiple of ``block_n``, the tokens per step, which is
itself a multiple of the page size, so a step never straddles a split and starts on a page
boundary), in blocks of ``block_n`` positions gathered through the page table (``block_n``,
warps, stages and the split heuristic are a :class:`~.tuning.DecodeTuning`). With one
split the program writes the output; with several it writes an unnormalised partial
(acc, running max, running sum) and :func:`_combine_kernel` merges the splits that hold
positions. Page size (a power of two: shift and mask) and split count are runtime
arguments, so one compiled variant per dtype, head dim and check serves every page size,
split or not (``num_splits`` is kept out of the JIT's equal-to-1 specialisation). Scores,
softmax and the weighted sum are fp32; on the GPU the two dots take 16-bit operands
(tensor cores, fp32 accumulation; the probabilities are rounded to the pool dtype for
the second dot, as flash attention does). Under Triton's interpreter, whose
bf16 arithmetic is wrong, and for fp32 pools, every operand is fp32 (``UPCAST``).

Page offsets are int64 (``page * page_stride`` passes 2^31 elements in large pools), page
ids are clamped into ``[0, num_pages)`` so a corrupt table never reads outside the pool,
and with ``CHECK`` each page's canary is compared with the sequence's expectation (see
:mod:`.ownership`): in one pass over the program's pages before its attention loop (a
chunk of page ids, canary rows and generations loaded at once), or inside the loop at
each page's first row (``check_placement="tiles"``). The check only adds loads and a
predicated atomic per program, never touches the arithmetic, so a clean run is
bit-identical with it on and off.

The grid and split count depend only on shapes (``width``, never ``seq_lens``' values), so
a launch needs no host sync.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .ownership import (
    BEYOND_TABLE,
    FOREIGN_REQUEST,
    OUT_OF_POOL,
    STALE_GENERATION,
    WRONG_INDEX,
    PageOwnership,
)
from .tuning import DEFAULT, DecodeTuning

COMBINE_BLOCK = 16  # splits merged per step of the combine kernel
LOG2E = 1.4426950408889634
PAGE_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
# the kinds as constexpr globals, so the kernel may read them
_FOREIGN = tl.constexpr(FOREIGN_REQUEST)
_STALE = tl.constexpr(STALE_GENERATION)
_INDEX = tl.constexpr(WRONG_INDEX)
_OOP = tl.constexpr(OUT_OF_POOL)
_BEYOND = tl.constexpr(BEYOND_TABLE)
_NONE = tl.constexpr(2147483647)
# Pages checked per step of the check's pass (the default placement, "pages").
CHECK_PAGES = tl.constexpr(256)
CHECK_PLACEMENTS = ("pages", "tiles")
# The compiled kernel of each kind's latest launch (registers, spills).
LAUNCHED: dict[str, Any] = {}
_TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _page_kinds(canary_ptr, gen_row, page, safe, col, ok, want_rid, num_pages):
    """The ownership kinds of pages ``page`` (clamped: ``safe``) at logical columns ``col``
    where ``ok``: the canary row's request id, generation and index against what the
    sequence expects, and the page id against the pool (0 where not ``ok``)."""
    crow = canary_ptr + safe.to(tl.int64) * 3
    c_rid = tl.load(crow, mask=ok, other=0)
    c_gen = tl.load(crow + 1, mask=ok, other=0)
    c_idx = tl.load(crow + 2, mask=ok, other=0)
    w_gen = tl.load(gen_row + col, mask=ok, other=0)
    kind = tl.where(c_rid != want_rid, _FOREIGN, 0)
    kind = kind | tl.where(c_gen != w_gen, _STALE, 0)
    kind = kind | tl.where(c_idx != col.to(tl.int64), _INDEX, 0)
    kind = tl.where((page < 0) | (page >= num_pages), _OOP, kind)
    return tl.where(ok, kind, 0)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    k_ptr,
    v_ptr,
    stride_page,
    stride_head,
    stride_slot,
    table_ptr,
    stride_tb,
    seq_ptr,
    num_pages,
    width,
    page_shift,
    out_ptr,
    stride_ob,
    stride_oh,
    part_ptr,
    ml_ptr,
    num_splits,
    split_len,
    canary_ptr,
    rid_ptr,
    gen_ptr,
    stride_gb,
    err_ptr,
    first_ptr,
    qk_scale,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    CHECK: tl.constexpr,
    UPCAST: tl.constexpr,
    CHECK_TILES: tl.constexpr = False,
):
    """q ``[B, QH, D]``; k/v ``[pages, kv_heads, page_size, D]`` views of one layer
    (``page_size = 1 << page_shift``); table ``[B, width]`` int32; with one split, out
    ``[B, QH, D]``; with several, part ``[B, QH, S, D]`` fp32 and ml ``[B, QH, S, 2]`` fp32
    (running max in log2 units, running sum). The page size and the split count are
    runtime values (shift and mask; one branch at the end), so one compiled variant serves
    every page size and both modes."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK)
    g_ok = g < GROUP
    heads = kvh * GROUP + g

    seq_len = tl.load(seq_ptr + b).to(tl.int32)
    seq_len = tl.maximum(seq_len, 0)
    page_mask = (1 << page_shift) - 1
    max_tokens = width << page_shift
    seq_eff = tl.minimum(seq_len, max_tokens)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_eff)

    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    bad_bits = tl.zeros([BLOCK], dtype=tl.int32)
    bad_first = tl.full([BLOCK], _NONE, dtype=tl.int32)
    page_bits = tl.zeros([CHECK_PAGES], dtype=tl.int32)
    page_first = tl.full([CHECK_PAGES], _NONE, dtype=tl.int32)
    head_off = kvh.to(tl.int64) * stride_head
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    if CHECK:
        want_rid = tl.load(rid_ptr + b)
        if not CHECK_TILES:
            # One pass over the slice's pages before the attention: every page id, canary
            # row and expected generation of a chunk is loaded at once, so the check costs
            # two memory round trips per CHECK_PAGES pages instead of sitting in the loop.
            # A page that straddles two splits is checked by both (same answer).
            c = tl.arange(0, CHECK_PAGES)
            first_col = start >> page_shift
            end_col = (end + page_mask) >> page_shift  # one past the last page read
            gen_row = gen_ptr + b.to(tl.int64) * stride_gb
            for c0 in range(first_col, end_col, CHECK_PAGES):
                col = c0 + c
                ok = col < end_col
                page = tl.load(table_row + col, mask=ok, other=0)
                safe = tl.minimum(tl.maximum(page, 0), num_pages - 1)
                kind = _page_kinds(canary_ptr, gen_row, page, safe, col, ok, want_rid, num_pages)
                page_bits = page_bits | kind
                page_first = tl.minimum(page_first, tl.where(kind != 0, col, _NONE))

    for n0 in range(start, end, BLOCK):
        t = n0 + n
        valid = t < end
        col = t >> page_shift
        page = tl.load(table_row + col, mask=valid, other=0)
        safe = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        if CHECK and CHECK_TILES:
            head_row = valid & ((t & page_mask) == 0)
            kind = _page_kinds(
                canary_ptr,
                gen_ptr + b.to(tl.int64) * stride_gb,
                page,
                safe,
                col,
                head_row,
                want_rid,
                num_pages,
            )
            bad_bits = bad_bits | kind
            bad_first = tl.minimum(bad_first, tl.where(kind != 0, col, _NONE))
        row = (
            safe.to(tl.int64) * stride_page + head_off + (t & page_mask).to(tl.int64) * stride_slot
        )
        offs = row[:, None] + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if CHECK:
        bits = tl.reduce_or(bad_bits, axis=0) | tl.reduce_or(page_bits, axis=0)
        first = tl.minimum(tl.min(bad_first, axis=0), tl.min(page_first, axis=0))
        if split == 0:
            if seq_len > max_tokens:
                bits = bits | _BEYOND
                first = tl.minimum(first, width)
        if bits != 0:
            tl.atomic_or(err_ptr + b, bits)
            tl.atomic_min(first_ptr + b, first)

    if num_splits == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        if start < seq_eff:
            slot = (
                b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads
            ) * num_splits + split  # [G_PAD] row of part/ml
            tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + slot * 2, m_i, mask=g_ok)
            tl.store(ml_ptr + slot * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    ml_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    seq_ptr,
    num_splits,
    split_len,
    max_tokens,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Merge the splits of one ``(b, q_head)``: part ``[B, QH, S, D]``, ml ``[B, QH, S, 2]``
    fp32 -> out ``[B, QH, D]``. Only splits that hold positions are read."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, SPLITS)
    seq_len = tl.load(seq_ptr + b).to(tl.int32)
    seq_eff = tl.minimum(tl.maximum(seq_len, 0), max_tokens)
    used = (seq_eff + split_len - 1) // split_len
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    m_all = tl.full([SPLITS], float("-inf"), dtype=tl.float32)
    for s0 in range(0, used, SPLITS):
        ok = (s0 + s) < used
        m_all = tl.maximum(
            m_all, tl.load(ml_ptr + (base + s0 + s) * 2, mask=ok, other=float("-inf"))
        )
    m_max = tl.max(m_all, axis=0)
    l_sum = tl.zeros([SPLITS], dtype=tl.float32)
    acc = tl.zeros([SPLITS, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, used, SPLITS):
        ok = (s0 + s) < used
        m = tl.load(ml_ptr + (base + s0 + s) * 2, mask=ok, other=float("-inf"))
        l_part = tl.load(ml_ptr + (base + s0 + s) * 2 + 1, mask=ok, other=0.0)
        w = tl.where(ok, tl.exp2(m - m_max), 0.0)
        part = tl.load(
            part_ptr + (base + s0 + s)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0
        )
        l_sum += w * l_part
        acc += w[:, None] * part
    total = tl.sum(l_sum, axis=0)
    o = tl.sum(acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty)
    )


def interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (CPU tensors)."""
    return isinstance(_decode_split_kernel, InterpretedFunction)


def group_pad(group: int) -> int:
    """Rows of the query tile: the GQA group padded to a power of two, at least 16 (MMA)."""
    return max(16, int(triton.next_power_of_2(group)))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def choose_splits(
    batch: int,
    kv_heads: int,
    max_tokens: int,
    device: torch.device,
    tuning: DecodeTuning = DEFAULT,
) -> int:
    """Splits of the sequence by ``tuning``'s heuristic (:meth:`DecodeTuning.splits`) for
    this device's SM count (an H200's 132 off the GPU)."""
    sms = (
        _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 132
    )
    return tuning.splits(batch, kv_heads, max_tokens, sms)


def supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel handles these shapes and dtypes (the dispatcher falls back to the
    reference otherwise): page size 16/32/64, head dim 64/128, fp16/bf16/fp32, head dim
    contiguous, q heads a multiple of kv heads with a group of at most 16 padded rows."""
    return (
        kv.dim() == 6
        and kv.shape[4] in PAGE_SIZES
        and kv.shape[5] in HEAD_DIMS
        and kv.dtype in _TORCH_TO_TL
        and q.dtype in _TORCH_TO_TL
        and kv.stride(5) == 1
        and q.dim() == 3
        and q.shape[1] % kv.shape[3] == 0
        and q.shape[1] // kv.shape[3] <= 16
    )


def _check(
    q: torch.Tensor, kv: torch.Tensor, layer: int, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(
            f"kv must be [pages, layers, 2, kv_heads, page_size, head_dim], got {tuple(kv.shape)}"
        )
    if q.dim() != 3 or q.shape[2] != kv.shape[5] or q.shape[1] % kv.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit pool {tuple(kv.shape)}")
    if not 0 <= layer < kv.shape[1]:
        raise ValueError(f"layer {layer} outside [0, {kv.shape[1]})")
    if (
        page_table.dim() != 2
        or page_table.shape[0] != q.shape[0]
        or seq_lens.shape != (q.shape[0],)
    ):
        raise ValueError(
            f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} "
            f"do not match batch {q.shape[0]}"
        )
    if kv.dtype not in _TORCH_TO_TL or q.dtype not in _TORCH_TO_TL:
        raise TypeError(f"unsupported dtypes q {q.dtype}, kv {kv.dtype}")
    if kv.shape[4] not in PAGE_SIZES or kv.shape[5] not in HEAD_DIMS:
        raise ValueError(
            f"page size {kv.shape[4]} / head dim {kv.shape[5]} not in {PAGE_SIZES} / {HEAD_DIMS}"
        )
    if kv.stride(5) != 1:
        raise ValueError("the pool's head_dim must be contiguous")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32, got {page_table.dtype}")


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    ownership: PageOwnership | None = None,
    num_splits: int | None = None,
    tuning: DecodeTuning = DEFAULT,
    out: torch.Tensor | None = None,
    check_placement: str = "pages",
) -> torch.Tensor:
    """Triton paged decode attention; see the module doc. ``ownership`` turns the page check
    on; ``num_splits`` overrides ``tuning``'s split heuristic (1: no combine kernel);
    ``tuning`` sets the tile, warps and stages (:mod:`.tuning`); ``out`` is an optional
    ``[batch, q_heads, head_dim]`` q.dtype output. ``check_placement``: ``"pages"`` checks
    a program's pages in one pass before its attention loop, ``"tiles"`` inside the loop
    at each page's first row (kernel v1; kept to time the two against each other)."""
    _check(q, kv, layer, page_table, seq_lens)
    if check_placement not in CHECK_PLACEMENTS:
        raise ValueError(f"check_placement {check_placement!r} not in {CHECK_PLACEMENTS}")
    batch, q_heads, head_dim = q.shape
    num_pages, _, _, kv_heads, page_size, _ = kv.shape
    group = q_heads // kv_heads
    width = page_table.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()  # [batch, q_heads, head_dim]: tiny beside the pool
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    seq_lens = seq_lens.to(device=kv.device, dtype=torch.int32)
    max_tokens = width * page_size
    if num_splits is None:
        num_splits = choose_splits(batch, kv_heads, max_tokens, kv.device, tuning)
    block_n = tuning.block_n
    split_len = -(-max(max_tokens, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = max(1, -(-max_tokens // split_len))
    pool = kv.select(1, layer)  # [pages, 2, kv_heads, page_size, head_dim], a view
    k, v = pool.select(1, 0), pool.select(1, 1)
    if num_splits == 1:
        part = ml = torch.empty(1, dtype=torch.float32, device=kv.device)  # unused
    else:
        part = torch.empty(
            batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=kv.device
        )
        ml = torch.empty(batch, q_heads, num_splits, 2, dtype=torch.float32, device=kv.device)
    if ownership is not None:
        ownership.check_inputs(batch, width)
        if ownership.canaries.shape[0] != num_pages or not ownership.canaries.is_contiguous():
            raise ValueError(f"canaries must be a contiguous [{num_pages}, 3] int64 table")
        gens = ownership.generations
        if gens.stride(1) != 1:
            raise ValueError("generations must have contiguous rows")
        check = (
            ownership.canaries,
            ownership.request_ids,
            gens,
            gens.stride(0),
            ownership.errors,
            ownership.first_bad,
        )
    else:
        check = (page_table, page_table, page_table, 0, seq_lens, seq_lens)  # unused
    upcast = interpreted() or kv.dtype == torch.float32
    LAUNCHED["decode"] = _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        v,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        page_table,
        page_table.stride(0),
        seq_lens,
        num_pages,
        width,
        page_size.bit_length() - 1,
        out,
        out.stride(0),
        out.stride(1),
        part,
        ml,
        num_splits,
        split_len,
        *check,
        scale * LOG2E,
        GROUP=group,
        G_PAD=group_pad(group),
        HEAD_DIM=head_dim,
        BLOCK=block_n,
        CHECK=ownership is not None,
        UPCAST=upcast,
        CHECK_TILES=check_placement == "tiles",
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )
    if num_splits > 1:
        LAUNCHED["combine"] = _combine_kernel[(batch, q_heads)](
            part,
            ml,
            out,
            out.stride(0),
            out.stride(1),
            seq_lens,
            num_splits,
            split_len,
            max_tokens,
            HEAD_DIM=head_dim,
            SPLITS=COMBINE_BLOCK,
            num_warps=4,
        )
    return out
