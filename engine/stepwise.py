"""A prefill that yields after each step, so that its caller can stop it between steps
(an abort) or poll between them, and the one-call ``prefill`` the models build on it.

``prefill_layers`` yields a layer's index once that layer's KV is in the pages. A model
that writes in pieces (``prefill_chunk_tokens``: chunks of a long prompt's tokens) cuts
them as :func:`chunk_bounds` does and writes each piece through every layer before the
next, as an engine's chunked prefill does, yielding None after each layer of each piece
but the last, then each layer's index as the last piece is written in it. A writer that
pipelines counts a piece's pages final once its last layer is written: the pages of a
multi-layer model's prompt become final all through its prefill, not in its last layer."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

TAIL_DIVISOR = 16  # a prompt's last chunk is halved down to a piece this many times smaller
TAIL_BYTES = 2 << 20  # ... or to one of at most this much KV, if that is smaller


def kv_token_bytes(kv: Any) -> int:
    """The bytes one token's K/V takes in a pool ``[pages, layers, 2, heads, page_size,
    head_dim]``: every layer, K and V, every head of the pool."""
    _, layers, two, heads, _, head_dim = kv.shape
    return int(layers * two * heads * head_dim * kv.element_size())


def chunk_bounds(n: int, chunk: int, token_bytes: int = 0) -> list[tuple[int, int]]:
    """``[first, last)`` pieces of ``n`` tokens: ``chunk`` tokens each, but the last
    chunk's worth is cut in halves down to ``chunk // TAIL_DIVISOR`` tokens, or fewer
    where ``token_bytes`` (:func:`kv_token_bytes`) says that many would hold more than
    ``TAIL_BYTES`` of KV (then the rest). A pipelined writer sends each piece's pages once
    they are final, and what its owner checks after the last byte landed is the last
    piece: the smaller, the sooner the first token, for a few more pieces in all. At 32
    KiB of KV a token (8 layers, 8 KV heads, head size 128, bf16) a sixteenth of 65,536
    tokens is 128 MiB, which the owner would checksum after the last byte landed."""
    least = max(1, chunk // TAIL_DIVISOR)
    if token_bytes > 0:
        least = max(1, min(least, TAIL_BYTES // token_bytes))
    bounds, first = [], 0
    while n - first > chunk:
        bounds.append((first, first + chunk))
        first += chunk
    while n - first > least:
        step = max(least, (n - first) // 2)
        bounds.append((first, first + step))
        first += step
    if n > first or not bounds:
        bounds.append((first, n))
    return bounds


def run_to_end(steps: Generator[Any, None, Any]) -> Any:
    """Run a prefill generator through every step; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


class _HasPrefillLayers(Protocol):
    def prefill_layers(self, *args: Any, **kwargs: Any) -> Generator[int | None, None, Any]: ...


class PrefillByLayers:
    """For a model with ``prefill_layers``: ``prefill`` with the same arguments runs every
    layer and returns what ``prefill_layers`` returns."""

    def prefill(
        self: _HasPrefillLayers, kv: Any, tokens: Any, page_row: Any, **options: Any
    ) -> Any:
        return run_to_end(self.prefill_layers(kv, tokens, page_row, **options))
