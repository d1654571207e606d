"""One process, one pool, prefill and decode: the oracle the disaggregated path must match.

Flow per request: ``submit`` (admission, I1: a rejected request never holds a page) >
``prefill`` (all-or-nothing page grant, K/V written, canaries stamped, checksums recorded)
> ``begin_decode`` (I5: length, canary and checksum checks before any attention) > decode
steps > FINISHED and pages freed. ``abort`` quarantines the request's pages; here the only
writer is this process, which has stopped, so they are released at once unless the caller
asks to hold them (as a decode rank must while a remote write may land, I4).

Results: bit for bit equal to a disaggregated run with the replay model; within the
tolerance stated in :mod:`.llama` with the random model.

Unsafe mode (``unsafe=True``, off by default, logged at CRITICAL): pages are freed without
quarantine and the integrity checks are skipped. It exists to show that the leak tests
fail when the protection is off.

Its I5 checks (``_verify``: :func:`~.integrity.verify_pages`) and decode step
(:mod:`.decode`) are independent of the decode rank's on purpose, for the reason given in
:mod:`.decode`: an oracle that shares the code it checks cannot catch that code's bugs.
Both use the same primitives (:func:`~.integrity.check_transferred_length`, the canary
table, :func:`~.integrity.page_checksums`).

Upholds I1, I2 (every queue filters with :func:`is_live`), I3 (the pool is checked against
the context length at construction), I5 and I6 (every rejection, abort and integrity
failure is counted, logged with the request id and returned as an error).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .admission import AdmissionRejected, admit, pages_needed, pool_capacity_tokens
from .allocator import PageAllocator, PageGrant
from .capacity import enforce_startup_capacity
from .decode import DecodeSlot, decode_step
from .integrity import (
    CanaryTable,
    IntegrityError,
    check_transferred_length,
    expected_canaries,
    page_checksums,
    verify_pages,
)
from .lifecycle import Request, RequestState, is_live, live_requests
from .models import PagedModel
from .pool import KVPool
from .tokenizer import decode as decode_text
from .tokenizer import encode

log = logging.getLogger(__name__)
S = RequestState


@dataclass(frozen=True)
class IntegrityPolicy:
    """Which I5 checks run before decode."""

    length: bool = True
    canaries: bool = True
    checksums: bool = True


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    state: RequestState
    tokens: list[int]
    error: str | None

    @property
    def ok(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def text(self) -> str:
        return decode_text(self.tokens)


@dataclass
class _Entry:
    request: Request
    grants: list[PageGrant] = field(default_factory=list)
    written_tokens: int = 0
    written_checksums: dict[int, int] = field(default_factory=dict)  # page -> checksum at write
    first_token: int | None = None  # the prefill's (None: nothing was written)
    slot: DecodeSlot | None = None


class MonolithicEngine:
    def __init__(
        self,
        model: PagedModel,
        pool: KVPool,
        *,
        context_length: int,
        lowered_context_length: int | None = None,
        integrity: IntegrityPolicy = IntegrityPolicy(),
        unsafe: bool = False,
        max_batch: int = 8,
    ) -> None:
        if (pool.layers, pool.kv_heads, pool.head_dim) != (
            model.layers,
            model.kv_heads,
            model.head_dim,
        ):
            raise ValueError(f"pool {pool!r} does not match the model's layers/kv_heads/head_dim")
        self.context_length = enforce_startup_capacity(pool, context_length, lowered_context_length)
        self.model = model
        self.pool = pool
        self.unsafe = unsafe
        self.integrity = IntegrityPolicy(False, False, False) if unsafe else integrity
        self.allocator = PageAllocator(pool.num_pages, unsafe=unsafe)
        self.canaries = CanaryTable(pool.num_pages)
        self.max_batch = max_batch
        self.counters: Counter[str] = Counter()
        self._entries: dict[str, _Entry] = {}
        self._order: list[str] = []
        if unsafe:
            log.critical("UNSAFE ENGINE: pages freed without quarantine, integrity checks skipped")

    # --- queries ----------------------------------------------------------------------
    def request(self, request_id: str) -> Request:
        return self._entry(request_id).request

    def result(self, request_id: str) -> GenerationResult:
        r = self._entry(request_id).request
        tokens = list(r.output_tokens) if r.state is S.FINISHED else []
        return GenerationResult(request_id, r.state, tokens, r.error)

    def live(self) -> list[Request]:
        return live_requests(self._entries[rid].request for rid in self._order)

    # --- steps ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | Sequence[int], max_tokens: int) -> Request:
        """Create the request and run admission (I1). Rejected requests never get pages."""
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} already submitted")
        tokens = encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        request = Request(request_id, tokens, max_tokens)
        self._entries[request_id] = _Entry(request)
        self._order.append(request_id)
        try:
            admit(
                request_id,
                len(tokens),
                max_tokens,
                self.context_length,
                pool_capacity_tokens(self.allocator, self.pool.page_size),
            )
        except AdmissionRejected as rejected:
            request.transition(S.REJECTED, str(rejected))
            self._count("rejected", request_id, rejected)
            return request
        request.transition(S.ADMITTED, "fits context length and pool")
        return request

    def prefill(self, request_id: str, *, written_tokens: int | None = None) -> bool:
        """Grant pages and write the prompt's K/V. False (nothing held) if pages are short now.

        ``written_tokens`` is a fault hook: write only that many prompt positions, as a stub
        prompt or a short transfer would, while the request still expects all of them."""
        entry = self._entry(request_id)
        request = entry.request
        if request.state is not S.ADMITTED:
            raise ValueError(
                f"request {request_id!r} is {request.state.value}, prefill needs admitted"
            )
        needed = pages_needed(request.prompt_len, request.max_tokens, self.pool.page_size)
        if needed > self.allocator.free_pages:
            return False
        entry.grants = self.allocator.allocate(request_id, needed)
        request.transition(S.PREFILLING)
        written = (
            request.prompt_len
            if written_tokens is None
            else min(written_tokens, request.prompt_len)
        )
        row = [g.page for g in entry.grants]
        if written:
            entry.first_token = self.model.prefill(
                self.pool.kv, request.prompt_tokens[:written], row
            )
        entry.written_tokens = written
        written_pages = -(-written // self.pool.page_size)
        stamped = entry.grants[:written_pages]
        self.canaries.stamp(
            [g.page for g in stamped], expected_canaries(request_id, entry.grants)[:written_pages]
        )
        if self.integrity.checksums and stamped:
            sums = page_checksums(self.pool.kv, [g.page for g in stamped]).tolist()
            entry.written_checksums = dict(zip((g.page for g in stamped), sums, strict=True))
        return True

    def begin_decode(self, request_id: str) -> bool:
        """Verify the prompt's pages (I5), then make the request decodable. False if it failed."""
        entry = self._entry(request_id)
        request = entry.request
        if request.state is not S.PREFILLING:
            raise ValueError(
                f"request {request_id!r} is {request.state.value}, decode needs prefilling"
            )
        try:
            self._verify(entry)
        except IntegrityError as error:
            self._count("integrity_failures", request_id, error)
            self._end(entry, S.FAILED, str(error))
            return False
        request.transition(S.DECODING, "pages verified")
        entry.slot = DecodeSlot.start(
            request_id,
            [g.page for g in entry.grants],
            request.prompt_len,
            request.prompt_tokens[-1],
            request.max_tokens,
            first_token=entry.first_token,
            stop_token=self.model.stop_token,
        )
        return True

    def step(self) -> list[str]:
        """One batched decode step over the decoding requests; returns those that finished."""
        running: list[tuple[_Entry, DecodeSlot]] = []
        for r in self.live():
            entry = self._entries[r.request_id]
            if r.state is S.DECODING and entry.slot is not None:
                running.append((entry, entry.slot))
        running = running[: self.max_batch]
        if not running:
            return []
        decode_step(self.model, self.pool.kv, [slot for _, slot in running])
        finished = []
        for entry, slot in running:
            if slot.done:
                entry.request.output_tokens = list(slot.output)
                self.allocator.free(entry.request.request_id)
                entry.request.transition(S.FINISHED, f"{len(slot.output)} tokens")
                self.counters["finished"] += 1
                finished.append(entry.request.request_id)
        return finished

    def abort(
        self, request_id: str, reason: str = "aborted", *, hold_quarantine: bool = False
    ) -> list[int]:
        """Abort a live request: its pages go to quarantine (freed at once in unsafe mode) and,
        unless ``hold_quarantine``, are released because no writer remains. Returns the pages."""
        entry = self._entry(request_id)
        if not is_live(entry.request.state):
            raise ValueError(f"request {request_id!r} is already {entry.request.state.value}")
        pages = self.allocator.pages_of(request_id)
        self._count("aborted", request_id, reason)
        self._end(entry, S.ABORTED, reason, release=not hold_quarantine)
        return pages

    def release(self, request_id: str) -> list[int]:
        """Release the quarantined pages of an ended request (the caller holds the proof)."""
        return self.allocator.release(request_id)

    def run(self) -> None:
        """Schedule and decode until no request is live."""
        while self.live():
            self._schedule()
            if not self.step() and not any(r.state is S.DECODING for r in self.live()):
                self._fail_unschedulable()

    def generate(
        self, requests: Iterable[tuple[str, str | Sequence[int], int]]
    ) -> list[GenerationResult]:
        ids = []
        for request_id, prompt, max_tokens in requests:
            self.submit(request_id, prompt, max_tokens)
            ids.append(request_id)
        self.run()
        return [self.result(rid) for rid in ids]

    # --- internals --------------------------------------------------------------------
    def _entry(self, request_id: str) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _schedule(self) -> None:
        decoding = sum(1 for r in self.live() if r.state is S.DECODING)
        for request in self.live():
            if decoding >= self.max_batch:
                return
            if request.state is not S.ADMITTED:
                continue
            if not self.prefill(request.request_id):
                return  # first come, first served: wait for pages
            if self.begin_decode(request.request_id):
                decoding += 1

    def _fail_unschedulable(self) -> None:
        for request in self.live():
            if request.state is S.ADMITTED:
                needed = pages_needed(request.prompt_len, request.max_tokens, self.pool.page_size)
                reason = (
                    f"needs {needed} pages, {self.allocator.free_pages} free and nothing "
                    "running to free more"
                )
                self._count("failed", request.request_id, reason)
                self._end(self._entries[request.request_id], S.FAILED, reason)

    def _verify(self, entry: _Entry) -> None:
        request = entry.request
        rid = request.request_id
        prompt_pages = [
            g.page for g in entry.grants[: -(-request.prompt_len // self.pool.page_size)]
        ]
        if self.integrity.length:
            check_transferred_length(rid, request.prompt_len, entry.written_tokens)
        if self.integrity.canaries:
            want = expected_canaries(rid, entry.grants)[: len(prompt_pages)]
            bad = verify_pages(
                self.pool.kv, prompt_pages, canary_table=self.canaries, expected=want
            )
            if bad:
                raise IntegrityError(rid, "canary mismatch", bad)
        if self.integrity.checksums:
            missing = [p for p in prompt_pages if p not in entry.written_checksums]
            present = [p for p in prompt_pages if p in entry.written_checksums]
            bad = verify_pages(
                self.pool.kv,
                present,
                expected_checksums=[entry.written_checksums[p] for p in present],
            )
            if missing or bad:
                raise IntegrityError(
                    rid, "checksum mismatch or page never written", sorted(missing + bad)
                )

    def _end(
        self, entry: _Entry, state: RequestState, reason: str, *, release: bool = True
    ) -> None:
        rid = entry.request.request_id
        entry.request.transition(state, reason)
        entry.slot = None
        self.allocator.quarantine(rid)
        if release:
            self.allocator.release(rid)

    def _count(self, what: str, request_id: str, detail: object) -> None:
        self.counters[what] += 1
        log.warning("%s [request %r]: %s", what, request_id, detail)
