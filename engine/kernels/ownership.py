"""Page ownership checked at the read (I5 at every decode step): the inputs the decode
kernel checks each page against, the error kinds it raises, and the torch reference of the
check.

Each page the attention reads (logical page ``j`` of sequence ``b``, every ``j`` with
``j * page_size < seq_len``) is checked against the canary side table that
:class:`kvferry.engine.integrity.CanaryTable` keeps (``[num_pages, 3]`` int64 rows:
request id hash, generation, logical page index):

================= ===== ==========================================================
kind              bit   when
================= ===== ==========================================================
FOREIGN_REQUEST   1     the page's request id hash is not the sequence's
STALE_GENERATION  2     the page's generation is not the one its grant had
WRONG_INDEX       4     the page's logical index is not ``j`` (a swapped entry)
OUT_OF_POOL       8     the page id is outside ``[0, num_pages)`` (nothing else is
                        compared; the read is clamped into the pool)
BEYOND_TABLE      16    ``seq_len`` needs more pages than the page table row has
                        (reported with first bad page = the table's width)
================= ===== ==========================================================

Per sequence the check ORs the kinds into ``errors[b]`` and takes the smallest bad logical
page index into ``first_bad[b]`` (``NO_BAD_PAGE`` when none). Both are accumulated, never
reset by a check, so one :class:`PageOwnership` can serve every layer of a step (the
result does not depend on order: OR and min). A sequence with a non-zero flag must fail
with :class:`~kvferry.engine.integrity.IntegrityError` and produce no token
(:meth:`PageOwnership.raise_if_bad`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..allocator import PageGrant
from ..integrity import CanaryTable, IntegrityError, request_id_hash

FOREIGN_REQUEST = 1
STALE_GENERATION = 2
WRONG_INDEX = 4
OUT_OF_POOL = 8
BEYOND_TABLE = 16
NO_BAD_PAGE = (1 << 31) - 1

KIND_NAMES = {
    FOREIGN_REQUEST: "foreign request",
    STALE_GENERATION: "stale generation",
    WRONG_INDEX: "wrong page index",
    OUT_OF_POOL: "page id outside the pool",
    BEYOND_TABLE: "sequence longer than its page table",
}


def describe_kinds(bits: int) -> str:
    """Human-readable list of the kinds set in ``bits``."""
    return ", ".join(name for bit, name in KIND_NAMES.items() if bits & bit) or "none"


@dataclass
class PageOwnership:
    """What the reader expects of its pages, and where the check reports.

    canaries: ``[num_pages, 3]`` int64, the canary side table (on the pool's device).
    request_ids: ``[batch]`` int64, each sequence's expected request id hash.
    generations: ``[batch, width]`` int64, the expected generation of each page-table
    entry (width at least the page table's).
    errors: ``[batch]`` int32, OR of the kinds found (output, accumulated).
    first_bad: ``[batch]`` int32, smallest bad logical page index (output, accumulated).
    """

    canaries: torch.Tensor
    request_ids: torch.Tensor
    generations: torch.Tensor
    errors: torch.Tensor
    first_bad: torch.Tensor

    @classmethod
    def create(
        cls, canaries: torch.Tensor, request_ids: torch.Tensor, generations: torch.Tensor
    ) -> PageOwnership:
        """Fresh outputs (no errors) for the given expectations, on the canaries' device."""
        device = canaries.device
        batch = request_ids.shape[0]
        if canaries.dim() != 2 or canaries.shape[1] != 3 or canaries.dtype != torch.int64:
            raise ValueError(
                f"canaries must be [num_pages, 3] int64, got {tuple(canaries.shape)} "
                f"{canaries.dtype}"
            )
        if generations.dim() != 2 or generations.shape[0] != batch:
            raise ValueError(f"generations {tuple(generations.shape)} do not match batch {batch}")
        return cls(
            canaries=canaries,
            request_ids=request_ids.to(device=device, dtype=torch.int64),
            generations=generations.to(device=device, dtype=torch.int64),
            errors=torch.zeros(batch, dtype=torch.int32, device=device),
            first_bad=torch.full((batch,), NO_BAD_PAGE, dtype=torch.int32, device=device),
        )

    @classmethod
    def for_requests(
        cls,
        table: CanaryTable | torch.Tensor,
        request_ids: Sequence[str],
        grants: Sequence[Sequence[PageGrant]],
        width: int | None = None,
        device: torch.device | str | None = None,
    ) -> PageOwnership:
        """Expectations from each request's own allocation (its grants, in page-list order),
        as :func:`~kvferry.engine.integrity.expected_canaries` has them."""
        canaries = table.table if isinstance(table, CanaryTable) else table
        if device is not None:
            canaries = canaries.to(device)
        width = max([len(g) for g in grants] + [1]) if width is None else width
        gens = torch.zeros(len(grants), width, dtype=torch.int64)
        for b, row in enumerate(grants):
            if row:
                gens[b, : len(row)] = torch.tensor([g.generation for g in row], dtype=torch.int64)
        rids = torch.tensor([request_id_hash(r) for r in request_ids], dtype=torch.int64)
        return cls.create(canaries, rids, gens)

    def check_inputs(self, batch: int, width: int) -> None:
        if (
            self.request_ids.shape != (batch,)
            or self.errors.shape != (batch,)
            or self.first_bad.shape != (batch,)
        ):
            raise ValueError(f"ownership tensors do not match batch {batch}")
        if self.generations.shape[0] != batch or self.generations.shape[1] < width:
            raise ValueError(
                f"generations {tuple(self.generations.shape)} "
                f"narrower than page table width {width}"
            )
        if self.errors.dtype != torch.int32 or self.first_bad.dtype != torch.int32:
            raise ValueError("errors and first_bad must be int32")

    def reset(self) -> None:
        self.errors.zero_()
        self.first_bad.fill_(NO_BAD_PAGE)

    def failures(self) -> list[tuple[int, int, int]]:
        """``(sequence, kinds, first bad logical page)`` of each flagged sequence (syncs)."""
        errors = self.errors.tolist()
        first = self.first_bad.tolist()
        return [(b, e, f) for b, (e, f) in enumerate(zip(errors, first, strict=True)) if e]

    def raise_if_bad(
        self, request_ids: Sequence[str], page_table: torch.Tensor | None = None
    ) -> None:
        """Raise :class:`IntegrityError` for the first flagged sequence, naming the kinds
        and its first bad page (the physical id when the page table is given)."""
        for b, bits, first in self.failures():
            bad: list[int] = []
            if page_table is not None and first < page_table.shape[1]:
                bad = [int(page_table[b, first])]
            raise IntegrityError(
                request_ids[b],
                f"page ownership check at read: {describe_kinds(bits)} (logical page {first})",
                bad,
            )


def check_ownership_reference(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_pages: int,
    ownership: PageOwnership,
) -> None:
    """Torch reference of the kernel's check: accumulates into ``ownership.errors`` and
    ``ownership.first_bad`` exactly as the Triton kernel does.

    page_table: ``[batch, width]`` int; seq_lens: ``[batch]`` int."""
    batch, width = page_table.shape
    ownership.check_inputs(batch, width)
    device = ownership.errors.device
    table = page_table.to(device=device, dtype=torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64).clamp(min=0)
    columns = torch.arange(width, device=device, dtype=torch.int64)
    read = columns[None, :] * page_size < lens[:, None]  # [batch, width]: pages the attention reads
    oob = (table < 0) | (table >= num_pages)
    clamped = table.clamp(0, num_pages - 1)
    rows = ownership.canaries[clamped]  # [batch, width, 3]
    kinds = (
        torch.where(rows[..., 0] != ownership.request_ids[:, None], FOREIGN_REQUEST, 0)
        | torch.where(rows[..., 1] != ownership.generations[:, :width], STALE_GENERATION, 0)
        | torch.where(rows[..., 2] != columns[None, :], WRONG_INDEX, 0)
    )
    kinds = torch.where(oob, OUT_OF_POOL, kinds)
    kinds = torch.where(read, kinds, 0)
    errors = torch.zeros(batch, dtype=torch.int64, device=device)
    for bit in KIND_NAMES:
        errors |= torch.where(((kinds & bit) != 0).any(dim=1), bit, 0)
    first = (
        torch.where(kinds != 0, columns[None, :], NO_BAD_PAGE).amin(dim=1)
        if width
        else torch.full((batch,), NO_BAD_PAGE, device=device)
    )
    beyond = lens > width * page_size
    errors |= torch.where(beyond, BEYOND_TABLE, 0)
    first = torch.where(beyond, torch.minimum(first, torch.full_like(first, width)), first)
    ownership.errors |= errors.to(torch.int32)
    torch.minimum(ownership.first_bad, first.to(torch.int32), out=ownership.first_bad)
