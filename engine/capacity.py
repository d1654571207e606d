"""Start-up capacity check (I3): measure the pool that was really built, compare it with
the declared context length, refuse to start when it is short.

The only way past a short pool is an explicit, logged lowering of the context length to at
most the measured capacity (``lowered_context_length``).

``check_capacity`` allocates with ``torch.empty``: the operating system maps pages lazily,
so measuring a multi-million-token pool costs no time and no resident memory while still
measuring a real allocation (its shape and the bytes its storage holds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .pool import KVPool, PoolConfig

log = logging.getLogger(__name__)


class CapacityError(Exception):
    """The pool holds fewer tokens than the context length a rank would serve."""

    def __init__(self, measured_tokens: int, context_length: int, detail: str = "") -> None:
        super().__init__(
            f"KV pool holds {measured_tokens} tokens, below the context length {context_length}"
            + (f"; {detail}" if detail else "")
            + f". Enlarge the pool or lower the context length to at most {measured_tokens}."
        )
        self.measured_tokens = measured_tokens
        self.context_length = context_length


@dataclass(frozen=True)
class CapacityReport:
    measured_tokens: int
    context_length: int
    pool_bytes: int
    num_pages: int
    page_size: int

    @property
    def ok(self) -> bool:
        return self.measured_tokens >= self.context_length

    def message(self) -> str:
        relation = ">=" if self.ok else "<"
        verdict = "fits" if self.ok else "DOES NOT FIT"
        return (
            f"{verdict}: pool capacity {self.measured_tokens} tokens {relation} context length "
            f"{self.context_length} tokens ({self.num_pages} pages of {self.page_size}, "
            f"{self.pool_bytes} bytes)"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "measured_tokens": self.measured_tokens,
            "context_length": self.context_length,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "pool_bytes": self.pool_bytes,
        }


def measure_capacity(pool: KVPool) -> int:
    """Tokens the pool's allocated tensor holds."""
    return pool.capacity_tokens


def report_for(pool: KVPool, context_length: int) -> CapacityReport:
    return CapacityReport(
        measure_capacity(pool), context_length, pool.nbytes, pool.num_pages, pool.page_size
    )


def check_capacity(config: PoolConfig | KVPool, context_length: int) -> CapacityReport:
    """Build the pool (unless given one), measure it, compare with ``context_length``."""
    if context_length < 1:
        raise ValueError(f"context length must be positive, got {context_length}")
    pool = config if isinstance(config, KVPool) else KVPool(config)
    return report_for(pool, context_length)


def enforce_startup_capacity(
    pool: KVPool, declared_context_length: int, lowered_context_length: int | None = None
) -> int:
    """The context length a rank may serve with this pool, or :class:`CapacityError`.

    ``lowered_context_length`` is the operator's explicit choice to serve less than the
    declared length; it must fit the measured pool and is logged."""
    measured = measure_capacity(pool)
    if lowered_context_length is not None:
        if lowered_context_length < 1:
            raise ValueError(
                f"lowered context length must be positive, got {lowered_context_length}"
            )
        if lowered_context_length > measured:
            raise CapacityError(
                measured, lowered_context_length, "even the lowered context length does not fit"
            )
        if lowered_context_length < declared_context_length:
            log.warning(
                "context length lowered by the operator from %d to %d tokens "
                "to fit a pool of %d tokens",
                declared_context_length,
                lowered_context_length,
                measured,
            )
        return lowered_context_length
    if measured < declared_context_length:
        raise CapacityError(measured, declared_context_length)
    log.info("pool capacity %d tokens >= context length %d", measured, declared_context_length)
    return declared_context_length
