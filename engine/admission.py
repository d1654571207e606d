"""Admission control: decide before any page is allocated (I1).

A request needs ``prompt_tokens + max_tokens`` positions. It is rejected when that exceeds
the context length or the capacity of the smallest pool it will touch. The capacity a pool
can give a request is its pages minus the quarantined ones (pages owned by live requests
come back when those finish; quarantined pages come back only on proof, so they count as
used). The rejection carries the numbers and maps to HTTP 400.

Whether the pages are free *right now* is a scheduling question, not an admission one: an
admitted request waits in its queue until the allocator can grant all its pages at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .allocator import PageAllocator


def pages_needed(prompt_tokens: int, max_tokens: int, page_size: int) -> int:
    """Pages a request must hold for its whole life: prompt plus every generated token."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError(
            f"token counts must be non-negative: prompt {prompt_tokens}, max_tokens {max_tokens}"
        )
    return -(-(prompt_tokens + max_tokens) // page_size)


def pool_capacity_tokens(allocator: PageAllocator, page_size: int) -> int:
    """Tokens a pool can give one request: all pages but the quarantined ones."""
    counts = allocator.counts()
    return (counts["total"] - counts["quarantined"]) * page_size


class AdmissionRejected(Exception):
    """A request that can never fit. ``http_status`` is what the front door answers."""

    http_status = 400

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        context_length: int,
        capacity_tokens: int,
        reason: str,
    ) -> None:
        super().__init__(
            f"request {request_id!r} rejected: {reason} (prompt {prompt_tokens} tokens + "
            f"max_tokens {max_tokens} = {prompt_tokens + max_tokens}; "
            f"context length {context_length}; pool capacity {capacity_tokens} tokens)"
        )
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        self.capacity_tokens = capacity_tokens
        self.reason = reason

    def to_dict(self) -> dict[str, object]:
        return {
            "error": "admission_rejected",
            "request_id": self.request_id,
            "reason": self.reason,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "requested_tokens": self.prompt_tokens + self.max_tokens,
            "context_length": self.context_length,
            "capacity_tokens": self.capacity_tokens,
        }


@dataclass(frozen=True)
class AdmissionLimits:
    """Context length and the capacity (tokens) of every pool a request will touch."""

    context_length: int
    capacities_tokens: tuple[int, ...]

    @property
    def capacity_tokens(self) -> int:
        return min(self.capacities_tokens)

    def admit(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        admit(request_id, prompt_tokens, max_tokens, self.context_length, self.capacities_tokens)


def admit(
    request_id: str,
    prompt_tokens: int,
    max_tokens: int,
    context_length: int,
    pool_capacity_tokens: int | Sequence[int],
) -> None:
    """Return if the request can ever fit; raise :class:`AdmissionRejected` otherwise."""
    capacities = (
        (pool_capacity_tokens,)
        if isinstance(pool_capacity_tokens, int)
        else tuple(pool_capacity_tokens)
    )
    if not capacities:
        raise ValueError(
            f"request {request_id!r}: admission needs the capacity of at least one pool"
        )
    capacity = min(capacities)
    requested = prompt_tokens + max_tokens

    def reject(reason: str) -> AdmissionRejected:
        return AdmissionRejected(
            request_id, prompt_tokens, max_tokens, context_length, capacity, reason
        )

    if prompt_tokens < 1:
        raise reject("empty prompt")
    if max_tokens < 1:
        raise reject("max_tokens must be at least 1")
    if requested > context_length:
        raise reject(f"needs {requested} positions, more than the context length {context_length}")
    if requested > capacity:
        raise reject(
            f"needs {requested} positions, more than the pool can hold ({capacity} tokens)"
        )
