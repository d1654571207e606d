"""The decode rank's data path: I5 on a request's arrival, and the decode steps.

It is the owner driver's :class:`~kvferry.engine.protocol.ports.OwnerDataPath` port and
the part of the decode rank that reads pages: it checks what landed (length, planned
pages and generations, bytes, canaries and checksums, in slices), stamps each allocated
page's canary, and runs the model's decode steps with the ownership check; what comes of
each (VERIFIED, CORRUPT, FINISHED) goes back to the driver as an event, and tokens go to
the router. It moves no book itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvferry.engine.admission import pages_needed
from kvferry.engine.integrity import (
    CanaryTable,
    IntegrityError,
    PageList,
    page_checksums,
)
from kvferry.engine.kernels.ownership import (
    PageOwnership,
    check_ownership_reference,
    describe_kinds,
)
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol.owner import OwnerEvent, OwnerState
from kvferry.engine.protocol.ports import Clock
from kvferry.engine.reshard import KVShape, Order, heads_between_pools, page_for_page
from kvferry.engine.run_checksum import region_checksums, split_at_pages, word_unit
from kvferry.engine.verify import Notice as VerifyNotice
from kvferry.engine.verify import (
    Planned,
    check_canaries,
    check_notice,
    check_part,
    checksum_steps,
    expected_canary_rows,
    unchecked_rest,
)

from . import messages as m
from .sliced import run_in_slices
from .topology import HeadSplit, head_split

if TYPE_CHECKING:
    from kvferry.engine.protocol.owner_driver import OwnerDriver

    from .decode import NoticePart, OwnedRequest

log = logging.getLogger("kvferry.cluster")

TOKEN_FLUSH = 16
VERIFY_SLICE_S = 0.005  # longest the checks run before the loop polls again
CHECKSUM_SLICE_BYTES = 32 << 20  # pages checksummed per step of the checks
RELAYOUT_SLICE_BYTES = 8 << 20  # pages turned into this pool's order per step


def writers_first_token(req: OwnedRequest) -> int | None:
    """The answer's first token, as every writer's prefill computed it (None: no writer
    sent one, and the first step reads it from the pages). Writers that disagree wrote
    from different prompts or models: IntegrityError, with each rank's token."""
    said = {w: n.first_token for w, n in req.notices.items() if n.first_token is not None}
    tokens = set(said.values())
    if len(tokens) > 1:
        raise IntegrityError(
            req.rid,
            "the writers' prefills disagree on the first token: "
            + ", ".join(f"rank {w} computed {t}" for w, t in sorted(said.items())),
        )
    return tokens.pop() if tokens else None


