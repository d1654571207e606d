"""Decode steps across a group whose members each hold a share of the KV heads.

A model whose attention mixes heads (Llama: each layer's output projection reads every
head's attention) can decode over pages split by heads only if every layer's attention is
put together from all the members' shares before the layer goes on. The model's step is a
generator (:meth:`kvferry.engine.llama.LlamaModel.decode_layers`): at each layer it yields
a :class:`LayerQuery` (the new token's q, k and v, every head) and takes back the layer's
attention ``[batch, q_heads, head_dim]``. Each member computes the heads it holds over
its own pages with :func:`attend_held` (writing the new token's K/V there first), and
:func:`combine` joins the shares in head order. Where the members run and how the queries
travel is the caller's business; this module does no I/O.

Per-head attention does not depend on which other heads are computed beside it, so a step
put together this way gives the logits of one pool holding every head, bit for bit (the
tests check it against the torch reference and the streaming CPU path, and catch a
combine that puts two members' shares in the wrong order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import write_kv_tokens
from .kernels import paged_decode_attention
from .kernels.ownership import PageOwnership


@dataclass(frozen=True)
class LayerQuery:
    """One layer of one decode step, every head: ``q`` ``[batch, q_heads, head_dim]``,
    ``k`` and ``v`` ``[batch, kv_heads, head_dim]`` (the step's new token; q and k rotated)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class HeldHeads:
    """The KV heads ``[lo, hi)`` a member holds, of a model with ``group`` query heads per
    KV head (its query heads are ``[lo * group, hi * group)``)."""

    lo: int
    hi: int
    group: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi or self.group < 1:
            raise ValueError(f"held heads [{self.lo}, {self.hi}) x group {self.group}")

    @property
    def q_range(self) -> tuple[int, int]:
        return self.lo * self.group, self.hi * self.group

    def share(self, query: LayerQuery) -> LayerQuery:
        """The part of ``query`` this member computes."""
        qlo, qhi = self.q_range
        return LayerQuery(
            query.layer,
            query.q[:, qlo:qhi],
            query.k[:, self.lo : self.hi],
            query.v[:, self.lo : self.hi],
        )


def attend_held(
    kv: torch.Tensor,
    share: LayerQuery,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    ownership: PageOwnership | None = None,
) -> torch.Tensor:
    """A member's share of one layer: write the new token's K/V (``share.k``, ``share.v``,
    the member's heads) at ``positions`` ``[batch]`` in the pages of ``page_table``
    ``[batch, width]``, then attend ``share.q`` over positions ``0 .. position``.
    ``kv``: the member's pool ``[pages, layers, 2, held kv heads, page_size, head_dim]``.
    Returns ``[batch, held q heads, head_dim]``. ``ownership``: checked as the pages are
    read (the caller reads its flags after)."""
    table = page_table.to(kv.device)
    page_size = kv.shape[4]
    at = positions.to(device=kv.device, dtype=torch.int64)
    pages = table.gather(1, (at // page_size)[:, None]).squeeze(1)
    write_kv_tokens(
        kv, share.layer, share.k.to(kv.device), share.v.to(kv.device), pages, at % page_size
    )
    return paged_decode_attention(
        share.q.to(kv.device), kv, share.layer, table, (at + 1).to(torch.int32), ownership=ownership
    )


def combine(shares: Sequence[tuple[HeldHeads, torch.Tensor]], kv_heads: int) -> torch.Tensor:
    """The layer's attention ``[batch, q_heads, head_dim]`` from the members' shares
    (each ``[batch, held q heads, head_dim]``, as :func:`attend_held` returns it); a head
    held by several members is taken from the first that holds it. Raises ValueError
    when some head is held by none, with the heads missing."""
    if not shares:
        raise ValueError("no member's share to combine")
    group = shares[0][0].group
    first = shares[0][1]
    batch, _, head_dim = first.shape
    out = first.new_empty(batch, kv_heads * group, head_dim)
    taken = [False] * kv_heads
    for held, got in shares:
        if got.shape != (batch, (held.hi - held.lo) * group, head_dim):
            raise ValueError(
                f"a share of heads [{held.lo}, {held.hi}) is {tuple(got.shape)}, not "
                f"{(batch, (held.hi - held.lo) * group, head_dim)}"
            )
        for h in range(held.lo, held.hi):
            if h < kv_heads and not taken[h]:
                taken[h] = True
                at = (h - held.lo) * group
                out[:, h * group : (h + 1) * group] = got[:, at : at + group]
    missing = [h for h, t in enumerate(taken) if not t]
    if missing:
        raise ValueError(f"KV heads {missing} of {kv_heads} are held by no member")
    return out
