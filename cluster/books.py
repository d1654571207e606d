"""What every worker rank keeps besides its live requests.

Tombstones: request ids that reached a terminal state here, so that a late message for one
of them (a PREFILL, PLAN, ASSIGN or NOTICE overtaken by its ABORT) never brings it back
(I2). They are swept after ``TOMBSTONE_S``, far past any request deadline.
"""

from __future__ import annotations

from typing import Any

from kvferry.engine.allocator import PageAllocator
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol.driver import Clock

TOMBSTONE_S = 600.0


class RankBooks:
    """Mixed into PrefillRank and DecodeRank, which set ``allocator`` and ``pool``."""

    allocator: PageAllocator
    pool: KVPool
    clock: Clock  # the time the rank's protocol code reads
    driver: Any  # carries out the rank's protocol table (a Driver, or a WriterDriver)
    rt: Any  # the rank's runtime (its peers' cards)
    router: int  # the router's rank

    @property
    def table(self) -> dict:
        """The table the rank's driver carries out (a test may put a broken one here)."""
        return self.driver.table

    @table.setter
    def table(self, table: dict) -> None:
        self.driver.table = table

    def _init_books(self) -> None:
        self.tombstones: dict[str, float] = {}
        self.integrity_failures = 0
        self.allocations = 0

    def tombstone(self, rid: str, at: float) -> None:
        """``rid`` ended here at ``at`` (the drivers' TOMBSTONE)."""
        self.tombstones[rid] = at

    def sweep(self) -> None:
        cutoff = self.clock.now() - TOMBSTONE_S
        for rid in [r for r, t in self.tombstones.items() if t < cutoff]:
            del self.tombstones[rid]

    def fenced_writers(self) -> list[str]:
        """Writer incarnations quarantined pages here wait on (a decode rank's)."""
        return []

    def quarantines(self) -> list[str]:
        """One line per quarantined request here: what it holds, what it waits on and
        the proofs it has so far (a decode rank's; /status)."""
        return []

    def router_incarnations(self) -> dict[str, int]:
        """The router incarnation each live request here came from (0: not known yet)."""
        return {}

    def pages_of_other_routers(self) -> int:
        """Pages held here (owned or quarantined) for requests of a router incarnation
        other than the current one: what a restarted router must count as taken, exactly
        (its own reservations may not be allocated here yet)."""
        card = self.rt.cards.get(self.router)
        if card is None:  # no router known yet: no request here is a router's
            return 0
        return sum(
            len(self.allocator.pages_of(rid))
            for rid, inc in self.router_incarnations().items()
            if inc and inc != card.incarnation
        )

    def stats(self) -> dict:
        """Pool figures for the router's /metrics and /status (I3, I6)."""
        counts = self.allocator.counts()
        return dict(
            free=counts["free"],
            owned=counts["owned"],
            quarantined=counts["quarantined"],
            other_routers=self.pages_of_other_routers(),
            capacity_tokens=self.pool.capacity_tokens,
            integrity_failures=self.integrity_failures,
            allocations=self.allocations,
        )
