"""GPU kernels of the engine (Triton) and the dispatch between them and the torch
references: paged decode attention with the page ownership check at the read, and page
checksums. Importing this package does not import Triton; the kernels load on first use
with CUDA tensors (or under ``TRITON_INTERPRET=1`` through their modules directly)."""

from .dispatch import page_checksums, paged_decode_attention, use_triton
from .ownership import (
    BEYOND_TABLE,
    FOREIGN_REQUEST,
    NO_BAD_PAGE,
    OUT_OF_POOL,
    STALE_GENERATION,
    WRONG_INDEX,
    PageOwnership,
    check_ownership_reference,
    describe_kinds,
)

__all__ = [
    "BEYOND_TABLE",
    "FOREIGN_REQUEST",
    "NO_BAD_PAGE",
    "OUT_OF_POOL",
    "STALE_GENERATION",
    "WRONG_INDEX",
    "PageOwnership",
    "check_ownership_reference",
    "describe_kinds",
    "page_checksums",
    "paged_decode_attention",
    "use_triton",
]
