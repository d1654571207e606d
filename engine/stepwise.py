"""A prefill that yields after each step, so that its caller can stop it between steps
(an abort) or poll between them, and the one-call ``prefill`` the models build on it.

``prefill_layers`` yields a layer's index once that layer's KV is in the pages, and may
yield None between pieces of one layer (chunks of a long prompt's tokens)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol


class _HasPrefillLayers(Protocol):
    def prefill_layers(self, *args: Any, **kwargs: Any) -> Generator[int | None, None, Any]: ...


class PrefillByLayers:
    """For a model with ``prefill_layers``: ``prefill`` with the same arguments runs every
    layer and returns what ``prefill_layers`` returns."""

    def prefill(
        self: _HasPrefillLayers, kv: Any, tokens: Any, page_row: Any, **options: Any
    ) -> Any:
        layers = self.prefill_layers(kv, tokens, page_row, **options)
        while True:
            try:
                next(layers)
            except StopIteration as end:
                return end.value
