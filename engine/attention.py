"""Paged attention, torch reference (CPU and CUDA): the decode read and the prefill write.

Shapes: ``kv`` is the pool, ``[pages, layers, 2, kv_heads, page_size, head_dim]``;
``page_table`` is ``[batch, max_pages]`` int32 (entries past a sequence's last page are
ignored, any value); ``seq_lens`` is ``[batch]`` int32, the number of positions each query
attends to (positions ``0 .. seq_len-1``, which live in page ``pos // page_size`` of the
row at slot ``pos % page_size``).

Decode reads KV only through the page table. Scores, softmax and the weighted sum are
accumulated in fp32 whatever the pool dtype; the result is cast to ``q.dtype``. This is
the reference the CUDA kernel is checked against; against dense fp32 attention over the
gathered KV its error is a few fp32 ulps of the output magnitude (tests use
``atol=rtol=2e-5`` for fp32 inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _check_shapes(
    q: torch.Tensor, kv: torch.Tensor, layer: int, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(
            f"kv must be [pages, layers, 2, kv_heads, page_size, head_dim], got {tuple(kv.shape)}"
        )
    if q.dim() != 3 or q.shape[2] != kv.shape[5]:
        raise ValueError(f"q must be [batch, q_heads, {kv.shape[5]}], got {tuple(q.shape)}")
    if q.shape[1] % kv.shape[3]:
        raise ValueError(f"q_heads {q.shape[1]} is not a multiple of kv_heads {kv.shape[3]}")
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


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q: ``[batch, q_heads, head_dim]``; returns ``[batch, q_heads, head_dim]`` in q.dtype.
    GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``.
    A sequence with ``seq_len == 0`` gets zeros."""
    _check_shapes(q, kv, layer, page_table, seq_lens)
    batch, q_heads, head_dim = q.shape
    kv_heads, page_size = kv.shape[3], kv.shape[4]
    group = q_heads // kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    seq_lens = seq_lens.to(device=kv.device, dtype=torch.int64)
    max_len = int(seq_lens.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    n_pages = -(-max_len // page_size)
    if n_pages > page_table.shape[1]:
        raise ValueError(
            f"seq_len {max_len} needs {n_pages} pages, page table has {page_table.shape[1]}"
        )
    table = page_table[:, :n_pages].to(device=kv.device, dtype=torch.int64)
    positions = torch.arange(n_pages * page_size, device=kv.device)
    valid = positions[None, :] < seq_lens[:, None]  # [batch, T]
    valid_pages = valid[:, ::page_size]
    table = torch.where(valid_pages, table, torch.zeros_like(table))  # never index with padding
    if bool(((table < 0) | (table >= kv.shape[0])).any()):
        raise IndexError(f"page table names a page outside [0, {kv.shape[0]})")
    gathered = kv[:, layer][table]  # [batch, n_pages, 2, kv_heads, page_size, head_dim]
    gathered = gathered.permute(2, 0, 3, 1, 4, 5).reshape(
        2, batch, kv_heads, n_pages * page_size, head_dim
    )
    keys = gathered[0].float()
    values = (
        gathered[1].float().masked_fill(~valid[:, None, :, None], 0.0)
    )  # stale slots may hold NaN
    qf = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bktd->bkgt", qf, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,bktd->bkgd", weights, values)
    out = out.masked_fill(
        (seq_lens == 0)[:, None, None, None], 0.0
    )  # empty rows: softmax of nothing
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def write_kv_pages(
    kv: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    page_table_row: torch.Tensor | Sequence[int],
    start_pos: int,
    head_lo: int = 0,
) -> None:
    """Prefill write: K/V of positions ``start_pos .. start_pos+T-1`` of one sequence.

    k, v: ``[T, heads, head_dim]`` for KV heads ``[head_lo, head_lo+heads)`` (a TP shard
    writes only its heads). Values are cast to the pool dtype."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, heads, head_dim]"
        )
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    if head_dim != kv.shape[5] or not 0 <= head_lo < head_lo + heads <= kv.shape[3]:
        raise ValueError(
            f"heads [{head_lo}, {head_lo + heads}) x dim {head_dim} "
            f"do not fit pool {tuple(kv.shape)}"
        )
    page_size = kv.shape[4]
    row = torch.as_tensor(page_table_row, dtype=torch.int64, device=kv.device)
    positions = torch.arange(start_pos, start_pos + tokens, device=kv.device)
    last_page = (start_pos + tokens - 1) // page_size
    if start_pos < 0 or last_page >= row.numel():
        raise ValueError(
            f"positions [{start_pos}, {start_pos + tokens}) need {last_page + 1} pages, "
            f"row has {row.numel()}"
        )
    pages = row[positions // page_size]
    slots = positions % page_size
    kv[pages, layer, 0, head_lo : head_lo + heads, slots] = k.to(kv.dtype)
    kv[pages, layer, 1, head_lo : head_lo + heads, slots] = v.to(kv.dtype)


def write_kv_tokens(
    kv: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Decode write: one position per sequence. k, v: ``[batch, kv_heads, head_dim]``;
    pages, slots: ``[batch]`` (page id and slot inside it of each sequence's position)."""
    pages = pages.to(device=kv.device, dtype=torch.int64)
    slots = slots.to(device=kv.device, dtype=torch.int64)
    kv[pages, layer, 0, :, slots] = k.to(kv.dtype)
    kv[pages, layer, 1, :, slots] = v.to(kv.dtype)


def gather_kv(
    kv: torch.Tensor, layer: int, page_table_row: torch.Tensor | list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(K, V)``, each ``[seq_len, kv_heads, head_dim]``, of one sequence (for checks)."""
    page_size = kv.shape[4]
    row = torch.as_tensor(page_table_row, dtype=torch.int64, device=kv.device)
    positions = torch.arange(seq_len, device=kv.device)
    pages = row[positions // page_size]
    slots = positions % page_size
    return kv[pages, layer, 0, :, slots], kv[pages, layer, 1, :, slots]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """fp32 reference for one query against dense K/V: q ``[q_heads, d]``,
    k/v ``[T, kv_heads, d]``."""
    q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    kf = k.float().repeat_interleave(q_heads // kv_heads, dim=1)  # [T, q_heads, d]
    vf = v.float().repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.einsum("hd,thd->ht", q.float(), kf) * scale
    return torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), vf)
