"""Which implementation runs: the Triton kernels on CUDA tensors, the torch references
elsewhere, except checksums on CPU pools, which :func:`kvferry.engine.integrity.page_checksums`
runs natively (C, the same values; a GPU kernel does not help there).
``KVFERRY_KERNELS=torch`` forces the references everywhere (``triton`` forces the kernels,
e.g. under ``TRITON_INTERPRET=1`` on CPU tensors); for checksums ``torch`` means
:func:`~kvferry.engine.integrity.page_checksums_reference`. The kernels launch with
``KVFERRY_DECODE_TUNING`` when it is set (:func:`.tuning.active`), else the default tuning.

Long contexts on CPU pools stream through :mod:`.cpu_decode` (the reference's function,
a chunk of pages at a time; ``torch`` forces the one-gather reference there too).

Shapes the kernels do not take (page sizes other than 16/32/64, head dims other than
64/128, pages not dense inside) run the references on any device. Semantics are the
reference's (:func:`kvferry.engine.attention.paged_decode_attention`,
:func:`kvferry.engine.integrity.page_checksums`); with ``ownership`` the page check runs
(:mod:`.ownership`), and both paths then clamp out-of-pool page ids and flag them instead
of raising, as the kernel does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .. import attention as _reference
from .. import integrity as _integrity
from . import cpu_decode
from . import tuning as _tuning
from .ownership import PageOwnership, check_ownership_reference


def use_triton(tensor: torch.Tensor) -> bool:
    """True when calls on ``tensor`` go to the Triton kernels."""
    choice = os.environ.get("KVFERRY_KERNELS", "auto")
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    return tensor.is_cuda


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    ownership: PageOwnership | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context: q ``[batch, q_heads,
    head_dim]``, kv ``[pages, layers, 2, kv_heads, page_size, head_dim]``, page_table
    ``[batch, width]`` int32, seq_lens ``[batch]``; returns ``[batch, q_heads, head_dim]``
    in q.dtype. With ``ownership`` every page read is checked against it (outputs in
    ``ownership.errors`` / ``first_bad``; call ``raise_if_bad`` before using the result)."""
    if use_triton(kv) and _decode_supports(q, kv):
        from . import triton_decode

        table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
        return triton_decode.paged_decode_attention(
            q,
            kv,
            layer,
            table.to(kv.device),
            seq_lens.to(kv.device),
            scale,
            ownership=ownership,
            tuning=_tuning.active(),
        )
    attention = _reference.paged_decode_attention
    if os.environ.get("KVFERRY_KERNELS") != "torch" and cpu_decode.wants_streaming(kv, seq_lens):
        attention = cpu_decode.paged_decode_attention
    if ownership is None:
        return attention(q, kv, layer, page_table, seq_lens, scale)
    page_size, num_pages = kv.shape[4], kv.shape[0]
    check_ownership_reference(page_table, seq_lens, page_size, num_pages, ownership)
    width = page_table.shape[1]
    clamped = page_table.clamp(0, num_pages - 1)
    lens = seq_lens.clamp(0, width * page_size)
    return attention(q, kv, layer, clamped, lens, scale)


def _decode_supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Shapes the Triton kernel takes (page size 16/32/64, head dim 64/128, ...); others,
    such as the small test models' pools, run the reference on any device."""
    from . import triton_decode

    return triton_decode.supports(q, kv)


def page_checksums(kv: torch.Tensor, pages: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """One int64 checksum per listed page, ``[n]`` (the values of
    :func:`kvferry.engine.integrity.page_checksums_reference`): Triton on CUDA, native on
    CPU pools with dense pages, else the reference."""
    if use_triton(kv) and kv.dim() > 0 and kv.shape[0] > 0 and kv[0].is_contiguous():
        from . import triton_checksum

        return triton_checksum.page_checksums(kv, pages)
    if os.environ.get("KVFERRY_KERNELS") == "torch":
        return _integrity.page_checksums_reference(kv, pages)
    return _integrity.page_checksums(kv, pages)
