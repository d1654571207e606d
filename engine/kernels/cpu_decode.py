"""Paged decode attention for long contexts on CPU pools: the reference's function, streamed.

The reference (:func:`kvferry.engine.attention.paged_decode_attention`) gathers a
sequence's whole context into one fresh fp32 tensor before the softmax. At a million
tokens that tensor is hundreds of MB, and first-touching it costs several times the
copy itself. Here each sequence's pages go through one reusable buffer, a cache-sized chunk of
pages at a time, with an online softmax (running max, running sum, rescaled
accumulator), so the working set stays in cache and the pool is read once.

Shapes are the reference's: ``q`` ``[batch, q_heads, head_dim]``, ``kv``
``[pages, layers, 2, kv_heads, page_size, head_dim]`` (each page dense as it is indexed,
HND, or dense token-major: a view of NHD storage, see :class:`~kvferry.engine.pool.KVPool`;
pages are gathered as stored and put in position order in cache), ``page_table`` ``[batch, width]``,
``seq_lens`` ``[batch]``; returns ``[batch, q_heads, head_dim]`` in ``q.dtype``.
Accumulation is fp32; the result differs from the reference's by fp32 rounding only
(the sums are taken in another order).
"""

from __future__ import annotations

import math

import torch

CHUNK_BYTES = 2 << 20
"""The pages of one chunk, as stored: small enough that the chunk and its fp32 copy in
position order stay in cache (at the serve shape, 8 KB per page and layer, 256 pages;
4x that streams about 1.5x slower here, a quarter of it pays the per-chunk calls)."""

STREAM_FROM_TOKENS = 16384
"""Below this context the reference's one gather is as fast and the batch stays one call."""


def _stored(kv: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``kv`` as its pages lie in memory, ``[pages, layers, 2, a, b, head_dim]`` with each
    page dense, and whether it is token-major (``a`` the slots); None for any other
    strides."""
    if kv[0].is_contiguous():
        return kv, False
    nhd = kv.transpose(3, 4)
    if nhd[0].is_contiguous() and nhd.stride(0) == nhd[0].numel():
        return nhd, True
    return None


def wants_streaming(kv: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """True when a call on ``kv`` with ``seq_lens`` is worth streaming (CPU, a long context)."""
    return (
        not kv.is_cuda
        and seq_lens.numel() > 0
        and int(seq_lens.max()) >= STREAM_FROM_TOKENS
        and _stored(kv) is not None
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    chunk_pages: int | None = None,
) -> torch.Tensor:
    """The reference's result, one sequence at a time, ``chunk_pages`` pages per pass
    (default: as many as fit :data:`CHUNK_BYTES`)."""
    from ..attention import _check_shapes

    _check_shapes(q, kv, layer, page_table, seq_lens)
    batch, q_heads, head_dim = q.shape
    num_pages, layers, _, kv_heads, page_size, _ = kv.shape
    group = q_heads // kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    per_layer = 2 * kv_heads * page_size * head_dim
    if chunk_pages is None:
        chunk_pages = max(1, CHUNK_BYTES // (per_layer * kv.element_size()))
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    stored = _stored(kv)
    if stored is None:
        raise ValueError(f"kv of strides {kv.stride()}: each page must be dense, HND or NHD")
    pages_as_stored, token_major = stored
    rows = pages_as_stored.view(num_pages, layers, per_layer)[:, layer]  # [pages, row], strided
    lens = [int(n) for n in seq_lens.tolist()]
    width = page_table.shape[1]
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float32)
    longest = max(-(-n // page_size) for n in lens) if lens else 0
    chunk_pages = max(1, min(chunk_pages, longest))
    gathered = torch.empty(chunk_pages, per_layer, dtype=kv.dtype)  # pages as stored
    # [2, H, chunk tokens, D] fp32: the chunk's keys and values, positions in order
    ordered = torch.empty(2, kv_heads, chunk_pages * page_size, head_dim, dtype=torch.float32)
    qf = q.float().view(batch, kv_heads, group, head_dim) * scale
    for b, seq_len in enumerate(lens):
        if seq_len <= 0:
            continue
        n_pages = -(-seq_len // page_size)
        if n_pages > width:
            raise ValueError(f"seq_len {seq_len} needs {n_pages} pages, page table has {width}")
        table = page_table[b, :n_pages].to(torch.int64)
        if bool(((table < 0) | (table >= num_pages)).any()):
            raise IndexError(f"page table names a page outside [0, {num_pages})")
        running_max = torch.full((kv_heads, group, 1), float("-inf"))
        running_sum = torch.zeros(kv_heads, group, 1)
        acc = out[b]  # [H, G, D]
        for first in range(0, n_pages, chunk_pages):
            idx = table[first : first + chunk_pages]
            n = idx.numel()
            chunk = torch.index_select(rows, 0, idx, out=gathered[:n])
            kv_t = ordered[:, :, : n * page_size].view(2, kv_heads, n, page_size, head_dim)
            if token_major:
                page = chunk.view(n, 2, page_size, kv_heads, head_dim).permute(1, 3, 0, 2, 4)
            else:
                page = chunk.view(n, 2, kv_heads, page_size, head_dim).permute(1, 2, 0, 3, 4)
            kv_t.copy_(page)
            tokens = min(n * page_size, seq_len - first * page_size)
            keys = ordered[0, :, :tokens]  # stale slots past the sequence never enter
            values = ordered[1, :, :tokens]
            scores = torch.bmm(qf[b], keys.transpose(1, 2))  # [H, G, tokens]
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
            rescale = _rescale(running_max, new_max)
            weights = torch.exp(scores - new_max)
            running_sum = running_sum * rescale + weights.sum(dim=-1, keepdim=True)
            acc.copy_(torch.baddbmm(acc * rescale, weights, values))
            running_max = new_max
        acc.div_(running_sum)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _rescale(old_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """What the sums so far are worth once the running max moves to ``new_max``."""
    return torch.exp(old_max - new_max)