def _rows_of(sorted_keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The indices of the rows of ``sorted_keys`` (ascending) equal to any of ``wanted``
    (distinct), in ``wanted``'s order: ``[k]`` int64, by bisection."""
    lo = np.searchsorted(sorted_keys, wanted, side="left")
    counts = np.searchsorted(sorted_keys, wanted, side="right") - lo
    starts = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    return np.arange(int(counts.sum()), dtype=np.int64) + starts


@dataclass
class StepPlan:
    """One decode step's inputs, made before it runs. ``table`` is the batch's page table
    ``[batch, max_pages]``; ``positions``, ``inputs`` and ``prompt_lens`` are ``[batch]``;
    ``step_args`` go to the model's ``decode_step`` (the fused ownership check's)."""

    batch: list[OwnedRequest]
    table: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    labels: list[str] = field(default_factory=list)  # the fault layer's, per request
    step_args: dict[str, Any] = field(default_factory=dict)
    fused: bool = False


class ReadPath:
    """What every owner's data path offers its rank, the service's and the simulator's."""

    rt: Any  # the rank's runtime (RankRuntime, or the simulator's)
    clock: Clock
    driver: OwnerDriver  # set by the rank that hosts this path

    def bind(self, driver: OwnerDriver) -> None:
        self.driver = driver

    def stamp(self, req: OwnedRequest) -> None:
        """Write the request's canary into each of its allocated pages' tags."""
        raise NotImplementedError

    def writers_mismatch(self, req: OwnedRequest) -> str | None:
        """Why the ASSIGN's writer list cannot write this path's pages, or None (it can)."""
        return None

    def verify(self, req: OwnedRequest) -> None:
        """I5 on arrival; ends in VERIFIED or CORRUPT, fed to the driver."""
        raise NotImplementedError

    def verify_parts(self, req: OwnedRequest) -> None:
        """Check the notice parts that arrived (pipelined writers); CORRUPT on a mismatch."""
        raise NotImplementedError

    def step(self, batch: list[OwnedRequest]) -> None:
        """One decode step for ``batch`` (all DECODING)."""
        raise NotImplementedError

    # A step in three parts, for a rank that runs the middle one off its loop's thread
    # (see cluster.stepping): ``plan_step`` and ``apply_step`` on the rank's thread (they
    # may feed events and send), ``run_step`` anywhere (it only computes). A path that
    # does not split its steps does the whole step in ``apply_step``.
    def plan_step(self, batch: list[OwnedRequest]) -> StepPlan | None:
        """What ``run_step`` needs, after the checks before the step; None when no request
        of ``batch`` is left to step."""
        return StepPlan(batch)

    def run_step(self, plan: StepPlan) -> list[int] | None:
        """The step's compute: a token per request of ``plan.batch``."""
        return None

    def apply_step(self, plan: StepPlan, out: list[int] | None) -> None:
        """The step's results: checks after it, tokens to the router, FINISHED."""
        self.step(plan.batch)

    def event_time(self) -> float:
        """When the event being handled began (an abort's clock starts there)."""
        return self.clock.now()

    def moved(self, req: OwnedRequest, before: OwnerState) -> None:
        """``req`` moved by the table from ``before`` (a path may start work on it)."""

    def start_decode(self, req: OwnedRequest) -> None:
        """Verified: the first token the writers' prefill computed goes to the router
        (a path whose steps read it from the pages sends nothing here)."""


class DecodePath(ReadPath):
    """The service's path: ``model`` decodes over ``pool``'s pages, checked against the
    canary table (I5) before and during each step."""

    def __init__(
        self,
        runtime: Any,
        model: Any,
        pool: KVPool,
        router: int,
        *,
        clock: Clock,
        integrity: bool = True,
        unsafe: bool = False,
        prefill_tp: int | None = None,
        member: tuple[HeadSplit, int] | None = None,
    ) -> None:
        self.rt = runtime
        self.prefill_tp = prefill_tp  # the prefill groups' size (None: every writer listed)
        # this rank's place in its decode group: it holds split.owner_heads(position) of
        # the model's heads, its pool's own kv_heads (None: every head, one writer group
        # of prefill_tp)
        self.split: HeadSplit | None = member[0] if member else None
        self.position = member[1] if member else 0
        if self.split is not None:
            held = self.split.owner_heads(self.position)
            if held[1] - held[0] != pool.kv_heads:
                raise ValueError(
                    f"member {self.position} of a decode group of {self.split.decode_tp} "
                    f"holds heads {held} of {self.split.kv_heads}, but its pool has "
                    f"{pool.kv_heads} KV heads"
                )
        self.model = model
        self.pool = pool
        self.router = router
        self.clock = clock
        self.integrity = integrity and not unsafe  # checksums and canaries
        self.unsafe = unsafe  # the broken mode: no checks at all
        self.canaries = CanaryTable(pool.num_pages)

    def stamp(self, req: OwnedRequest) -> None:
        self.rt.faults.raise_at("owner-assign", f"prompt_len={req.prompt_len}")
        pages, generations = req.planned_rows
        self.canaries.load(pages, expected_canary_rows(req.rid, generations))

    def verify(self, req: OwnedRequest) -> None:
        """Verify (I5) in slices (a long prompt's checksums take seconds; see .sliced),
        then decode. An ABORT that arrives meanwhile frees the pages (every writer
        noticed) and the rest of the checks never run."""
        req.noticed_at = self.clock.now()
        req.transfer_ms = 1e3 * (req.noticed_at - req.planned_at)
        times = [n.prefill_ms for n in req.notices.values() if n.prefill_ms is not None]
        req.prefill_ms = max(times) if times else None
        self.rt.faults.raise_at("owner-notice", f"prompt_len={req.prompt_len}")
        try:
            req.first_token = writers_first_token(req)
        except IntegrityError as exc:
            req.error = f"integrity: {exc}"
            self.driver.feed(req, OwnerEvent.CORRUPT)
            return
        if self.unsafe and self._landed_order(req) is self.pool.order:
            self.driver.feed(req, OwnerEvent.VERIFIED)
            return
        run_in_slices(
            self.rt,
            req.rid,
            self._verify_steps(req),
            VERIFY_SLICE_S,
            wanted=lambda: req.state is OwnerState.VERIFYING,
            then=lambda: self.driver.feed(req, OwnerEvent.VERIFIED),
        )

    def _verify_steps(self, req: OwnedRequest) -> Iterator[None]:
        try:
            if not self.unsafe:  # the broken mode checks nothing, but still reads its pages
                yield from self._verify(req)
            yield from self._relayout_steps(req)
        except IntegrityError as exc:
            req.error = f"integrity: {exc}"
            self.driver.feed(req, OwnerEvent.CORRUPT)

    def _verify(self, req: OwnedRequest) -> Iterator[None]:
        """I5 for every writer's notice, by :mod:`kvferry.engine.verify`: the prompt's
        length, exactly the pages the prompt needs (this request's pages and generations,
        in order) and the bytes those pages hold for the writer's heads; then, unless
        integrity checks are off, the canaries and the checksums of what landed, a slice
        of pages a step (but the pages a part already checked, whose checksums the notice
        must repeat). Raises IntegrityError."""
        for w in req.writers:
            n = req.notices[w]
            planned, checksums_of, per_step = self._checks(req, w)
            notice = VerifyNotice(w, n.tokens, n.pages, n.generations, n.checksums, n.bytes)
            check_notice(planned, notice)
            if not self.integrity:
                continue
            checked = req.part_checked.get(w)
            index = None  # the pages' places in the allocation (None: all, in order)
            if checked is not None and len(notice.checksums) == len(notice.pages):
                # the parts checked their pages' canaries (check_part): only the rest now
                notice, planned, index = unchecked_rest(planned, notice, *checked)
            check_canaries(planned, self.canaries.rows(notice.pages), index=index)
            yield from checksum_steps(planned, notice, checksums_of, per_step)

    def _checks(
        self, req: OwnedRequest, writer: int
    ) -> tuple[Planned, Callable[[PageList], torch.Tensor], int]:
        """What ``writer`` must write for ``req``, how the bytes that landed in its pages
        are checksummed, and how many pages a step checks. A writer of this rank's page
        size writes page for page, laid as in its own memory (its checksums are of the
        pages read in that order: :meth:`_planned`); one of another page size
        (``--prefill-page-size``: :func:`~kvferry.engine.reshard.page_for_page`) writes its
        heads as runs, and its checksums are of what those runs put in each of the owner's
        pages, as they lie in memory."""
        pool = self.pool
        src_size, src_order = self._writer_format(writer)
        if page_for_page((src_size, src_order), pool.page_format):
            planned, view = self._planned(req, writer)
            return planned, functools.partial(page_checksums, view), self._per_step(view)
        need = pages_needed(req.prompt_len, 0, pool.page_size)
        pages, generations = req.planned_rows
        shape = KVShape(pool.layers, pool.kv_heads, pool.head_dim, pool.kv.element_size())
        # the destination bytes do not depend on the writer's pages: any list will do
        runs = heads_between_pools(
            shape,
            self.heads_of(req, writer),
            req.prompt_len,
            (src_size, range(pages_needed(req.prompt_len, 0, src_size))),
            (pool.page_size, list(pages[:need])),
            orders=(src_order, pool.order),
        )
        planned = Planned(
            req.rid, req.prompt_len, pages[:need], generations[:need], int(runs[:, 2].sum())
        )
        unit = word_unit(shape.vector_bytes)
        # a run may cross this rank's pages (it joins neighbours adjacent on both sides):
        # cut at each page, so that a slice of pages takes all of each of its pages' bytes
        runs = split_at_pages(runs, pool.page_bytes)
        by_page = np.argsort(runs[:, 1] // pool.page_bytes, kind="stable")
        runs = runs[by_page]  # grouped by page once: a slice finds its pages' runs by bisection
        page_of = runs[:, 1] // pool.page_bytes

        def checksums_of(chunk: PageList) -> torch.Tensor:
            mine = runs[_rows_of(page_of, np.asarray(list(chunk), dtype=np.int64))]
            got, sums = region_checksums(pool.storage, mine, pool.page_bytes, unit, read=1)
            by_page = dict(zip(got.tolist(), sums.tolist(), strict=True))
            return torch.tensor([by_page.get(p, -1) for p in chunk], dtype=torch.int64)

        per_page = max(1, planned.bytes // max(1, need))
        return planned, checksums_of, max(1, CHECKSUM_SLICE_BYTES // per_page)

    def _landing_orders(self, req: OwnedRequest) -> set[Order]:
        """The orders ``req``'s writers lay its pages in as they land: a writer of this
        rank's page size writes its pages as they lie in its memory, any other writes runs
        into this rank's order (:func:`~kvferry.engine.reshard.page_for_page`)."""
        own = self.pool.page_format
        formats = [self._writer_format(w) for w in req.writers]
        return {f[1] if page_for_page(f, own) else own[1] for f in formats} or {own[1]}

    def _landed_order(self, req: OwnedRequest) -> Order:
        """The one order ``req``'s pages lie in once every writer's bytes landed (the
        writer list was checked for one at ASSIGN: :meth:`writers_mismatch`)."""
        (order,) = self._landing_orders(req)
        return order

    def _relayout_steps(self, req: OwnedRequest) -> Iterator[None]:
        """The prompt's pages, landed in their writers' order, turned into this pool's
        (:meth:`~kvferry.engine.pool.KVPool.relayout`), a slice of pages a step, after
        the checks passed (the checksums are of the bytes as they landed) and before
        decode reads a page: those no part's checks turned already (:meth:`_check_part`).
        Nothing to do when the writers lay pages as this pool does."""
        need = pages_needed(req.prompt_len, 0, self.pool.page_size)
        yield from self._turn(req, np.ones(need, dtype=bool))

    def _turn(self, req: OwnedRequest, ready: np.ndarray) -> Iterator[None]:
        """Turn the prompt's pages marked in ``ready`` (``[pages the prompt needs]``
        bool) that were not turned yet into this pool's order, a slice a step."""
        laid = self._landed_order(req)
        if laid is self.pool.order:
            return
        if req.turned is None:
            req.turned = np.zeros(len(ready), dtype=bool)
        todo = np.flatnonzero(ready & ~req.turned)
        pages = np.asarray(req.planned_rows[0][: len(ready)], dtype=np.int64)[todo]
        per_step = max(1, RELAYOUT_SLICE_BYTES // self.pool.page_bytes)
        for start in range(0, len(todo), per_step):
            self.pool.relayout(torch.from_numpy(pages[start : start + per_step]), laid)
            req.turned[todo[start : start + per_step]] = True
            yield

    def _writer_format(self, writer: int) -> tuple[int, Order]:
        """The writer's pages: (tokens per page, axis order), from its card (this rank's
        own where the card is not in yet)."""
        card = self.rt.cards.get(writer)
        return card.page_format if card is not None else self.pool.page_format

    def _planned(self, req: OwnedRequest, writer: int) -> tuple[Planned, torch.Tensor]:
        """What ``writer`` must write for ``req`` (the prompt's pages, for its heads), and
        the pool as those heads, laid as the writer lays its pages (what lands, page for
        page, until :meth:`_relayout_steps`)."""
        need = pages_needed(req.prompt_len, 0, self.pool.page_size)
        pages, generations = req.planned_rows
        lo, hi = self.heads_of(req, writer)
        view = self.pool.laid_as(self._writer_format(writer)[1], (lo, hi))
        slice_bytes = view[0].numel() * view.element_size()
        planned = Planned(
            req.rid, req.prompt_len, pages[:need], generations[:need], need * slice_bytes
        )
        return planned, view

    def writing_heads(self, writers: int) -> list[tuple[int, int]]:
        """The heads each of a request's ``writers`` writes into this rank's pool, in
        order and numbered in it: the members of a prefill group of ``prefill_tp`` that
        write into this member of its decode group (members sharing a head with an
        earlier one write nothing and are not listed: :class:`.topology.HeadSplit`)."""
        split = self.split or head_split(self.pool.kv_heads, self.prefill_tp or writers)
        return list(split.heads_into(self.position))

    def writers_mismatch(self, req: OwnedRequest) -> str | None:
        """Why ``req``'s writer list cannot be the writing members of one prefill group
        (the owner would wait for writers that never write, or check heads against the
        wrong ones), or None."""
        heads = self.writing_heads(len(req.writers))
        if len(heads) == len(req.writers) and len(set(req.writers)) == len(req.writers):
            orders = self._landing_orders(req)
            if len(orders) == 1:
                return None
            formats = [self._writer_format(w) for w in req.writers]
            return (
                f"writers {req.writers} lay their pages as {[(p, o.value) for p, o in formats]} "
                f"into pages of {self.pool.page_size} tokens laid {self.pool.order.value}: "
                f"they would land in {sorted(o.value for o in orders)} in one page "
                f"(one --prefill-kv-layout for every prefill rank)"
            )
        return (
            f"{len(req.writers)} writers {req.writers} listed, but a prefill group of "
            f"{self.prefill_tp or len(req.writers)} has {len(heads)} writing members for "
            f"{self.pool.kv_heads} KV heads"
        )

    def heads_of(self, req: OwnedRequest, writer: int) -> tuple[int, int]:
        """The KV heads ``writer`` writes into ``req``'s pages."""
        why = self.writers_mismatch(req)
        if why is not None:
            raise ValueError(f"request {req.rid}: {why}")
        return self.writing_heads(len(req.writers))[req.writers.index(writer)]

    @staticmethod
    def _per_step(view: torch.Tensor) -> int:
        return max(1, CHECKSUM_SLICE_BYTES // (view[0].numel() * view.element_size()))

    def verify_parts(self, req: OwnedRequest) -> None:
        """The pipelined path: check the notice parts that arrived (the part's pages and
        generations against the plan, their canaries and checksums), in slices, while the
        writers write the rest; CORRUPT on a mismatch. One run at a time per request:
        parts that arrive meanwhile join it. Of no use once the request left AWAITING
        (its notices are whole then, and checked whole)."""
        if not self.integrity:
            req.parts.clear()  # checks off: a part carries no checksums
            return
        if req.checking_parts:
            return
        req.checking_parts = True
        run_in_slices(
            self.rt,
            req.rid,
            self._part_steps(req),
            VERIFY_SLICE_S,
            wanted=lambda: req.state is OwnerState.AWAITING,
            then=lambda: None,
        )

    def _part_steps(self, req: OwnedRequest) -> Iterator[None]:
        try:
            while req.parts:
                yield from self._check_part(req, req.parts.pop(0))
        except IntegrityError as exc:
            req.error = f"integrity: {exc}"
            self.driver.feed(req, oc.on_part_corrupt(req.book))
        req.checking_parts = False

    def _check_part(self, req: OwnedRequest, part: NoticePart) -> Iterator[None]:
        planned, view = self._planned(req, part.writer)
        at = part.offset
        mine = check_part(planned, part.writer, at, part.pages, part.generations, part.checksums)
        check_canaries(
            mine, self.canaries.rows(part.pages), index=np.arange(at, at + len(part.pages))
        )
        notice = VerifyNotice(
            part.writer, req.prompt_len, part.pages, part.generations, part.checksums, mine.bytes
        )
        yield from checksum_steps(
            mine, notice, functools.partial(page_checksums, view), self._per_step(view)
        )
        if part.writer not in req.part_checked:
            total = len(planned.pages)
            req.part_checked[part.writer] = (np.zeros(total, bool), np.zeros(total, np.int64))
        mask, sums = req.part_checked[part.writer]
        mask[at : at + len(part.pages)] = True
        sums[at : at + len(part.pages)] = part.checksums
        # Pages every writer's parts checked are final (each part's notice follows its
        # flush): turned now, while later parts are in flight, not all after the last.
        laid_apart = self._landed_order(req) is not self.pool.order
        if laid_apart and all(w in req.part_checked for w in req.writers):
            masks = [req.part_checked[w][0] for w in req.writers]
            yield from self._turn(req, np.logical_and.reduce(masks))

    # -------------------------------------------------------------- decoding
    def page_table(self, batch: list[OwnedRequest]) -> torch.Tensor:
        """``[batch, width]`` int32: each request's pages, padded (never read past its
        sequence)."""
        width = max(len(r.grants) for r in batch)
        table = np.empty((len(batch), width), dtype=np.int32)
        for i, r in enumerate(batch):
            pages = r.page_row
            table[i, : len(pages)] = pages
            table[i, len(pages) :] = pages[0]
        return torch.from_numpy(table)

    def still_owned(
        self,
        batch: list[OwnedRequest],
        table: torch.Tensor,
        *,
        written_only: bool = False,
        checked: PageOwnership | None = None,
    ) -> list[int]:
        """The indices in ``batch`` of the requests whose every page about to be read
        (prompt and answer so far, and the position this step writes) still carries their
        canary; each other one fails with the I5 error, before this step gives it a token.

        By default the torch reference checks every such page now, before the step (the
        CPU path). On CUDA the decode kernel checks the pages as it reads them: before the
        step only the page each request's step writes is checked here (``written_only``:
        one canary row per request, so no step writes a token into a page that is not
        its request's), and after it ``checked`` holds the flags the kernel raised, read
        here (one sync) and acted on the same way."""
        from kvferry.engine.kernels import ownership as kinds

        if checked is None:
            gens = torch.zeros(table.shape, dtype=torch.int64)
            for i, r in enumerate(batch):
                gens[i, : len(r.grants)] = r.generation_row
            rids = torch.tensor([r.rid_hash for r in batch], dtype=torch.int64)
            checked = PageOwnership.create(self.canaries.table, rids, gens)
            seq_lens = torch.tensor([r.prompt_len + len(r.generated) for r in batch])
            num_pages = self.pool.num_pages
            if not written_only:
                check_ownership_reference(table, seq_lens, self.pool.page_size, num_pages, checked)
            else:
                width = table.shape[1]
                index = (seq_lens - 1) // self.pool.page_size  # the logical page written
                col = index.clamp(max=width - 1)
                rows = torch.arange(len(batch))
                page = table[rows, col].to(torch.int64)
                outside = (page < 0) | (page >= num_pages)
                canary = checked.canaries[page.clamp(0, num_pages - 1)]
                bits = (
                    torch.where(canary[:, 0] != rids, kinds.FOREIGN_REQUEST, 0)
                    | torch.where(canary[:, 1] != gens[rows, col], kinds.STALE_GENERATION, 0)
                    | torch.where(canary[:, 2] != index, kinds.WRONG_INDEX, 0)
                )
                bits = torch.where(outside, kinds.OUT_OF_POOL, bits)
                bits = torch.where(index >= width, kinds.BEYOND_TABLE, bits)
                checked.errors |= bits.to(torch.int32)
                first_page = index.clamp(max=width)  # as the reference: the width when beyond
                checked.first_bad.copy_(torch.where(bits != 0, first_page, checked.first_bad))
        failures = checked.failures()
        bad = {b for b, _, _ in failures}
        for b, bits_set, first in failures:
            r = batch[b]
            page_id = r.pages[first] if first < len(r.pages) else "-"
            exc = IntegrityError(
                r.rid,
                f"page ownership check at decode step "
                f"{len(r.generated)}: {describe_kinds(bits_set)} (logical "
                f"page {first}, page {page_id})",
            )
            r.error = f"integrity: {exc}"
            self.driver.feed(r, OwnerEvent.CORRUPT)  # every writer noticed: nothing more can land
        return [i for i in range(len(batch)) if i not in bad]

    def step(self, batch: list[OwnedRequest]) -> None:
        """One decode step, its three parts in a row (see :meth:`plan_step`)."""
        plan = self.plan_step(batch)
        if plan is not None:
            self.apply_step(plan, self.run_step(plan))

    def plan_step(self, batch: list[OwnedRequest]) -> StepPlan | None:
        """With integrity checks on, every page a request reads is checked against its
        canary: on the CPU by the torch reference here, before the step; when the pool's
        attention runs the kernels (CUDA) inside the step, in the same kernel pass that
        reads the pages (``ownership=`` through the model to the dispatcher), the flags
        read after the step (:meth:`apply_step`), each flagged request failed without
        its token."""
        from kvferry.engine.kernels import dispatch

        device = self.pool.kv.device
        table = self.page_table(batch)
        fused = self.integrity and dispatch.use_triton(self.pool.kv)
        if self.integrity:
            keep = (
                self.still_owned(batch, table, written_only=True)
                if fused
                else self.still_owned(batch, table)
            )
            if len(keep) < len(batch):
                if not keep:
                    return None
                batch, table = [batch[i] for i in keep], table[keep]
        step_args: dict[str, Any] = {}
        if fused:
            gens = torch.zeros(table.shape, dtype=torch.int64)
            for i, r in enumerate(batch):
                gens[i, : len(r.grants)] = r.generation_row
            rids = torch.tensor([r.rid_hash for r in batch], dtype=torch.int64)
            step_args["ownership"] = PageOwnership.create(self.canaries.on(device), rids, gens)
        return StepPlan(
            batch,
            table=table,
            positions=torch.tensor([r.next_position for r in batch]),
            inputs=torch.tensor([r.generated[-1] if r.generated else r.last_token for r in batch]),
            prompt_lens=torch.tensor([r.prompt_len for r in batch]),
            labels=[f"prompt_len={r.prompt_len}" for r in batch],
            step_args=step_args,
            fused=fused,
        )

    def run_step(self, plan: StepPlan) -> list[int] | None:
        """The model's step over the pool: reads only ``plan``'s tensors, the pool and the
        model (no request, book or message), so it may run on another thread."""
        if self.rt.faults.enabled:
            self.rt.faults.before_decode_step(plan.labels)
        device = self.pool.kv.device
        assert plan.table is not None  # a plan of this path's plan_step
        with torch.no_grad():
            out: list[int] = self.model.decode_step(
                self.pool.kv,
                plan.table.to(device),
                plan.positions,
                plan.inputs,
                plan.prompt_lens,
                **plan.step_args,
            ).tolist()
        return out

    def apply_step(self, plan: StepPlan, out: list[int] | None) -> None:
        assert out is not None and plan.table is not None
        batch = plan.batch
        if plan.fused:  # the kernel's flags: a flagged request fails and gets no token
            keep = self.still_owned(batch, plan.table, checked=plan.step_args["ownership"])
            if len(keep) < len(batch):
                batch, out = [batch[i] for i in keep], [out[i] for i in keep]
        for r, tok in zip(batch, out, strict=True):
            if r.state is not OwnerState.DECODING:
                continue  # ended while its step ran (its events waited for the step)
            self.emit(r, int(tok))

    def start_decode(self, req: OwnedRequest) -> None:
        """The prefill's first token goes out as soon as the pages are verified: the
        first step (at position ``prompt_len``, its input that token) then makes the
        second. Without one, the first step reads it from the pages."""
        if req.first_token is None:
            return
        self.emit(req, req.first_token)

    def emit(self, r: OwnedRequest, tok: int) -> None:
        """``tok`` is ``r``'s next token: TOKENS to the router (the first at once, then
        every ``TOKEN_FLUSH``), and FINISHED after the last."""
        r.generated.append(tok)
        r.unsent.append(tok)
        finished = len(r.generated) >= r.max_tokens or (
            self.model.stop_token is not None and tok == self.model.stop_token
        )
        if finished or len(r.unsent) >= TOKEN_FLUSH or len(r.generated) == 1:
            self.rt.send(
                self.router,
                m.TOKENS,
                rid=r.rid,
                offset=len(r.generated) - len(r.unsent),
                tokens=r.unsent,
            )
            r.unsent = []
        if finished:
            self.driver.feed(r, OwnerEvent.FINISHED)
