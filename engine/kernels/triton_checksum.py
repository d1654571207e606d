"""Page checksums in Triton, equal to :func:`kvferry.engine.integrity.page_checksums_reference`.

Each page's bytes are 32-bit words ``w_i`` (bytes when the page's byte count is not a
multiple of 4); ``s1 = sum w_i mod P``, ``s2 = sum (i+1) w_i mod P`` with ``P = 2^31 - 1``,
packed ``s1 * 2^31 + s2``. Integer arithmetic only, so any reduction order gives the
reference's value exactly. Reductions mod the Mersenne prime fold with shifts and masks
(``x mod P`` from ``(x & P) + (x >> 31)``), never a 64-bit division.

Grid ``(pages, chunks)``: program ``(p, c)`` reduces words ``[c*CHUNK, (c+1)*CHUNK)`` of
page ``pages[p]`` in steps of ``BLOCK`` words into two partial sums below P; the partials
are added (and folded) on the host side with torch. Each page must be contiguous inside
(``kv[page]`` dense); pages may sit at any stride. Words that are not 4-byte aligned (a
page stride or pool offset not a multiple of 4 bytes) are loaded byte by byte and put
together little-endian, so they still checksum as words, as the reference does.

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
):
    """words ``[pool pages, words_per_page]`` (int32 words or uint8 bytes; with COMPOSE
    uint8 bytes read four at a time as little-endian words), pages ``[n]`` int64, part
    ``[n, chunks, 2]`` int64 partial (s1, s2), each below P."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    page = tl.load(pages_ptr + p)
    base = words_ptr + page * stride_page
    i0 = c * (BLOCK * STEPS)
    offs = tl.arange(0, BLOCK)
    # Per lane, over the steps s = 0..STEPS-1: run = sum w_s and tri = sum (STEPS - s) w_s
    # (the running sum added up once a step), so that sum s * w_s = STEPS * run - tri. Two
    # integer adds a word; the positions' weights and the folds mod P come once, after
    # the loop. Bounds: w < 2^32, run < 2^(32+log2 STEPS), tri < 2^(32+2 log2 STEPS).
    run = tl.zeros([BLOCK], dtype=tl.int64)
    tri = tl.zeros([BLOCK], dtype=tl.int64)
    for step in range(STEPS):
        i = i0 + step * BLOCK + offs
        ok = i < words_per_page
        if COMPOSE:
            at = base + i.to(tl.int64) * 4
            w = tl.load(at, mask=ok, other=0).to(tl.int64) & 255
            w |= (tl.load(at + 1, mask=ok, other=0).to(tl.int64) & 255) << 8
            w |= (tl.load(at + 2, mask=ok, other=0).to(tl.int64) & 255) << 16
            w |= (tl.load(at + 3, mask=ok, other=0).to(tl.int64) & 255) << 24
        else:
            w = tl.load(base + i, mask=ok, other=0).to(tl.int64)
            if BYTES:
                w = w & 255
            else:
                w = w & 4294967295
        run += w
        tri += run
    # Word (step s, lane l) sits at i = i0 + s * BLOCK + l and weighs i + 1:
    # s2 = sum_l (i0 + l + 1) * run_l + BLOCK * (STEPS * run_l - tri_l), all mod P.
    run_p = _fold(run)
    lane_w = _fold((i0 + offs + 1).to(tl.int64))
    shifted = _fold(_fold(run_p * STEPS) + (2147483647 - _fold(tri)))  # STEPS*run - tri mod P
    s2 = _fold(_fold(lane_w * run_p) + _fold(shifted * BLOCK))
    t1 = _fold(tl.sum(run_p, axis=0))
    t2 = _fold(tl.sum(s2, axis=0))
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
    as_words = page_bytes % 4 == 0
    # words that are not 4-byte aligned (an odd page stride or offset) load as bytes
    compose = as_words and (stride_bytes % 4 != 0 or kv.data_ptr() % 4 != 0)
    unit = 4 if as_words else 1
    flat = torch.as_strided(
        kv, (kv.shape[0], page.numel()), (kv.stride(0), 1)
    )  # [pool pages, elements], a view
    words = flat.view(torch.int32 if as_words and not compose else torch.uint8)  # a view
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
        num_warps=num_warps,
    )
    sums = part.sum(dim=1) % MODULUS  # [n, 2]: at most chunks values below P each
    return sums[:, 0] * (1 << 31) + sums[:, 1]
