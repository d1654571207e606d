"""The prefill rank's data path: the prompt's KV computed into source pages, written
one-sided into the owner's planned pages, and the notice sent after a flush.

It is the writer driver's :class:`~kvferry.engine.protocol.ports.WriterDataPath` port:
each call starts work, and what came of it goes back to the driver as an event
(``KV_READY``, a batch settling, ``NOTICE_FLUSHED``, a failure). It moves no book itself,
except the count of batches in flight the table's ``on_posted``/``on_settled`` keep.

The fault layer's protocol points (``before-write``, ``mid-transfer``, ``after-write``,
``prefill``, ``after-notice``) are asked here, on the path they interrupt.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvferry.engine.integrity import page_checksums
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol import writer as core
from kvferry.engine.protocol.ports import Clock
from kvferry.engine.protocol.words import AbortSource
from kvferry.engine.protocol.writer import WriterEvent, WriterState
from kvferry.engine.reshard import (
    KVShape,
    Order,
    heads_between_pools,
    page_for_page,
    page_runs,
    span_geometry,
)
from kvferry.engine.run_checksum import region_checksums, split_at_pages, word_unit
from kvferry.engine.stepwise import chunk_bounds, kv_token_bytes
from kvferry.transfer import Batch, BatchStatus, Segment, TransferError
from kvferry.transfer.wire import Message

from . import messages as m
from .batching import BatchSizer
from .chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK, Reassembly, spans
from .faults import Decision, PointDecision
from .sliced import run_in_slices
from .stepahead import StepAhead

if TYPE_CHECKING:
    from kvferry.engine.protocol.writer_driver import WriterDriver

    from .prefill import WriteJob
    from .runtime import RankRuntime

log = logging.getLogger("kvferry.cluster")

PREFILL_SLICE_S = 0.001  # longest a prefill computes before the loop polls again
CHECKSUM_SLICE_BYTES = 32 << 20  # pages checksummed per step

COMPUTING = (WriterState.COMPUTING, WriterState.COMPUTING_PLANNED)


class WritePath:
    """What every writer's data path shares, the service's and the simulator's: the
    plan's check, batch bookkeeping, the notice and the events they feed."""

    rt: Any  # the rank's runtime (RankRuntime, or the simulator's)
    clock: Clock
    batches: BatchSizer
    row_bytes: int  # bytes of one page this writer sends
    driver: WriterDriver  # set by the rank that hosts this path

    def bind(self, driver: WriterDriver) -> None:
        self.driver = driver

    # -------------------------------------------------------------- the port
    def take_prompt(self, job: WriteJob, msg: Message) -> bool:
        """Add a PREFILL chunk; True once the prompt is whole (``job.tokens`` set)."""
        raise NotImplementedError

    def pages_for(self, tokens: int) -> int:
        """Source pages a prompt of ``tokens`` tokens takes."""
        raise NotImplementedError

    def start_prefill(self, job: WriteJob) -> None:
        raise NotImplementedError

    def post_writes(self, job: WriteJob) -> None:
        raise NotImplementedError

    def post_next(self, job: WriteJob) -> None:
        self._post_next(job)

    def post_part(self, job: WriteJob) -> None:
        raise NotImplementedError(f"request {job.rid}: this path writes no parts")

    def send_part(self, job: WriteJob) -> None:
        raise NotImplementedError(f"request {job.rid}: this path writes no parts")

    def send_notice(self, job: WriteJob) -> None:
        self._send_notice(job)

    def stop_posting(self, job: WriteJob) -> None:
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        job.queue, job.writes_due = None, False

    def finished(self, job: WriteJob) -> None:
        """The job reached DONE (its notice flushed)."""

    # -------------------------------------------------------------- shared parts
    def _plan_covers(self, job: WriteJob) -> bool:
        """The owner's plan has a page for every source page; else the job fails."""
        assert job.tokens is not None and job.dst_pages is not None
        needed = self.dst_pages_needed(job)
        if len(job.dst_pages) >= needed:
            return True
        self.driver.fail(
            job,
            AbortSource.PREFILL,
            f"plan holds {len(job.dst_pages)} pages but the prompt of "
            f"{len(job.tokens)} tokens needs {needed}",
        )
        return False

    def _post(self, job: WriteJob, rows: np.ndarray) -> Any:
        """Post ``rows`` of the job's queue as one batch; the batch."""
        raise NotImplementedError

    def dst_pages_needed(self, job: WriteJob) -> int:
        """The owner's pages the prompt fills (as many as the source's, same page size)."""
        return len(job.src_pages)

    def _post_next(self, job: WriteJob) -> bool:
        """Post the next bounded batch of this job (one at a time, so an abort stops
        posting within one batch). False if posting failed (the job is failed)."""
        if not job.queued():
            return True
        assert job.queue is not None
        rows = max(1, self.batches.batch_bytes(job.owner) // self.run_bytes(job))
        chunk, job.queue = job.queue[:rows], job.queue[rows:]
        nbytes, posted_at = self._batch_bytes(chunk), self.clock.now()
        try:
            batch = self._post(job, chunk)
        except TransferError as exc:
            self.driver.fail(job, AbortSource.TRANSFER, f"write to rank {job.owner} refused: {exc}")
            return False
        core.on_posted(job.book)

        def written(b: Batch) -> None:
            self.batches.settled(job.owner, nbytes, self.clock.now() - posted_at)
            self._on_written(job, b)

        self.rt.watch(batch, written, rid=job.rid)
        return True

    def run_bytes(self, job: WriteJob) -> int:
        """Bytes of one row of the job's queue (a batch takes a whole number of rows)."""
        return self.row_bytes

    def _batch_bytes(self, rows: np.ndarray) -> int:
        return int(rows[:, 2].sum())

    @staticmethod
    def _writes_waiting(job: WriteJob) -> bool:
        """Rows queued, or writes asked for and not queued yet (held before they are
        posted, by a pause): a batch that lands meanwhile is not the last (a notice then
        would name pages never written)."""
        return job.queued() or job.writes_due

    def _on_written(self, job: WriteJob, batch: Any) -> None:
        ok = batch.status() is BatchStatus.COMPLETED
        if not ok and batch.reading():
            # Failed with puts of it still outstanding: they may read the source pages
            # yet, so the job (and the pages' release after it) goes on at the first pump
            # after they ended.
            self.rt.watch(_PutsEnded(batch), lambda _: self._on_written(job, batch), rid=job.rid)
            return
        event = core.on_settled(job.book, ok, self._writes_waiting(job))
        if not ok and job.state in (WriterState.WRITING, WriterState.COMPUTING_PLANNED):
            job.abort_source = AbortSource.TRANSFER
            job.abort_reason = f"write to rank {job.owner} failed: {batch.error}"
        self.driver.feed(job, event)

    def _send_notice(self, job: WriteJob) -> None:
        """The NOTICE, in chunks of ``PAGES_PER_CHUNK`` pages, each sent with ``notify``
        (after a flush): any chunk that arrives proves every write landed."""
        assert job.tokens is not None and job.dst_pages is not None
        assert job.dst_generations is not None
        sent = job.sent_pages
        checksums = job.checksums[:sent]
        notice = None
        for lo, hi in spans(sent, PAGES_PER_CHUNK):
            notice = self.rt.notify(
                job.owner,
                m.NOTICE,
                rid=job.rid,
                tokens=len(job.tokens),
                offset=lo,
                total=sent,
                pages=job.dst_pages[lo:hi],
                generations=job.dst_generations[lo:hi],
                checksums=checksums[lo:hi],
                bytes=job.posted_bytes,
                prefill_ms=job.prefill_ms,
                first_token=job.first_token,
            )
            if notice is None:
                self.driver.fail(
                    job, AbortSource.TRANSFER, f"notice to rank {job.owner} could not be sent"
                )
                return
        if notice is not None:
            self.rt.watch(notice, lambda b: self._notice_settled(job, b), rid=job.rid)

    def _notice_settled(self, job: WriteJob, notice: Any) -> None:
        self.driver.notice_settled(
            job,
            notice.status() is BatchStatus.COMPLETED,
            f"notice to rank {job.owner} failed to flush: {notice.error}",
        )


@dataclass(frozen=True)
class _PutsEnded:
    """What a failed batch whose puts may still read its local pages is watched as
    (:meth:`RankRuntime.watch` polls it each pump): pending until none is outstanding."""

    batch: Any

    def peek(self) -> BatchStatus:
        return BatchStatus.PENDING if self.batch.reading() else self.batch.peek()


@dataclass(frozen=True)
class Route:
    """What a writer writes into one owner: its heads ``heads`` (the model's numbering),
    into a pool that holds heads ``dst_heads`` (all of them, or a decode member's share)."""

    heads: tuple[int, int]
    dst_heads: tuple[int, int]


@dataclass(frozen=True)
class _Runs:
    """One page's runs of a route (same page size on both sides): offsets in the page at
    the source (from the pool's storage) and the destination, and lengths, ``[r]`` int64
    each; the owner's page bytes."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    dst_page_bytes: int

    @property
    def row_bytes(self) -> int:
        return int(self.length[0])


class PrefillPath(WritePath):
    """The service's path: the model computes the KV of this writer's heads into its
    pool, the transfer engine writes them into the owner's pool."""

    def __init__(
        self,
        runtime: RankRuntime,
        model: Any,
        pool: KVPool,
        segment: Segment | None,
        head_range: tuple[int, int],
        *,
        clock: Clock,
        integrity: bool = True,
        prefill_slice_s: float = PREFILL_SLICE_S,
        batches: BatchSizer,
        routes: Callable[[int], Route] | None = None,
    ) -> None:
        self.rt = runtime
        self.model = model
        self.pool = pool
        self.segment = segment
        self.clock = clock
        self.integrity = integrity
        self.prefill_slice_s = prefill_slice_s
        self.batches = batches
        # owner rank -> what this writer writes there (default: its heads, into a pool
        # of every head); a writer into a decode group has one route per member
        self.head_range = head_range  # every head it computes (all of its routes')
        self._route_of = routes or (lambda owner: Route(head_range, (0, pool.kv_heads)))
        self._prefills: dict[str, _Prefill] = {}  # by share: one prompt's prefill run
        self._routes: dict[int, Route] = {}  # by owner rank
        self._page_runs: dict[Route, _Runs] = {}
        self._src_base = int(pool.storage.storage_offset()) * pool.storage.element_size()
        self.step_ahead = True  # a long prompt's next step computes while a part posts
        self._ahead: cf.Executor | None = None

    # -------------------------------------------------------------- routes
    def route(self, job: WriteJob) -> Route:
        """What this writer writes into the job's owner: which heads, into a pool of which
        heads (raises ValueError, naming both, for an owner it writes nothing into)."""
        route = self._routes.get(job.owner)
        if route is None:
            route = self._routes[job.owner] = self._route_of(job.owner)
        return route

    def _runs(self, route: Route) -> _Runs:
        """The route's runs of one page, planned once."""
        runs = self._page_runs.get(route)
        if runs is None:
            shape = self._kv_shape()
            page_size, order = self.pool.page_format  # the owner's pages land in this order
            pattern = page_runs(shape, page_size, route.heads, route.dst_heads, order)
            dst_bytes = span_geometry(shape, page_size, route.dst_heads, order).page_bytes
            runs = self._page_runs[route] = _Runs(
                pattern[:, 0] + self._src_base,
                pattern[:, 1].copy(),
                pattern[:, 2].copy(),
                dst_bytes,
            )
        return runs

    def _job_runs(self, job: WriteJob) -> _Runs:
        return self._runs(self.route(job))

    def run_bytes(self, job: WriteJob) -> int:
        return self._job_runs(job).row_bytes

    # -------------------------------------------------------------- reshaped writes
    def _owner_format(self, job: WriteJob) -> tuple[int, Order]:
        """The owner's pages: (tokens per page, axis order), from its card (this
        writer's own where the card is not in yet)."""
        card = self.rt.cards.get(job.owner)
        return card.page_format if card is not None else self.pool.page_format

    def reshaped(self, job: WriteJob) -> bool:
        """The owner's pages hold another number of tokens than this writer's
        (:func:`~kvferry.engine.reshard.page_for_page`): the prompt goes as runs planned once
        (:func:`~kvferry.engine.reshard.heads_between_pools`), checksummed per destination
        page (:mod:`~kvferry.engine.run_checksum`), in one part (no pipelining). Else it
        goes page for page as its pages lie in this writer's memory, whatever the owner's
        order (the owner turns them into its own after its checks)."""
        return not page_for_page(self.pool.page_format, self._owner_format(job))

    def dst_pages_needed(self, job: WriteJob) -> int:
        assert job.tokens is not None
        if not self.reshaped(job):
            return len(job.src_pages)
        return -(-len(job.tokens) // self._owner_format(job)[0])

    def _kv_shape(self) -> KVShape:
        pool = self.pool
        return KVShape(pool.layers, pool.kv_heads, pool.head_dim, pool.kv.element_size())

    def _runs_into(self, job: WriteJob, dst_pages: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[n, 3]`` runs of this writer's heads of the whole prompt into ``dst_pages``."""
        assert job.tokens is not None
        route = self.route(job)
        page_size, order = self._owner_format(job)
        return heads_between_pools(
            self._kv_shape(),
            route.heads,
            len(job.tokens),
            (self.pool.page_size, job.src_pages),
            (page_size, dst_pages),
            dst_heads=route.dst_heads,
            orders=(self.pool.order, order),
        )

    def _dst_page_bytes(self, job: WriteJob) -> int:
        page_size, order = self._owner_format(job)
        return span_geometry(
            self._kv_shape(), page_size, self.route(job).dst_heads, order
        ).page_bytes

    def _planned_runs(self, job: WriteJob) -> np.ndarray:
        """The job's runs into the owner's pages 0, 1, ... (standing for the plan's: the
        page numbers change no value), cut at those pages; planned once per job, for its
        checksums and then its writes (:meth:`_runs_into_plan`)."""
        if job.runs is None:
            needed = self.dst_pages_needed(job)
            runs = self._runs_into(job, list(range(needed)))
            job.runs = split_at_pages(runs, self._dst_page_bytes(job))
        return job.runs

    def _runs_into_plan(self, job: WriteJob, needed: int) -> np.ndarray:
        """The job's runs into the plan's first ``needed`` pages: its planned runs, each
        placed in the plan's page in place (contiguous neighbours join again when posted);
        the job keeps them no longer."""
        assert job.dst_pages is not None
        runs, job.runs = self._planned_runs(job), None
        page_bytes = self._dst_page_bytes(job)
        page, within = np.divmod(runs[:, 1], page_bytes)
        runs[:, 1] = np.asarray(job.dst_pages[:needed], dtype=np.int64)[page] * page_bytes + within
        return runs

    def _region_checksums(self, job: WriteJob) -> np.ndarray:
        """Per destination page of the prompt, in order, the checksum of what this writer
        writes into it; the page numbers do not change the values, so they are taken
        before the plan is in (pages 0, 1, ... stand for the plan's)."""
        needed = self.dst_pages_needed(job)
        runs = self._planned_runs(job)
        dst_page_bytes = self._dst_page_bytes(job)
        unit = word_unit(self._kv_shape().vector_bytes)
        pages, sums = region_checksums(self.pool.storage, runs, dst_page_bytes, unit, read=0)
        if pages.tolist() != list(range(needed)):  # pragma: no cover - the plan covers each
            raise AssertionError(f"request {job.rid}: regions of pages {pages.tolist()[:8]}")
        return np.asarray(sums, dtype=np.int64)

    # -------------------------------------------------------------- faults
    def at_point(self, job: WriteJob, point: str, then: Callable[[WriteJob], Any]) -> None:
        """Ask the fault layer at ``point``; then go on (now, or after an injected pause,
        unless the job moved on meanwhile)."""
        state = job.state
        decision: PointDecision = self.rt.faults.at_point(point, job.rid, job.tokens)
        if decision.decision is Decision.GO:
            then(job)
        elif decision.decision is Decision.PAUSE:

            def resume() -> None:
                job.timer = None
                if job.state is state:
                    then(job)

            job.timer = self.rt.call_later(decision.seconds, resume, rid=job.rid)
        else:
            source = (
                AbortSource.PREFILL
                if decision.decision is Decision.FAIL_PREFILL
                else AbortSource.TRANSFER
            )
            self.driver.fail(job, source, f"injected fail-{source.value} at {point}")

    def finished(self, job: WriteJob) -> None:
        if self.rt.faults.enabled:
            self.at_point(job, "after-notice", lambda j: None)  # the notice flushed

    # -------------------------------------------------------------- the prompt
    def take_prompt(self, job: WriteJob, msg: Message) -> bool:
        if job.prompt_parts is None:
            job.prompt_parts = Reassembly(job.rid, "PREFILL", msg.total, TOKENS_PER_CHUNK)
        chunk = np.frombuffer(msg.tokens, dtype="<i4")
        if not job.prompt_parts.add(msg.offset, msg.total, chunk):  # type: ignore[arg-type]
            return False
        job.tokens, job.prompt_parts = job.prompt_parts.joined_array(), None
        return True

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.page_size)

    # -------------------------------------------------------------- prefill
    def start_prefill(self, job: WriteJob) -> None:
        """Compute the prompt's KV, once per share: a writer into several members of a
        decode group holds one prompt's pages for all of them (see
        :class:`~.ports.SharedSource`), and a job joins the run its share already has.
        Every job still computing hears each part (KV_PART) and the end (KV_READY)."""
        assert job.tokens is not None
        job.prefill_started = self.clock.now()
        for share in [k for k, run in self._prefills.items() if run.ended()]:
            del self._prefills[share]
        run = self._prefills.get(job.share)
        if run is None:
            run = self._prefills[job.share] = _Prefill(
                _FinalPages(self.model, len(job.tokens), self.pool.kv)
            )
            run.jobs.append(job)
            # The prefill and the checksums run in slices (see .sliced): an ABORT that
            # arrives during a long prefill waits for about one slice and one step (a
            # layer, or a chunk of a long prompt's tokens), not the whole prefill; a fast
            # one never yields.
            run_in_slices(
                self.rt,
                job.share,  # an exception fails every job still waiting for it
                self._prefill_steps(run),
                self.prefill_slice_s,
                wanted=run.wanted,
                then=lambda: self._kv_ready(run),
            )
            return
        if run.stopped:
            self.driver.fail(
                job,
                AbortSource.PREFILL,
                f"the prefill it shares with {sorted(j.rid for j in run.jobs)} was stopped "
                "by their aborts",
            )
            return
        run.jobs.append(job)
        job.final_pages = run.fed_pages if not self.reshaped(job) else 0
        if run.finished:  # joined after the run's end: only its own checksums are left
            job.prefill_ms, job.first_token = run.prefill_ms, run.first_token
            run_in_slices(
                self.rt,
                job.rid,
                self._checksum_steps(job),
                self.prefill_slice_s,
                wanted=lambda: job.state in COMPUTING,
                then=lambda: self.driver.feed(job, WriterEvent.KV_READY),
            )

    def solo_steps(self, job: WriteJob) -> Iterator[None]:
        """One computing job's prefill and checksums alone, as steps (what the
        simulator's calibration times)."""
        assert job.tokens is not None
        run = _Prefill(_FinalPages(self.model, len(job.tokens), self.pool.kv))
        run.jobs.append(job)
        return self._prefill_steps(run)

    def _ahead_pool(self) -> cf.Executor | None:
        """The thread a prefill's next step runs on while a part is posted
        (:mod:`.stepahead`), made at the first long prompt; None on a single CPU."""
        if self._ahead is None and self.step_ahead and len(os.sched_getaffinity(0)) > 1:
            self._ahead = cf.ThreadPoolExecutor(1, thread_name_prefix="kvferry-step-ahead")
        return self._ahead

    def _kv_ready(self, run: _Prefill) -> None:
        """KV_READY to each job of the run still computing, each under its own id: an
        exception in one job's effects (its writes, say) fails that job, not the share
        the run is named by (which may be another job's id, or none's)."""
        for job in run.checksummed:
            if job.state in COMPUTING:
                self.rt.run_for(
                    job.rid,
                    "KV ready",
                    functools.partial(self.driver.feed, job, WriterEvent.KV_READY),
                )

    def _prefill_steps(self, run: _Prefill) -> Iterator[None]:
        """The prefill, one model step at a time (the model yields a layer's index once
        that layer's KV is in the pages, None between chunks of a layer), to its end: it
        returns the answer's first token, which the notice carries; then, per job, the
        checksums the owner will check what lands against (I5), a slice of pages a
        step."""
        first = run.jobs[0]
        assert first.tokens is not None
        layers = self.model.prefill_layers(
            self.pool.kv,
            torch.from_numpy(first.tokens.astype(np.int64)),
            first.src_pages,
            head_range=self.head_range,
        )
        final = run.final
        faults = self.rt.faults
        if faults.enabled:  # until the plan is in (or the end), where a fault asks for it
            waits = [j for j in run.jobs if faults.plan_first(j.rid, j.tokens)]
            while any(j.state is WriterState.COMPUTING for j in waits):
                yield
            if not run.wanted():
                return
        computing = 0.0  # the model's time alone, not the parts posted between its steps
        steps = StepAhead(layers, self.clock, self._ahead_pool())
        while True:
            step = steps.take()
            computing += step.seconds
            if step.ended:
                run.first_token = step.value
                break
            layer = step.yielded
            if layer is None and final.after(layer) > run.fed_pages:  # a part is ready
                run.fed_pages = final.pages
                steps.start()  # the next piece computes while this part is posted
                try:
                    for job in run.computing():
                        if not self.reshaped(job):
                            job.final_pages = final.pages
                            self.driver.feed(job, WriterEvent.KV_PART)
                finally:
                    steps.settle()  # ended before the rank's loop handles anything
                if not run.wanted():
                    return
            yield
            if layer == 0 and faults.enabled:
                for job in run.computing():
                    self.at_point(job, "prefill", lambda j: None)
                if not run.wanted():
                    return
            if layer is not None:
                final.after(layer)
        run.prefill_ms = 1e3 * computing
        i = 0
        while i < len(run.jobs):  # a job that joins meanwhile is appended: it is seen too
            job = run.jobs[i]
            i += 1
            if job.state in COMPUTING:
                job.prefill_ms, job.first_token = run.prefill_ms, run.first_token
                yield from self._checksum_steps(job)
                run.checksummed.append(job)
        run.finished = True  # a job that joins from now on checksums on its own

    def _checksum_steps(self, job: WriteJob) -> Iterator[None]:
        """The job's checksums of its pages not yet checksummed (those posted in parts
        were then), a slice of pages a step."""
        if not self.integrity:
            return
        if self.reshaped(job):
            job.checksums = self._region_checksums(job)
            yield
            return
        view = self._view(job)
        per_step = max(1, CHECKSUM_SLICE_BYTES // (view[0].numel() * view.element_size()))
        for start in range(len(job.checksums), len(job.src_pages), per_step):
            if job.state not in COMPUTING:
                return
            job.checksums = np.concatenate(
                [job.checksums, self._checksums(job, start, start + per_step)]
            )
            yield

    def _view(self, job: WriteJob) -> torch.Tensor:
        """The pool as the heads this writer sends the job's owner, laid as in its memory
        (:meth:`~kvferry.engine.pool.KVPool.laid_as`): what it checksums."""
        return self.pool.laid_as(self.pool.order, self.route(job).heads)

    def _checksums(self, job: WriteJob, lo: int, hi: int) -> np.ndarray:
        """The checksums of the job's source pages ``[lo, hi)`` as the owner will find
        them in its pages (I5). A share of the heads into a member that holds exactly
        those heads fills each of its pages with the route's runs in order: their region
        checksums (:mod:`~kvferry.engine.run_checksum`, read in place) are those pages'.
        Else the checksums of the pool's view of the route's heads (a dense copy first
        when the view is not dense: :func:`~kvferry.engine.integrity.page_checksums`)."""
        route = self.route(job)
        if route.heads == (0, self.pool.kv_heads) or route.heads != route.dst_heads:
            return page_checksums(self._view(job), job.src_pages[lo:hi]).cpu().numpy()
        src = job.src_pages[lo:hi]
        n = len(src)  # the regions are pages 0 .. n-1; the pool is read from its first byte
        triples = self._route_runs(job, src, np.arange(n))
        triples[:, 0] -= self._src_base
        unit = word_unit(self._kv_shape().vector_bytes)
        dst_page_bytes = self._job_runs(job).dst_page_bytes
        pages, sums = region_checksums(self.pool.storage, triples, dst_page_bytes, unit)
        assert len(pages) == n, f"request {job.rid}: {len(pages)} regions of {n}"
        return np.asarray(sums, dtype=np.int64)

    # -------------------------------------------------------------- writing
    def _triples(self, job: WriteJob, lo: int, hi: int) -> np.ndarray:
        """``[pages x runs, 3]`` int64: (local offset, remote offset, length) of every run
        of this writer's heads in its pages ``[lo, hi)``, into the owner's pages (whose
        page may hold fewer heads: a member of a decode group)."""
        assert job.dst_pages is not None
        return self._route_runs(job, job.src_pages[lo:hi], job.dst_pages[lo:hi])

    def _route_runs(
        self, job: WriteJob, src_pages: Sequence[int], dst_pages: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """``[pages x runs, 3]`` int64: the route's runs of one page, repeated for each
        (source page, destination page) pair; local offsets from the pool's storage."""
        runs = self._job_runs(job)
        src = np.asarray(src_pages, dtype=np.int64)
        dst = np.asarray(dst_pages, dtype=np.int64)
        local = (src[:, None] * self.pool.page_bytes + runs.src[None, :]).reshape(-1)
        remote = (dst[:, None] * runs.dst_page_bytes + runs.dst[None, :]).reshape(-1)
        lengths = np.broadcast_to(runs.length, (len(src), len(runs.length))).reshape(-1)
        return np.stack([local, remote, lengths], axis=1)

    def post_writes(self, job: WriteJob) -> None:
        job.writes_due = True  # until _post_writes queued them (after any pause here)
        self.at_point(job, "before-write", self._post_writes)

    def _post_writes(self, job: WriteJob) -> None:
        job.writes_due = False  # queued below, or the job fails
        if not self._plan_covers(job):
            return
        assert job.tokens is not None
        faults = self.rt.faults
        if not job.posted_pages:  # no part went before: the whole prompt goes now
            faults.tamper_source(
                job.rid, job.tokens, self.pool, job.src_pages, self.route(job).heads
            )
            job.sent_pages = faults.pages_to_write(job.rid, job.tokens, self.dst_pages_needed(job))
        job.part = None  # a part still in flight is covered by the notice now
        if job.posted_pages >= job.sent_pages:  # every page went in parts
            if not job.book.in_flight:
                self.driver.feed(job, WriterEvent.ALL_LANDED)
            return
        if self.reshaped(job):  # the owner's pages [0, sent): runs planned once
            assert job.dst_pages is not None and not job.posted_pages
            needed = self.dst_pages_needed(job)
            triples = self._runs_into_plan(job, needed)
            if job.sent_pages < needed:  # a short write (a fault): the first pages only
                page_bytes = self._dst_page_bytes(job)  # the runs are cut at its pages
                kept = np.isin(triples[:, 1] // page_bytes, job.dst_pages[: job.sent_pages])
                triples = triples[kept]
        else:
            triples = self._triples(job, job.posted_pages, job.sent_pages)
        job.posted_pages = job.sent_pages
        job.posted_bytes += int(triples[:, 2].sum())
        triples = self._behind_queued(job, triples)
        if job.book.in_flight:  # a part's batch: the rest follows it, one batch at a time
            job.queue = triples
            return
        held = self._hold_in_flight(job, triples, "mid-transfer")
        if not self._post_next(job) or held is None:
            return
        # The action injected at mid-transfer (a pause needs nothing more: the held half
        # is in flight and lands on its own).
        self.at_point(job, "mid-transfer", lambda j: None)

    def _behind_queued(self, job: WriteJob, triples: np.ndarray) -> np.ndarray:
        """``triples`` after the rows still queued: those of a part the prefill ended
        under, not yet posted (the notice names their pages, so they must land first)."""
        if not job.queued():
            return triples
        assert job.queue is not None
        return np.concatenate([job.queue, triples])

    def _hold_in_flight(self, job: WriteJob, triples: np.ndarray, point: str) -> Any:
        """Queue ``triples``, less what a fault injected at ``point`` holds in flight
        (watched as a posted batch: it counts in flight until it lands); the held write,
        or None."""
        assert job.tokens is not None
        job.queue, held = self.rt.faults.hold_in_flight(
            self.rt, job.rid, job.tokens, job.owner, self.segment, triples, point
        )
        if held is not None:
            core.on_posted(job.book)
            self.rt.watch(held, lambda b: self._on_written(job, b), rid=job.rid)
        return held

    def _post(self, job: WriteJob, rows: np.ndarray) -> Any:
        return self.rt.write(job.owner, self.segment, rows, rid=job.rid, incarnation=job.owner_inc)

    def send_notice(self, job: WriteJob) -> None:
        self.at_point(job, "after-write", self._send_notice)

    # -------------------------------------------------------------- the pipelined path
    def post_part(self, job: WriteJob) -> None:
        """Post the pages final since the last part, checksummed now, unless a part is
        in flight (they go with the next one, once it landed). The first part fixes how
        many pages are written at all (the plan must cover them)."""
        if job.part is not None or job.queued() or job.book.in_flight:
            return
        assert job.tokens is not None
        if not job.posted_pages:
            if not self._plan_covers(job):
                return
            job.sent_pages = self.rt.faults.pages_to_write(job.rid, job.tokens, len(job.src_pages))
        lo, hi = job.posted_pages, min(job.final_pages, job.sent_pages)
        if hi <= lo:
            return
        if self.integrity:
            if len(job.checksums) != lo:  # each page is checksummed once, in order
                raise AssertionError(
                    f"request {job.rid}: part [{lo}, {hi}) to post, but {len(job.checksums)} "
                    "pages checksummed"
                )
            job.checksums = np.concatenate([job.checksums, self._checksums(job, lo, hi)])
        faults = self.rt.faults
        if faults.enabled and lo == 0:  # corrupt-page: the first part carries the damage
            heads = self.route(job).heads
            faults.tamper_source(job.rid, job.tokens, self.pool, job.src_pages[lo:hi], heads)
        triples = self._triples(job, lo, hi)
        job.posted_bytes += int(triples[:, 2].sum())
        job.posted_pages, job.part, job.queue = hi, (lo, hi), triples
        mid_pipeline = faults.enabled and lo == 0  # the first part, half of it in flight
        if mid_pipeline:
            self._hold_in_flight(job, triples, "mid-pipeline")
        if self._post_next(job) and mid_pipeline:
            self.at_point(job, "mid-pipeline", lambda j: None)

    def send_part(self, job: WriteJob) -> None:
        """NOTICE_PART for the part that landed (in chunks of ``PAGES_PER_CHUNK``), each
        with notify: the owner checks those pages when it arrives."""
        assert job.part is not None and job.dst_pages is not None
        assert job.dst_generations is not None
        (lo, hi), job.part = job.part, None
        checksums = job.checksums[lo:hi] if self.integrity else job.checksums[:0]
        for a, b in spans(hi - lo, PAGES_PER_CHUNK):
            sent = self.rt.notify(
                job.owner,
                m.NOTICE_PART,
                rid=job.rid,
                offset=lo + a,
                pages=job.dst_pages[lo + a : lo + b],
                generations=job.dst_generations[lo + a : lo + b],
                checksums=checksums[a:b],
            )
            if sent is None:
                return  # the part is lost: the owner checks its pages with the notice


@dataclass
class _Prefill:
    """One prompt's prefill at this writer, shared by the jobs that write its KV (one per
    decode member the writer writes into; one job otherwise)."""

    final: _FinalPages
    jobs: list[WriteJob] = field(default_factory=list)
    fed_pages: int = 0  # final pages the jobs have heard of (KV_PART)
    checksummed: list[WriteJob] = field(default_factory=list)  # KV_READY goes to these
    finished: bool = False  # every layer's KV is in, its jobs' checksums are taken
    stopped: bool = False  # every job left computing before it was: it was given up
    prefill_ms: float | None = None
    first_token: int | None = None  # what the model's prefill returned

    def computing(self) -> list[WriteJob]:
        return [j for j in self.jobs if j.state in COMPUTING]

    def wanted(self) -> bool:
        """Some job still waits for it; once none does, it is given up for good."""
        if not self.stopped and not self.computing():
            self.stopped = True
        return not self.stopped

    def ended(self) -> bool:
        """Every job reached its end here (so every hold on its pages ended)."""
        return all(j.state in (WriterState.DONE, WriterState.ABORTED) for j in self.jobs)


class _FinalPages:
    """How many of a prompt's source pages are final while its prefill runs: every layer
    written. A model that writes in pieces of ``prefill_chunk_tokens`` tokens at most
    (the pieces of :func:`~kvferry.engine.stepwise.chunk_bounds`, each through every
    layer, yielding None after each layer of each piece but the last) makes a piece's
    pages final once its last layer is written, all through the prefill; one that does
    not chunk (``None``) makes them all final at once, with its last layer."""

    def __init__(self, model: Any, tokens: int, kv: torch.Tensor) -> None:
        chunk: int | None = model.prefill_chunk_tokens
        page_size = kv.shape[4]
        # the tokens written once each piece is, in every layer (the last: the prompt),
        # cut as the model cuts them over this pool
        pieces = chunk_bounds(tokens, chunk, kv_token_bytes(kv)) if chunk else []
        self.written = [hi for _, hi in pieces]
        self.layers = model.layers
        self.last_layer = model.layers - 1
        self.tokens, self.page_size = tokens, page_size
        self.layers_done = 0
        self.steps = 0  # None yields: a layer of a piece before the last
        self.pages = 0

    def after(self, yielded: int | None) -> int:
        """The count of final pages after the model yielded ``yielded``."""
        if yielded is None:
            self.steps += 1
        else:
            self.layers_done = yielded + 1
        pieces = self.steps // self.layers  # written in every layer
        if self.layers_done > self.last_layer:
            done = self.tokens
        elif self.written and pieces:
            done = self.written[min(pieces, len(self.written)) - 1]
        else:
            done = 0
        full = -(-done // self.page_size) if done == self.tokens else done // self.page_size
        self.pages = max(self.pages, full)
        return self.pages
