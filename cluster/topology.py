"""Which rank plays which role.

Rank 0 is the router (front door). Ranks 1..P are prefill ranks, grouped into
tensor-parallel groups of ``tp`` consecutive ranks; each member of a group computes its
share of the KV heads. Ranks P+1..P+D are decode ranks, grouped into tensor-parallel
groups of ``decode_tp`` consecutive ranks; each member holds its share of the heads in a
pool of its own and owns the pages it allocates there. Which prefill member writes which
heads into which decode member is :class:`HeadSplit` (every head a decode member holds
comes from exactly one prefill member; members that share a head write it once).
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


@dataclass(frozen=True)
class HeadSplit:
    """How a request's KV heads go from a prefill group of ``tp`` members into a decode
    group of ``decode_tp`` members (:func:`kvferry.engine.reshard.assign_heads`): each
    (writer position, owner position) pair that exchanges bytes carries one contiguous
    range of heads; with ``decode_tp == 1``, writers that share a head with an earlier
    member (``tp`` above the heads) write nothing and are no writers at all. ``replicated``:
    the KV is replicated across TP (MLA's latent cache): every member on both sides holds
    every head, and each decode member takes all of it from one prefill member (the
    others write nothing into it, and it waits for no other)."""

    kv_heads: int
    tp: int = 1
    decode_tp: int = 1
    replicated: bool = False

    def __post_init__(self) -> None:
        if min(self.kv_heads, self.tp, self.decode_tp) < 1:
            raise TopologyError(
                f"a head split needs kv_heads, tp and decode_tp >= 1; got {self.kv_heads}, "
                f"{self.tp}, {self.decode_tp}"
            )

    @functools.cached_property
    def pairs(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(writer position, owner position) -> (lo, hi)``: the heads the writer writes
        into that owner, in the model's numbering."""
        shape = self._shape
        out = {}
        for pair, heads in assign_heads(
            shape, PoolLayout(self.tp, 1), PoolLayout(self.decode_tp, 1)
        ).items():
            lo, hi = heads[0], heads[-1] + 1
            assert hi - lo == len(heads), f"heads {heads} of pair {pair} are not contiguous"
            out[pair] = (lo, hi)
        return out

    @property
    def _shape(self) -> KVShape:
        return KVShape(1, self.kv_heads, 1, 1, replicated=self.replicated)

    def owner_heads(self, position: int) -> tuple[int, int]:
        """The heads ``[lo, hi)`` decode member ``position`` holds in its pool."""
        return head_span(self._shape, self.decode_tp, position)

    def writer_heads(self, position: int) -> tuple[int, int]:
        """The heads ``[lo, hi)`` prefill member ``position`` holds and computes."""
        return head_span(self._shape, self.tp, position)

    def writers_of(self, owner: int) -> list[int]:
        """The positions of the prefill members that write into decode member ``owner``,
        ascending."""
        return [w for (w, o) in self.pairs if o == owner]

    def owners_of(self, writer: int) -> list[int]:
        """The positions of the decode members prefill member ``writer`` writes into."""
        return [o for (w, o) in self.pairs if w == writer]

    def local_heads(self, writer: int, owner: int) -> tuple[int, int]:
        """The heads ``writer`` writes into ``owner``, numbered in the owner's pool."""
        lo, hi = self.pairs[(writer, owner)]
        base = self.owner_heads(owner)[0]
        return lo - base, hi - base

    def heads_into(self, owner: int) -> tuple[tuple[int, int], ...]:
        """:meth:`local_heads` of each of :meth:`writers_of` ``owner``, in order: what an
        owner checks every request's writers against, worked out once per split."""
        return _heads_into(self, owner)


@functools.lru_cache(maxsize=256)
def _heads_into(split: HeadSplit, owner: int) -> tuple[tuple[int, int], ...]:
    return tuple(split.local_heads(w, owner) for w in split.writers_of(owner))


@functools.lru_cache(maxsize=256)
def head_split(kv_heads: int, tp: int) -> HeadSplit:
    """The split of ``kv_heads`` from a prefill group of ``tp`` into one decode rank (one
    per shape: its pairs are worked out once)."""
    return HeadSplit(kv_heads, tp)


class TopologyError(ValueError):
    """The world size and the role counts do not add up."""


@dataclass(frozen=True)
class Topology:
    world_size: int
    prefill: int
    decode: int
    tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1 or self.tp < 1 or self.decode_tp < 1:
            raise TopologyError(
                f"need at least one prefill and one decode rank, tp >= 1 and decode_tp >= 1; "
                f"got prefill={self.prefill} decode={self.decode} tp={self.tp} "
                f"decode_tp={self.decode_tp}"
            )
        if self.prefill % self.tp:
            raise TopologyError(
                f"prefill ranks ({self.prefill}) must be a multiple of the tensor-parallel "
                f"size ({self.tp})"
            )
        if self.decode % self.decode_tp:
            raise TopologyError(
                f"decode ranks ({self.decode}) must be a multiple of the decode "
                f"tensor-parallel size ({self.decode_tp})"
            )
        if self.world_size != 1 + self.prefill + self.decode:
            raise TopologyError(
                f"world size {self.world_size} != 1 router + {self.prefill} prefill + "
                f"{self.decode} decode = {1 + self.prefill + self.decode}"
            )

    @classmethod
    def for_world(
        cls, world_size: int, prefill: int | None, tp: int = 1, decode_tp: int = 1
    ) -> Topology:
        """Fill in the decode count (and the prefill count, if absent: about half the
        workers, whole groups on both sides) from the world size."""
        if world_size < 3:
            raise TopologyError(
                f"a cluster needs at least 3 ranks (router, prefill, decode); "
                f"world size is {world_size}"
            )
        if prefill is None:  # the most prefill groups up to half, or the fewest past it
            workers = world_size - 1
            fits = [
                p
                for p in range(tp, workers, tp)
                if workers - p >= decode_tp and (workers - p) % decode_tp == 0
            ]
            fits.sort(key=lambda p: (p > workers / 2, abs(p - workers / 2)))
            prefill = fits[0] if fits else tp
        return cls(
            world_size=world_size,
            prefill=prefill,
            decode=world_size - 1 - prefill,
            tp=tp,
            decode_tp=decode_tp,
        )

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
        """Each group's ranks, in TP order (member i holds ``HeadSplit.writer_heads(i)``)."""
        ranks = self.prefill_ranks
        return [ranks[i : i + self.tp] for i in range(0, len(ranks), self.tp)]

    @property
    def decode_groups(self) -> list[list[int]]:
        """Each decode group's ranks, in TP order (member i holds
        ``HeadSplit.owner_heads(i)``)."""
        ranks = self.decode_ranks
        return [ranks[i : i + self.decode_tp] for i in range(0, len(ranks), self.decode_tp)]

    def split(self, kv_heads: int, replicated: bool = False) -> HeadSplit:
        return HeadSplit(kv_heads, self.tp, self.decode_tp, replicated)

    def decode_member(self, rank: int) -> tuple[int, int]:
        """(group index, position in the group) of a decode rank."""
        if self.role(rank) is not Role.DECODE:
            raise TopologyError(f"rank {rank} is not a decode rank")
        offset = rank - 1 - self.prefill
        return offset // self.decode_tp, offset % self.decode_tp

    def group_of(self, rank: int) -> tuple[int, int]:
        """(group index, position in the group) of a prefill rank."""
        if self.role(rank) is not Role.PREFILL:
            raise TopologyError(f"rank {rank} is not a prefill rank")
        offset = rank - 1
        return offset // self.tp, offset % self.tp
