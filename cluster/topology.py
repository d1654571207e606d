"""Which rank plays which role.

Rank 0 is the router (front door). Ranks 1..P are prefill ranks, grouped into
tensor-parallel groups of ``tp`` consecutive ranks; each member of a group computes its
share of the KV heads and writes it into the same destination pages (members that share a
head, when ``tp`` exceeds the KV heads, write it once: :func:`group_heads`). Ranks P+1..P+D are
decode ranks; each owns the pages it allocates.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from kvferry.engine.reshard import KVShape, PoolLayout, assign_heads, head_span


class Role(enum.StrEnum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


def head_range(position: int, group_size: int, kv_heads: int) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` that member ``position`` of a prefill group of
    ``group_size`` holds and computes: ``kv_heads / group_size`` each when that divides,
    else some hold one more; with more members than heads, consecutive members hold the
    same one head (replicated GQA). See :func:`kvferry.engine.reshard.head_span`."""
    return head_span(KVShape(1, kv_heads, 1, 1), group_size, position)


@functools.cache
def group_heads(group_size: int, kv_heads: int) -> tuple[tuple[int, int] | None, ...]:
    """Per member of a prefill group, the KV heads ``[lo, hi)`` it writes into a decode
    rank (which holds every head), or None for a member that writes nothing: where
    members share a head (more members than heads), the first member holding it writes
    it, and the others are no writers of the request at all (the router sends them
    nothing and no owner waits for them). Every head is written by exactly one member
    (:func:`kvferry.engine.reshard.assign_heads`, into one decode rank)."""
    pairs = assign_heads(KVShape(1, kv_heads, 1, 1), PoolLayout(group_size, 1), PoolLayout(1, 1))
    out: list[tuple[int, int] | None] = [None] * group_size
    for (member, _), heads in pairs.items():
        out[member] = (heads[0], heads[-1] + 1)
    return tuple(out)


class TopologyError(ValueError):
    """The world size and the role counts do not add up."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    prefill: int
    decode: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.tp < 1:
            raise TopologyError(
                f"need at least one prefill and one decode rank and tp >= 1; got "
                f"prefill={self.prefill} decode={self.decode} tp={self.tp}"
            )
        if self.prefill % self.tp:
            raise TopologyError(
                f"prefill ranks ({self.prefill}) must be a multiple of the tensor-parallel "
                f"size ({self.tp})"
            )
        if self.world_size != 1 + self.prefill + self.decode:
            raise TopologyError(
                f"world size {self.world_size} != 1 router + {self.prefill} prefill + "
                f"{self.decode} decode = {1 + self.prefill + self.decode}"
            )

    @classmethod
    def for_world(cls, world_size: int, prefill: int | None, tp: int = 1) -> Topology:
        """Fill in the decode count (and the prefill count, if absent) from the world size."""
        if world_size < 3:
            raise TopologyError(
                f"a cluster needs at least 3 ranks (router, prefill, decode); "
                f"world size is {world_size}"
            )
        if prefill is None:
            prefill = tp * max(1, (world_size - 1) // (2 * tp))
        return cls(world_size=world_size, prefill=prefill, decode=world_size - 1 - prefill, tp=tp)

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of {self.world_size}")
        if rank == 0:
            return Role.ROUTER
        if rank <= self.prefill:
            return Role.PREFILL
        return Role.DECODE

    @property
    def router_rank(self) -> int:
        return 0

    @property
    def prefill_ranks(self) -> list[int]:
        return list(range(1, 1 + self.prefill))

    @property
    def decode_ranks(self) -> list[int]:
        return list(range(1 + self.prefill, self.world_size))

    @property
    def prefill_groups(self) -> list[list[int]]:
        """Each group's ranks, in TP order (member i holds heads ``head_range(i, tp, H)``)."""
        ranks = self.prefill_ranks
        return [ranks[i : i + self.tp] for i in range(0, len(ranks), self.tp)]

    def writers_in(self, group: list[int], kv_heads: int) -> list[int]:
        """The members of ``group`` that write a request's KV (see :func:`group_heads`)."""
        return [r for r, heads in zip(group, group_heads(self.tp, kv_heads), strict=True) if heads]

    def group_of(self, rank: int) -> tuple[int, int]:
        """(group index, position in the group) of a prefill rank."""
        if self.role(rank) is not Role.PREFILL:
            raise TopologyError(f"rank {rank} is not a prefill rank")
        offset = rank - 1
        return offset // self.tp, offset % self.tp
