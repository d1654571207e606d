"""Page checksums in Triton, equal to :func:`kvferry.engine.integrity.page_checksums_reference`.

Each page's bytes are unsigned 16-bit words ``w_i`` (bytes when the page's byte count is
odd); ``s1 = sum w_i mod P``, ``s2 = sum (i+1) w_i mod P`` with ``P = 2^31 - 1``,
packed ``s1 * 2^31 + s2``. Integer arithmetic only, so any reduction order gives the
reference's value exactly. Reductions mod the Mersenne prime fold with shifts and masks
(``x mod P`` from ``(x & P) + (x >> 31)``), never a 64-bit division.

Grid ``(pages, chunks)``: program ``(p, c)`` reduces words ``[c*CHUNK, (c+1)*CHUNK)`` of
page ``pages[p]`` in steps of ``BLOCK`` words into two partial sums below P; the partials
are added (and folded) on the host side with torch. Each page must be contiguous inside
(``kv[page]`` dense); pages may sit at any stride. Where every page is whole 4-byte
aligned pairs of words, a lane loads a pair at once and keeps its two words' sum and its
high word's, from which the function follows (``s2 = 2 F - s1 + H``, F the position-
weighted sum over pairs): the loads and adds of 32-bit words, not twice as many of 16.
Words that are not 2-byte aligned (a page stride or pool offset that is odd) are loaded
byte by byte and put together little-endian, so they still checksum as words, as the
reference does.

The CPU counterpart is native (``transfer/native/kvf_checksum.c``, the same function in
C); tests/engine/test_checksum_impls.py holds all three to the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

MODULUS = (1 << 31) - 1
BLOCK = 1024  # words per step
CHUNK_STEPS = 16  # steps per program
NUM_WARPS = 4
MAX_INT32_STEPS = 128  # 2^17 * 128 * 129 / 2 < 2^31
LAUNCHED: dict[str, Any] = {}  # the compiled kernel of the latest launch (registers, spills)


@triton.jit
def _fold(x):
    """``x mod P`` for ``0 <= x < 2^62`` (int64), by two Mersenne folds and a subtract."""
    x = (x & 2147483647) + (x >> 31)
    x = (x & 2147483647) + (x >> 31)
    return tl.where(x >= 2147483647, x - 2147483647, x)


@triton.jit
def _checksum_kernel(
    words_ptr,
    stride_page,
    pages_ptr,
    part_ptr,
    words_per_page,
    chunks,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    BYTES: tl.constexpr,
    COMPOSE: tl.constexpr,
    PAIRS: tl.constexpr,
    ACC: tl.constexpr,
):
    """words ``[pool pages, words_per_page]``: with PAIRS, int32 words each holding two
    16-bit words (low, high: little-endian); else int16 words, or uint8 bytes (BYTES; with
    COMPOSE, uint8 bytes read two at a time as little-endian words). pages ``[n]`` int64,
    part ``[n, chunks, 2]`` int64 partial (s1, s2), each below P. ACC: the lanes' sums'
    type (int32 where they cannot overflow it)."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    page = tl.load(pages_ptr + p)
    base = words_ptr + page * stride_page
    i0 = c * (BLOCK * STEPS)
    offs = tl.arange(0, BLOCK)
    # Per lane, over the steps s = 0..STEPS-1: run = sum u_s and tri = sum (STEPS - s) u_s
    # (the running sum added up once a step), so that sum s * u_s = STEPS * run - tri. Two
    # integer adds a word; the positions' weights and the folds mod P come once, after
    # the loop. u is the word (below 2^16), or with PAIRS the sum of a pair's two words
    # (below 2^17), whose high words add up in high: s2 over the 16-bit words is then
    # 2 * F - s1 + high, F the position-weighted sum over the pairs.
    run = tl.zeros([BLOCK], dtype=ACC)
    tri = tl.zeros([BLOCK], dtype=ACC)
    high = tl.zeros([BLOCK], dtype=ACC)
    for step in range(STEPS):
        i = i0 + step * BLOCK + offs
        ok = i < words_per_page
        if COMPOSE:
            at = base + i.to(tl.int64) * 2
            w = tl.load(at, mask=ok, other=0).to(ACC) & 255
            w |= (tl.load(at + 1, mask=ok, other=0).to(ACC) & 255) << 8
        else:
            w = tl.load(base + i, mask=ok, other=0)
            if PAIRS:
                hi = (w >> 16) & 65535
                high += hi.to(ACC)
                w = ((w & 65535) + hi).to(ACC)
            elif BYTES:
                w = w.to(ACC) & 255
            else:
                w = w.to(ACC) & 65535
        run += w
        tri += run
    # Word (step s, lane l) sits at i = i0 + s * BLOCK + l and weighs i + 1:
    # F = sum_l (i0 + l + 1) * run_l + BLOCK * (STEPS * run_l - tri_l), all mod P.
    run_p = _fold(run.to(tl.int64))
    lane_w = _fold((i0 + offs + 1).to(tl.int64))
    shifted = _fold(_fold(run_p * STEPS) + (2147483647 - _fold(tri.to(tl.int64))))
    f = _fold(_fold(lane_w * run_p) + _fold(shifted * BLOCK))
    t1 = _fold(tl.sum(run_p, axis=0))
    t2 = _fold(tl.sum(f, axis=0))
    if PAIRS:  # 2 F - s1 + high, over this chunk's pairs
        t2 = _fold(
            _fold(2 * t2 + (2147483647 - t1)) + _fold(tl.sum(_fold(high.to(tl.int64)), axis=0))
        )
    out = part_ptr + (p.to(tl.int64) * chunks + c) * 2
    tl.store(out, t1)
    tl.store(out + 1, t2)


