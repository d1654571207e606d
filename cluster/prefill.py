"""The prefill rank: a writer of the abort protocol.

Computes a prompt's KV (its share of the heads, under tensor parallelism) into its own
pool pages, writes them one-sided into the pages the decode owner planned, then sends the
completion notice with ``notify`` (flush first, so the notice arrives only after every
byte is visible at the owner).

Upholds:
- I2: a request id that reached a terminal state here is tombstoned; a late PREFILL or
  PLAN for it is ignored, so it never reaches transfer.
- I4, writer side: on ABORT it stops posting, then sends ABORT_ACK with ``notify`` (flush,
  then send), and holds its own source pages until that flush. A writer that never
  started, or already finished, acks at once; one still computing the prefill stops after
  the layer in progress (it polls between layers once a slice has passed).
- I6: a failure here aborts the request towards the owner and the router, with the reason.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from kvferry.engine.allocator import OutOfPages, PageAllocator
from kvferry.engine.integrity import page_checksums
from kvferry.engine.pool import KVPool, coalesce_runs
from kvferry.engine.tokenizer import decode as detokenize
from kvferry.transfer import Batch, BatchStatus, Segment, TransferError
from kvferry.transfer.wire import Message

from . import messages as m
from .batching import BatchSizer
from .books import RankBooks
from .chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK, Reassembly, spans
from .faults import InjectedFault
from .runtime import RankRuntime
from .sliced import run_in_slices

log = logging.getLogger("kvferry.cluster")

PREFILL_SLICE_S = 0.001   # longest a prefill computes before the loop polls again
CHECKSUM_SLICE_BYTES = 32 << 20   # pages checksummed per step


class WriterState(enum.Enum):
    WAITING = "waiting"        # has PREFILL or PLAN, not both
    WRITING = "writing"        # pages posted
    NOTIFYING = "notifying"    # notice posted (flush, then send)
    DONE = "done"              # notice flushed; source pages freed
    ABORTING = "aborting"      # ack posted after a flush
    ABORTED = "aborted"        # ack flushed; source pages freed


WRITER_TRANSITIONS: dict[WriterState, frozenset[WriterState]] = {
    WriterState.WAITING: frozenset({WriterState.WRITING, WriterState.ABORTING}),
    WriterState.WRITING: frozenset({WriterState.NOTIFYING, WriterState.ABORTING}),
    WriterState.NOTIFYING: frozenset({WriterState.DONE, WriterState.ABORTING}),
    WriterState.DONE: frozenset(),         # source pages freed; a late abort is acked at once
    WriterState.ABORTING: frozenset({WriterState.ABORTED}),
    WriterState.ABORTED: frozenset(),
}


@dataclass
class WriteJob:
    rid: str
    owner: int = -1
    owner_inc: int = 0
    tokens: np.ndarray | None = None       # int32 prompt tokens
    src_pages: list[int] = field(default_factory=list)
    dst_pages: list[int] | None = None
    dst_generations: list[int] | None = None
    checksums: list[int] = field(default_factory=list)
    state: WriterState = WriterState.WAITING
    text: str | None = None                # the prompt as text (fault hooks match on it)
    posted_bytes: int = 0
    sent_pages: int = 0                    # prompt pages written (all, unless a fault)
    timer: object | None = None            # an injected pause at a protocol point
    queue: np.ndarray | None = None        # (local, remote, length) rows not yet posted
    outstanding: int = 0                   # posted batches not yet settled
    held: np.ndarray | None = None         # injected fault: pages in flight, not landed
    held_timer: object | None = None
    held_target: int | None = None         # the owner's pool, mapped here (shared memory)
    acked: bool = False
    kv_ready: bool = False                 # prompt KV computed (and checksummed)
    prompt_parts: Reassembly | None = None  # PREFILL chunks so far
    plan_parts: Reassembly | None = None    # PLAN chunks so far
    prefill_started: float = 0.0
    prefill_ms: float | None = None

    def move(self, new: WriterState) -> None:
        if new not in WRITER_TRANSITIONS[self.state]:
            raise RuntimeError(f"request {self.rid}: writer cannot go from {self.state.value} "
                               f"to {new.value}")
        self.state = new


class PrefillRank(RankBooks):
    def __init__(self, runtime: RankRuntime, model, pool: KVPool, segment: Segment,
                 head_range: tuple[int, int], router: int, unsafe: bool = False,
                 max_batch_bytes: int = 256 << 20, integrity: bool = True,
                 prefill_slice_s: float = PREFILL_SLICE_S, batch_target_s: float = 0.5) -> None:
        self.rt = runtime
        self.model = model
        self.pool = pool
        self.segment = segment
        self.heads = head_range
        self.router = router
        self.unsafe = unsafe
        self.integrity = integrity and not unsafe
        self.prefill_slice_s = prefill_slice_s
        self.allocator = PageAllocator(pool.num_pages)
        self.jobs: dict[str, WriteJob] = {}
        self._init_books()
        runs = coalesce_runs(pool.head_slice_runs(0, *head_range))
        self._run_offsets = np.array([off for off, _ in runs], dtype=np.int64)
        self._run_lengths = np.array([n for _, n in runs], dtype=np.int64)
        self._row_bytes = int(self._run_lengths[0])
        self.batches = BatchSizer(target_s=batch_target_s, max_bytes=max_batch_bytes)
        runtime.set_handler(self.on_message)
        runtime.on_request_error = self.fail_request

    # -------------------------------------------------------------- messages
    def on_message(self, msg: Message) -> None:
        handler = {"PREFILL": self._on_prefill, "PLAN": self._on_plan,
                   "ABORT": self._on_abort}.get(msg.kind)
        if handler is None:
            log.warning("prefill rank %d: unexpected %s from rank %d", self.rt.rank, msg.kind, msg.src)
            return
        handler(msg)

    def _job(self, rid: str) -> WriteJob | None:
        if rid in self.tombstones:
            return None
        return self.jobs.setdefault(rid, WriteJob(rid))

    def _on_prefill(self, msg: Message) -> None:
        job = self._job(msg.rid)
        if job is None or job.tokens is not None:
            return
        if job.prompt_parts is None:
            job.owner, job.owner_inc = msg.owner, msg.owner_inc
            job.prompt_parts = Reassembly(job.rid, "PREFILL", msg.total, TOKENS_PER_CHUNK)
        if not job.prompt_parts.add(msg.offset, msg.total, np.frombuffer(msg.tokens, dtype="<i4")):
            return
        tokens, job.prompt_parts = job.prompt_parts.joined_array(), None
        need = -(-len(tokens) // self.pool.page_size)
        try:
            grants = self.allocator.allocate(job.rid, need)
        except OutOfPages as exc:
            self._fail(job, "prefill", f"prefill pool out of pages: {exc}")
            return
        self.allocations += 1
        job.tokens = tokens
        job.src_pages = [g.page for g in grants]
        job.prefill_started = time.monotonic()
        # The prefill and the checksums run in slices (see .sliced): an ABORT that arrives
        # during a long prefill waits for about one slice and one step (a layer, or a chunk
        # of a long prompt's tokens), not the whole prefill; a fast one never yields.
        run_in_slices(self.rt, job.rid, self._prefill_steps(job), self.prefill_slice_s,
                      wanted=lambda: job.state is WriterState.WAITING,
                      then=lambda: self._after_prefill(job))

    def _prefill_steps(self, job: WriteJob) -> Iterator[None]:
        """The prefill, one model step at a time (the model yields a layer's index once
        that layer's KV is in the pages, None between chunks of a layer), stopping once
        the last layer's KV is written (nothing after it is needed here); then the
        checksums the owner will check what lands against (I5), a slice of pages a step."""
        layers = self.model.prefill_layers(
            self.pool.kv, torch.from_numpy(job.tokens.astype(np.int64)), job.src_pages,
            head_range=self.heads)
        while True:
            with torch.no_grad():
                layer = next(layers, StopIteration)
            if layer is StopIteration:
                break
            yield
            if layer == 0 and self.rt.faults.enabled:
                self._reach(job, "prefill", lambda j: None)
            if layer is not None and layer + 1 >= self.model.layers:
                break
        job.prefill_ms = 1e3 * (time.monotonic() - job.prefill_started)
        if not self.integrity:
            return
        lo, hi = self.heads
        view = self.pool.kv[:, :, :, lo:hi]
        per_step = max(1, CHECKSUM_SLICE_BYTES // (view[0].numel() * view.element_size()))
        job.checksums = []
        for start in range(0, len(job.src_pages), per_step):
            job.checksums.extend(page_checksums(view, job.src_pages[start:start + per_step]).tolist())
            yield

    def _after_prefill(self, job: WriteJob) -> None:
        job.kv_ready = True
        self._maybe_write(job)

    def _on_plan(self, msg: Message) -> None:
        job = self._job(msg.rid)
        if job is None or job.dst_pages is not None:
            return
        if job.owner < 0:
            job.owner = msg.src
        elif job.owner != msg.src:
            log.warning("request %s: PLAN from rank %d, but its owner is rank %d; ignored",
                        msg.rid, msg.src, job.owner)
            return
        if job.plan_parts is None:
            job.plan_parts = Reassembly(job.rid, "PLAN", msg.total, PAGES_PER_CHUNK, width=2)
        if not job.plan_parts.add(msg.offset, msg.total, msg.pages, msg.generations):
            return
        (job.dst_pages, job.dst_generations), job.plan_parts = job.plan_parts.joined(), None
        self._maybe_write(job)

    # -------------------------------------------------------------- writing
    def _maybe_write(self, job: WriteJob) -> None:
        if job.state is not WriterState.WAITING or not job.kv_ready or job.dst_pages is None:
            return
        self._fault_text(job)
        if len(job.dst_pages) < len(job.src_pages):
            self._fail(job, "prefill", f"plan holds {len(job.dst_pages)} pages but the prompt "
                                       f"of {len(job.tokens)} tokens needs {len(job.src_pages)}")
            return
        self._reach(job, "before-write", self._post_writes)

    def _fault_text(self, job: WriteJob) -> str:
        """The prompt as text, which only fault hooks read (built once, and only with
        faults enabled)."""
        if job.text is None:
            job.text = (detokenize(job.tokens.tolist())
                        if self.rt.faults.enabled and job.tokens is not None else "")
        return job.text

    def _reach(self, job: WriteJob, point: str, then) -> None:
        """Run the fault action injected at ``point`` for this request (if any), then go on."""
        job.timer = None
        if job.state in (WriterState.ABORTING, WriterState.ABORTED):
            return
        found = self.rt.faults.at(point, self._fault_text(job))
        if found is None:
            then(job)
            return
        action, seconds = found
        log.warning("fault: request %s: %s at %s", job.rid, action, point)
        if action == "raise":
            raise InjectedFault(point)
        if action == "pause":
            job.timer = self.rt.call_later(seconds, lambda: then(job), rid=job.rid)
        elif action in ("fail-prefill", "fail-transfer"):
            self._fail(job, action.split("-")[1], f"injected {action} at {point}")
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"],
                             start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            then(job)

    def _triples(self, job: WriteJob) -> np.ndarray:
        pb = self.pool.page_bytes
        src = np.asarray(job.src_pages[:job.sent_pages], dtype=np.int64)
        dst = np.asarray(job.dst_pages[:len(src)], dtype=np.int64)
        local = (src[:, None] * pb + self._run_offsets[None, :]).reshape(-1)
        remote = (dst[:, None] * pb + self._run_offsets[None, :]).reshape(-1)
        lengths = np.broadcast_to(self._run_lengths, (len(src), len(self._run_lengths))).reshape(-1)
        return np.stack([local, remote, lengths], axis=1)

    def _post_writes(self, job: WriteJob) -> None:
        if job.state is not WriterState.WAITING:
            return
        if self.rt.faults.corrupts(job.text):
            # Negate the value vector of the first token (layer 0, first head of this
            # writer): the bytes on the wire no longer match the checksums sent.
            self.pool.kv[job.src_pages[0], 0, 1, self.heads[0], 0, :].neg_()
            log.warning("fault: request %s: corrupted the first token's values in source "
                        "page %d after its checksum", job.rid, job.src_pages[0])
        job.sent_pages = len(job.src_pages)
        if self.rt.faults.short_writes(job.text):
            # The incident's shape: a 1-page stub written and noticed for a whole prompt.
            job.sent_pages = 1
            log.warning("fault: request %s: writing 1 of its %d prompt pages", job.rid,
                        len(job.src_pages))
        triples = self._triples(job)
        job.posted_bytes = int(triples[:, 2].sum())
        job.move(WriterState.WRITING)
        mid = self.rt.faults.at("mid-transfer", job.text)
        if mid is not None and len(triples) > 1:
            half = len(triples) // 2
            job.queue = triples[:half]
            job.held = triples[half:]
            try:   # where an in-flight write lands even if endpoints change state meanwhile
                job.held_target = self.rt.remote_segment(job.owner).direct
            except TransferError:
                job.held_target = None
            job.held_timer = self.rt.call_later(mid[1], lambda: self._land_held(job), rid=job.rid)
            if not self._post_next(job):
                return
            # The injected action at mid-transfer; a pause needs nothing more: the held
            # half is in flight and lands on its own.
            self._reach(job, "mid-transfer", lambda j: None)
            return
        job.queue = triples
        self._post_next(job)

    def _post_next(self, job: WriteJob) -> bool:
        """Post the next bounded batch of this job (one at a time, so an abort stops
        posting within one batch). False if posting failed (the job is failed)."""
        if not _unposted(job):
            return True
        rows = max(1, self.batches.batch_bytes(job.owner) // self._row_bytes)
        chunk, job.queue = job.queue[:rows], job.queue[rows:]
        nbytes, posted_at = int(chunk[:, 2].sum()), time.monotonic()
        try:
            batch = self.rt.write(job.owner, self.segment, chunk)
        except TransferError as exc:
            self._fail(job, "transfer", f"write to rank {job.owner} refused: {exc}")
            return False
        job.outstanding += 1

        def written(b: Batch) -> None:
            self.batches.settled(job.owner, nbytes, time.monotonic() - posted_at)
            self._on_written(job, b)
        self.rt.watch(batch, written, rid=job.rid)
        self._land_others_held(job.owner, job)
        return True

    def _land_others_held(self, owner: int, job: WriteJob) -> None:
        """An in-flight (held) write of another request to the same owner lands right
        after this one: the fault that makes a late write overwrite reused pages."""
        for other in list(self.jobs.values()):
            if other is not job and other.owner == owner and other.held is not None:
                self._land_held(other)

    def _land_held(self, job: WriteJob) -> None:
        """The in-flight half of a write lands now (posted for real, then flushed)."""
        if job.held is None:
            return
        held, job.held = job.held, None
        if job.held_timer is not None:
            job.held_timer.cancel()
            job.held_timer = None
        log.warning("fault: request %s: %d in-flight pages land now", job.rid, len(held))
        if job.held_target is not None:
            # Shared memory: a write already posted is a copy in progress; it completes
            # whatever became of either side's endpoint since.
            for local, remote, length in held.tolist():
                ctypes.memmove(job.held_target + remote, self.segment.base + local, length)
            if job.state is WriterState.ABORTING:
                if job.outstanding == 0:
                    self._after_landing(job)
            elif job.state is WriterState.WRITING and job.outstanding == 0 and not _unposted(job):
                self._reach(job, "after-write", self._send_notice)
            return
        try:
            batch = self.rt.write(job.owner, self.segment, held)
        except TransferError as exc:
            log.warning("request %s: in-flight pages could not land: %s", job.rid, exc)
            self._after_landing(job)
            return
        job.outstanding += 1
        self.rt.watch(batch, lambda b: self._on_written(job, b), rid=job.rid)

    def _on_written(self, job: WriteJob, batch: Batch) -> None:
        job.outstanding -= 1
        if job.state is WriterState.ABORTING:
            if job.outstanding == 0 and job.held is None:
                self._after_landing(job)
            return
        if job.state is not WriterState.WRITING:
            return
        if batch.status() is not BatchStatus.COMPLETED:
            self._fail(job, "transfer", f"write to rank {job.owner} failed: {batch.error}")
            return
        if _unposted(job):
            self._post_next(job)
            return
        if job.outstanding == 0 and job.held is None:
            self._reach(job, "after-write", self._send_notice)

    def _send_notice(self, job: WriteJob) -> None:
        """The NOTICE, in chunks of ``PAGES_PER_CHUNK`` pages, each sent with ``notify``
        (after a flush): any chunk that arrives proves every write landed."""
        if job.state is not WriterState.WRITING:
            return
        sent = job.sent_pages
        checksums = job.checksums[:sent]
        notice = None
        for lo, hi in spans(sent, PAGES_PER_CHUNK):
            notice = self.rt.notify(
                job.owner, m.NOTICE, rid=job.rid, tokens=len(job.tokens), offset=lo, total=sent,
                pages=job.dst_pages[lo:hi], generations=job.dst_generations[lo:hi],
                checksums=checksums[lo:hi], bytes=job.posted_bytes, prefill_ms=job.prefill_ms)
            if notice is None:
                self._fail(job, "transfer", f"notice to rank {job.owner} could not be sent")
                return
        job.move(WriterState.NOTIFYING)
        self.rt.watch(notice, lambda b: self._on_notified(job, b), rid=job.rid)

    def _on_notified(self, job: WriteJob, batch: Batch) -> None:
        if job.state is not WriterState.NOTIFYING:
            return
        job.move(WriterState.DONE)
        self._free_source(job, "freed")
        self._reach(job, "after-notice", lambda j: None)

    # -------------------------------------------------------------- abort
    def _on_abort(self, msg: Message) -> None:
        job = self.jobs.get(msg.rid)
        owner = msg.owner if msg.owner >= 0 else (job.owner if job else -1)
        if job is None:
            # Never started (or already finished): tombstone, ack at once. Never started:
            # the router still counts the pages it reserved here, so say none are held.
            if msg.rid not in self.tombstones:
                self.rt.send(self.router, m.RELEASED, rid=msg.rid, pages=0, how="freed")
            self.tombstones[msg.rid] = time.monotonic()
            if owner >= 0:
                self.rt.notify(owner, m.ABORT_ACK, rid=msg.rid)
            return
        if job.owner < 0:
            job.owner = owner
        self._abort(job, f"{msg.source}: {msg.reason}")

    def _abort(self, job: WriteJob, reason: str) -> None:
        """Stop posting; once nothing of ours is in flight, ack with notify (flush, then
        send); free the source pages after that flush."""
        if job.state is WriterState.ABORTED:
            if job.owner >= 0:   # the owner asks again: our ack may have been lost
                self.rt.notify(job.owner, m.ABORT_ACK, rid=job.rid)
            return
        if job.state is WriterState.ABORTING:
            return
        if job.state is WriterState.DONE:   # finished and flushed: ack at once
            if job.owner >= 0:
                self.rt.notify(job.owner, m.ABORT_ACK, rid=job.rid)
            return
        if job.timer is not None:
            job.timer.cancel()
            job.timer = None
        job.queue = None
        job.move(WriterState.ABORTING)
        self.tombstones[job.rid] = time.monotonic()
        log.debug("request %s: writer rank %d aborting (%s)", job.rid, self.rt.rank, reason)
        if job.outstanding == 0 and job.held is None:
            self._after_landing(job)
        else:
            log.info("request %s: waiting for %d posted batch(es)%s before acking", job.rid,
                     job.outstanding, " and in-flight pages" if job.held is not None else "")

    def _after_landing(self, job: WriteJob) -> None:
        if job.state is not WriterState.ABORTING or job.acked:
            return
        job.acked = True
        ack = self.rt.notify(job.owner, m.ABORT_ACK, rid=job.rid) if job.owner >= 0 else None
        if ack is None:
            self._on_acked(job)
            return
        self.rt.watch(ack, lambda b: self._on_acked(job), rid=job.rid)

    def _on_acked(self, job: WriteJob) -> None:
        job.move(WriterState.ABORTED)
        self._free_source(job, "aborted")

    def _fail(self, job: WriteJob, source: str, reason: str) -> None:
        log.error("request %s: prefill rank %d failed: %s", job.rid, self.rt.rank, reason)
        for rank in {self.router, job.owner} - {-1}:
            self.rt.send(rank, m.ABORT, rid=job.rid, owner=job.owner, writers=[self.rt.rank],
                         source=source, reason=reason)
        self._abort(job, reason)

    def fail_request(self, rid: str, reason: str) -> None:
        """An exception while handling ``rid`` here (see RankRuntime._request_failed): the
        request fails as if its prefill had failed: the owner and the router are told,
        nothing more is posted, and the ack follows what is in flight."""
        job = self.jobs.get(rid)
        if job is None:
            log.error("request %s: failed on prefill rank %d after it ended here: %s", rid,
                      self.rt.rank, reason)
            return
        if job.state in (WriterState.ABORTING, WriterState.ABORTED, WriterState.DONE):
            log.error("request %s: %s (the writer had already %s; nothing more to undo)",
                      rid, reason, job.state.value)
            return
        self._fail(job, "internal", reason)

    def _free_source(self, job: WriteJob, how: str) -> None:
        freed = self.allocator.free(job.rid) if self.allocator.pages_of(job.rid) else []
        self.jobs.pop(job.rid, None)
        self.tombstones[job.rid] = time.monotonic()
        self.rt.send(self.router, m.RELEASED, rid=job.rid, pages=len(freed), how=how)

    # -------------------------------------------------------------- housekeeping
    def in_flight(self) -> bool:
        """Some request is between its PREFILL/PLAN and its end here."""
        return bool(self.jobs)




def _unposted(job: WriteJob) -> bool:
    return job.queue is not None and len(job.queue) > 0
