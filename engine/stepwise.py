"""A prefill that yields after each layer, so that its caller can stop it between layers
(an abort), and the one-call ``prefill`` the models build on it."""

from __future__ import annotations

from typing import Any


class PrefillByLayers:
    """For a model with ``prefill_layers``: ``prefill`` with the same arguments runs every
    layer and returns what ``prefill_layers`` returns."""

    def prefill(self, kv: Any, tokens: Any, page_row: Any, **options: Any) -> Any:
        layers = self.prefill_layers(kv, tokens, page_row, **options)
        while True:
            try:
                next(layers)
            except StopIteration as end:
                return end.value
