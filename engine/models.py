"""What the engine needs from a model, and the two models it ships.

A model writes a prompt's K/V into pool pages (``prefill``, or ``prefill_layers``, which
yields after each layer so that a caller can stop between layers) and returns the first
answer token, which a prefill computes anyway (the last position's output); it produces
the next tokens from pages alone (``decode_step``). Decode convention, shared by both
models: a step takes, per sequence, an input ``token`` at ``position``; it (re)writes that
token's K/V at ``position`` and attends over positions ``0 .. position``. Decode starting
from pages that another rank wrote therefore needs only: the page table, the prompt
length, and the prefill's first token (the input at position ``prompt_len``). Without
that token, a step at ``prompt_len - 1`` with the last prompt token (whose K/V the
prefill already wrote; the step rewrites it with the same values) reads the first token
from the pages instead, at the cost of a step over the whole prompt.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol, runtime_checkable

import torch

from .kernels.ownership import PageOwnership
from .llama import LlamaConfig, LlamaModel
from .pool import PoolConfig
from .replay import ReplayConfig, ReplayModel


@runtime_checkable
class PagedModel(Protocol):
    layers: int
    # tokens of a piece ``prefill_layers`` writes through every layer before the next
    # (None: it writes each layer whole, for every token); a writer pipelines the pages
    # each piece makes final
    prefill_chunk_tokens: int | None
    kv_heads: int
    head_dim: int
    stop_token: int | None
    # a layer's output reads every head's attention (Llama): members of a decode group that
    # split the heads step together (engine.headgroup); False: each head answers alone
    attention_mixes_heads: bool

    def pool_config(
        self, page_size: int, num_pages: int, dtype: torch.dtype = ..., device: str = ...
    ) -> PoolConfig: ...

    def prefill(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> int: ...

    def prefill_layers(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> Generator[int | None, None, int]:
        """``prefill`` a step at a time: yields each layer's index once the layer is
        whole; a model that writes in pieces yields None after each layer of each piece
        but the last (see :mod:`.stepwise`). Returns the first answer token (greedy)."""

    def decode_step(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        prompt_lens: torch.Tensor,
        ownership: PageOwnership | None = None,
    ) -> torch.Tensor:
        """One greedy token per sequence. With ``ownership`` the attention checks every
        page it reads (in the kernel on CUDA) and only sets its flags: the caller reads
        them after the step and drops the tokens of flagged sequences."""
        ...


__all__ = ["LlamaConfig", "LlamaModel", "PagedModel", "ReplayConfig", "ReplayModel"]