def page_checksums(
    kv: torch.Tensor,
    pages: torch.Tensor | Sequence[int],
    *,
    block: int = BLOCK,
    steps: int = CHUNK_STEPS,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """One int64 checksum per listed page, ``[n]`` on kv's device; kv ``[pages, ...]`` with
    each page dense inside. ``block`` (words a step, a power of two), ``steps`` (steps a
    program) and ``num_warps`` shape the launch only: any of them gives the same values."""
    pages = torch.as_tensor(pages, dtype=torch.int64, device=kv.device).reshape(-1)
    n = pages.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=kv.device)
    page = kv[0]
    if not page.is_contiguous():
        raise ValueError("each page must be contiguous inside to be checksummed in place")
    if bool(((pages < 0) | (pages >= kv.shape[0])).any()):
        raise IndexError(f"pages outside [0, {kv.shape[0]})")
    page_bytes = page.numel() * page.element_size()
    stride_bytes = kv.stride(0) * kv.element_size()
    as_words = page_bytes % 2 == 0
    # words that are not 2-byte aligned (an odd page stride or offset) load as bytes
    compose = as_words and (stride_bytes % 2 != 0 or kv.data_ptr() % 2 != 0)
    # pairs of words in one 32-bit load, where every page is whole aligned pairs
    pairs = page_bytes % 4 == 0 and stride_bytes % 4 == 0 and kv.data_ptr() % 4 == 0
    unit = 4 if pairs else 2 if as_words else 1
    flat = torch.as_strided(
        kv, (kv.shape[0], page.numel()), (kv.stride(0), 1)
    )  # [pool pages, elements], a view
    view = torch.int32 if pairs else torch.int16 if as_words and not compose else torch.uint8
    words = flat.view(view)  # a view
    per_page = page_bytes // unit
    chunks = -(-per_page // (block * steps))
    part = torch.empty(n, chunks, 2, dtype=torch.int64, device=kv.device)
    LAUNCHED["checksum"] = _checksum_kernel[(n, chunks)](
        words,
        words.stride(0),
        pages,
        part,
        per_page,
        chunks,
        BLOCK=block,
        STEPS=steps,
        BYTES=not as_words,
        COMPOSE=compose,
        PAIRS=pairs,
        # a lane's tri reaches STEPS^2 / 2 words of up to 2^17: int32 holds 128 steps
        ACC=tl.int32 if steps <= MAX_INT32_STEPS else tl.int64,
        num_warps=num_warps,
    )
    sums = part.sum(dim=1) % MODULUS  # [n, 2]: at most chunks values below P each
    return sums[:, 0] * (1 << 31) + sums[:, 1]
