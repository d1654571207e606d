"""Fault hooks at the control-plane and transfer seams, off unless a test enables them.

Each hook is one ``--fault`` string; a rank applies the hooks that name its role or none:

    drop:KIND[:PROB[:COUNT]]  drop outgoing messages of KIND (e.g. ABORT_ACK) with probability
                              PROB, at most COUNT of them (default: no limit)
    dup:KIND                  send every outgoing KIND twice
    delay:KIND:SECONDS        hold outgoing KIND this long before sending
    reorder:KIND              hold one outgoing KIND back and send it after the next one
    corrupt-page:MARKER       a writer corrupts a source page of any request whose prompt
                              contains MARKER, after computing its checksums
    short-write:MARKER        a writer writes and notices only the first page of such a
                              request's prompt, claiming the whole prompt's length
    decode-delay:SECONDS      a decode rank sleeps this long in every decode step (a slow
                              decoder, so that a late write can land while it still reads)
    plan-first:MARKER         a writer computes no KV of a request whose prompt contains
                              MARKER before the owner's plan is in, so a prompt longer than
                              a prefill chunk always goes in parts (the plan races the
                              prefill otherwise: a short prompt computed before its plan
                              arrives goes whole)
    swallow-errors            BROKEN MODE, to show the failure tests can fail: an exception
                              while a request is live is logged and dropped (the request
                              is not ended), and the router does not undo a dispatch that
                              raised
    at:POINT:ACTION:MARKER[:SECONDS]
                              a writer, at protocol POINT of a request whose prompt contains
                              MARKER, does ACTION. POINT: prefill (the first layer's KV
                              computed), before-write (plan and KV ready,
                              nothing posted), mid-transfer (first half of the pages posted,
                              the second half in flight: it lands after SECONDS, or right
                              after the writer's next write to the same owner, and a flush
                              waits for it, as a posted one-sided write would),
                              mid-pipeline (a prompt longer than a prefill chunk, going in
                              parts: its first part posted, half of it in flight as at
                              mid-transfer, the rest of the prompt still computing),
                              after-write
                              (every page flushed, notice not sent), after-notice.
                              ACTION: pause (hold there for SECONDS or until an abort),
                              fail-prefill, fail-transfer, kill (SIGKILL itself),
                              stop (SIGSTOP itself, SIGCONT after SECONDS), raise (an
                              exception in the rank's code: a bug, or input it cannot take).
                              Owner and router points take only raise and kill (an
                              owner killed at owner-notice dies with every notice in and
                              its pages written): an owner knows no
                              prompt text, so MARKER is matched against "prompt_len=N"
                              there. POINT: owner-assign (pages allocated, plan not sent),
                              owner-notice (every notice in, before the checks),
                              owner-decode (in a decode step), router-dispatch (pages
                              reserved, before PREFILL is sent).

A hook written ``rank=N:HOOK`` applies on cluster rank N only (one member of a
tensor-parallel group, say).

The ranks see faults only through :class:`FaultHooks`, whose every method is a no-op:
where messages leave a rank (:meth:`~FaultHooks.on_send`, applied to every message by
``RankRuntime``), where a rank reaches a protocol point (:meth:`~FaultHooks.at_point`),
what a writer posts (:meth:`~FaultHooks.tamper_source`, :meth:`~FaultHooks.pages_to_write`,
:meth:`~FaultHooks.hold_in_flight`) and a decode step (:meth:`~FaultHooks.before_decode_step`).
What each fault does lives here, in :class:`FaultPlan`; the protocol core
(:mod:`kvferry.engine.protocol`) never sees them.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.engine.tokenizer import decode as detokenize
from kvferry.transfer import BatchStatus, TransferError

log = logging.getLogger("kvferry.cluster")


WRITER_POINTS = (
    "prefill",
    "mid-pipeline",  # a long prompt's first part posted, the rest still computing
    "before-write",
    "mid-transfer",
    "after-write",
    "after-notice",
)
OWNER_POINTS = ("owner-assign", "owner-notice", "owner-decode")
ROUTER_POINTS = ("router-dispatch",)
POINTS = WRITER_POINTS + OWNER_POINTS + ROUTER_POINTS
ACTIONS = ("pause", "fail-prefill", "fail-transfer", "kill", "stop", "raise")


class FaultSpecError(ValueError):
    """A --fault string that does not parse."""


class InjectedFault(RuntimeError):
    """The exception of the ``raise`` action: stands for any bug or unexpected input in
    the rank's own code at that point."""

    def __init__(self, point: str) -> None:
        super().__init__(f"injected exception at {point}")
        self.point = point


class Decision(enum.Enum):
    """What a rank does at a protocol point, as the fault layer decides (kill, stop and
    raise are carried out by the fault layer itself)."""

    GO = "go on"
    PAUSE = "go on after the decision's seconds (an abort meanwhile cancels it)"
    FAIL_PREFILL = "fail the request as a prefill failure"
    FAIL_TRANSFER = "fail the request as a transfer failure"


@dataclass(frozen=True)
class PointDecision:
    decision: Decision
    seconds: float = 0.0


GO = PointDecision(Decision.GO)


class HeldWrite:
    """An injected in-flight write (``at:mid-transfer``, ``at:mid-pipeline``): posted as
    far as the writer knows, landed later: after its seconds, or right after the writer's
    next write of another request into any of the same remote bytes (over what that write
    put there, whatever size the writer's batches have then), or once another request
    wrote to the owner without touching them (its final notice). It settles, like a
    batch, only once it has landed, so a flush waits for it, as a posted one-sided write
    would.

    It is bound like a real post: to the owner's incarnation whose pages it was posted
    into, with the endpoint and remote segment of that moment. It lands through them;
    when those were closed meanwhile (a severed or reconnected endpoint) it lands
    through the current endpoint to the *same* incarnation, as a put already on the
    wire still does (a closed endpoint recalls nothing); when that incarnation is gone
    (the owner restarted) it fails, as a put to a dead process does: its bytes can only
    have gone into memory that died with it, never into the new incarnation's pool.
    ``rebind_at_landing`` is the BROKEN MODE of the tests that show this: re-resolve
    the owner at landing, which re-targets the write at whatever incarnation is there.
    """

    rebind_at_landing = False

    def __init__(
        self,
        rid: str,
        owner: int,
        incarnation: int,
        segment: Any,
        triples: np.ndarray,
        peer: Any,
        remote: Any,
    ) -> None:
        self.rid, self.owner, self.incarnation = rid, owner, incarnation
        self.segment, self.triples = segment, triples
        self.peer, self.remote = peer, remote  # bound when held, as a posted put is
        self.landed = False
        self.batch: Any = None  # the real batch, when it lands by a real post
        self.failure: str | None = None  # why it could not land
        self.timer: Any = None

    def overlaps(self, triples: np.ndarray) -> bool:
        """Whether any (local, remote, length) run of ``triples`` shares a remote byte with
        this write's runs."""
        posted = np.asarray(triples, dtype=np.int64).reshape(-1, 3)
        if posted.size == 0 or self.triples.size == 0:
            return False
        order = np.argsort(self.triples[:, 1], kind="stable")
        starts = self.triples[order, 1]
        ends = starts + self.triples[order, 2]  # runs of one write do not overlap
        p_start, p_end = posted[:, 1], posted[:, 1] + posted[:, 2]
        last = np.searchsorted(starts, p_end, side="left") - 1  # last run starting before
        ok = last >= 0
        return bool((ends[last[ok]] > p_start[ok]).any())

    def peek(self) -> BatchStatus:
        if self.batch is not None:
            return self.batch.peek()
        if self.failure is not None:
            return BatchStatus.FAILED
        return BatchStatus.COMPLETED if self.landed else BatchStatus.PENDING

    def status(self) -> BatchStatus:
        return self.peek()

    def reading(self) -> bool:
        return self.batch.reading() if self.batch is not None else False

    @property
    def error(self) -> Any:
        if self.batch is not None:
            return self.batch.error
        return self.failure

    def land(self, rt: Any) -> None:
        if self.landed:
            return
        self.landed = True
        if self.timer is not None:
            self.timer.cancel()
        log.warning(
            "fault: request %s: %d in-flight pages land now (owner rank %d, incarnation %#x)",
            self.rid,
            len(self.triples),
            self.owner,
            self.incarnation,
        )
        if self.rebind_at_landing:  # BROKEN MODE: re-targets the write
            self._post(rt.engine, rt.peer(self.owner), rt.remote_segment(self.owner))
            return
        current = rt.cards[self.owner].incarnation
        if current != self.incarnation:
            self._fail(
                f"owner rank {self.owner} is incarnation {current:#x} now; incarnation "
                f"{self.incarnation:#x}, which this write was posted to, is gone"
            )
            return
        peer, remote = self.peer, self.remote
        if not _still_mapped(rt.engine, peer, remote):
            try:  # the endpoint was closed meanwhile; the same incarnation is still there
                peer, remote = rt.peer(self.owner), rt.remote_segment(self.owner)
            except TransferError as exc:
                self._fail(f"owner rank {self.owner} cannot be reached: {exc}")
                return
        self._post(rt.engine, peer, remote)

    def _post(self, engine: Any, peer: Any, remote: Any) -> None:
        if remote.direct is not None:  # mapped here: the copy a shared-memory put makes
            for local, offset, length in self.triples.tolist():
                ctypes.memmove(remote.direct + offset, self.segment.base + local, length)
            return
        try:
            self.batch = engine.write(peer, self.segment, remote, self.triples)
        except TransferError as exc:
            self._fail(str(exc))

    def _fail(self, why: str) -> None:
        self.failure = why
        log.warning("fault: request %s: in-flight pages could not land: %s", self.rid, why)


def _still_mapped(engine: Any, peer: Any, remote: Any) -> bool:
    """The endpoint and remote key a held write was bound to are still open here (a
    closed endpoint's keys are destroyed, and with them any mapping of the segment)."""
    return bool(engine.peer_alive(peer)) and remote.rkey in peer.rkeys


class FaultHooks:
    """The fault seam the ranks call; every hook does nothing. ``label`` names the
    request to a marker: the prompt's text at a writer, ``prompt_len=N`` elsewhere."""

    swallow_errors = False

    @property
    def enabled(self) -> bool:
        return False

    def on_send(self, kind: str, rank: int, payload: bytes) -> list[tuple[bytes, float]]:
        return [(payload, 0.0)]

    def raise_at(self, point: str, label: str) -> None:
        pass

    def at_point(self, point: str, rid: str, tokens: np.ndarray | None) -> PointDecision:
        return GO

    def before_decode_step(self, labels: Sequence[str]) -> None:
        pass

    def tamper_source(
        self, rid: str, tokens: np.ndarray, pool: Any, pages: Sequence[int], heads: tuple[int, int]
    ) -> None:
        pass

    def pages_to_write(self, rid: str, tokens: np.ndarray, pages: int) -> int:
        return pages

    def plan_first(self, rid: str, tokens: np.ndarray) -> bool:
        """The prefill of ``rid`` waits for the owner's plan (see ``plan-first``)."""
        return False

    def hold_in_flight(
        self,
        rt: Any,
        rid: str,
        tokens: np.ndarray,
        owner: int,
        segment: Any,
        triples: np.ndarray,
        point: str,
    ) -> tuple[np.ndarray, HeldWrite | None]:
        """``(post now, held)`` of a write posted at ``point`` (``mid-transfer``: the
        whole prompt's; ``mid-pipeline``: a long prompt's first part): with no fault,
        everything is posted now."""
        return triples, None

    def wrote(self, rt: Any, owner: int, rid: str, triples: np.ndarray) -> None:
        """After a write of request ``rid`` posted to ``owner``: (local, remote, length)
        ``triples``."""

    def noticed(self, rt: Any, owner: int, rid: str) -> None:
        """After request ``rid``'s final notice to ``owner`` (its last write)."""

    def forget(self, rid: str) -> None:
        """The request ended at this rank."""


@dataclass
class FaultPlan(FaultHooks):
    drop: dict[str, float] = field(default_factory=dict)
    drop_left: dict[str, int] = field(default_factory=dict)  # KIND -> drops left (a COUNT)
    duplicate: set[str] = field(default_factory=set)
    delay: dict[str, float] = field(default_factory=dict)
    reorder: set[str] = field(default_factory=set)
    corrupt_marker: str | None = None
    short_marker: str | None = None
    plan_first_marker: str | None = None
    points: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    decode_delay_s: float = 0.0
    swallow_errors: bool = False
    seed: int = 0
    _held: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    _in_flight: dict[int, list[HeldWrite]] = field(default_factory=dict)
    _texts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, specs: list[str], seed: int = 0, rank: int | None = None) -> FaultPlan:
        """The plan of ``specs``; ``rank``: this rank's number, for ``rank=N:`` hooks
        (None: every hook applies)."""
        plan = cls(seed=seed)
        mine = []
        for spec in specs:
            if spec.startswith("rank="):
                head, _, rest = spec.partition(":")
                try:
                    only = int(head.removeprefix("rank="))
                except ValueError:
                    raise FaultSpecError(f"bad rank in fault spec {spec!r}") from None
                if rank is not None and only != rank:
                    continue
                spec = rest
            mine.append(spec)
        for spec in mine:
            parts = spec.split(":")
            try:
                what = parts[0]
                if what == "drop":
                    plan.drop[parts[1]] = float(parts[2]) if len(parts) > 2 else 1.0
                    if len(parts) > 3:
                        plan.drop_left[parts[1]] = int(parts[3])
                elif what == "dup":
                    plan.duplicate.add(parts[1])
                elif what == "delay":
                    plan.delay[parts[1]] = float(parts[2])
                elif what == "reorder":
                    plan.reorder.add(parts[1])
                elif what == "corrupt-page":
                    plan.corrupt_marker = parts[1]
                elif what == "plan-first":
                    plan.plan_first_marker = parts[1]
                elif what == "short-write":
                    plan.short_marker = parts[1]
                elif what == "decode-delay":
                    plan.decode_delay_s = float(parts[1])
                elif what == "swallow-errors":
                    plan.swallow_errors = True
                elif what == "at":
                    point, action, marker = parts[1], parts[2], parts[3]
                    if point not in POINTS:
                        raise FaultSpecError(f"unknown protocol point {point!r}; one of {POINTS}")
                    if action not in ACTIONS:
                        raise FaultSpecError(f"unknown action {action!r}; one of {ACTIONS}")
                    if point not in WRITER_POINTS and action not in ("raise", "kill"):
                        raise FaultSpecError(
                            f"{point} takes only the raise and kill actions, not {action!r}"
                        )
                    seconds = float(parts[4]) if len(parts) > 4 else 3.0
                    plan.points.setdefault(point, []).append((action, marker, seconds))
                else:
                    raise FaultSpecError(f"unknown fault {what!r} in {spec!r}")
            except (IndexError, ValueError) as exc:
                raise FaultSpecError(f"bad fault spec {spec!r}: {exc}") from None
        if mine:
            log.warning("FAULT INJECTION ENABLED: %s", mine)
        return plan

    @property
    def enabled(self) -> bool:
        return bool(
            self.drop
            or self.duplicate
            or self.delay
            or self.reorder
            or self.corrupt_marker
            or self.short_marker
            or self.plan_first_marker
            or self.points
            or self.decode_delay_s
            or self.swallow_errors
        )

    def at(self, point: str, text: str) -> tuple[str, float] | None:
        """The action (and its seconds) for a request whose prompt is ``text`` at ``point``."""
        for action, marker, seconds in self.points.get(point, ()):
            if marker in text:
                return action, seconds
        return None

    def raise_at(self, point: str, text: str) -> None:
        """Raise InjectedFault if a ``raise`` is injected at ``point`` for ``text``; die
        there (SIGKILL) for a ``kill``."""
        found = self.at(point, text)
        if found is not None and found[0] == "raise":
            log.warning("fault: raising at %s (%s)", point, text[:40])
            raise InjectedFault(point)
        if found is not None and found[0] == "kill":
            log.warning("fault: killed at %s (%s)", point, text[:40])
            os.kill(os.getpid(), signal.SIGKILL)

    def on_send(self, kind: str, rank: int, payload: bytes) -> list[tuple[bytes, float]]:
        """What to actually send for one outgoing message: [(payload, delay_s)]."""
        if not self.enabled:
            return [(payload, 0.0)]
        if (
            kind in self.drop
            and self.drop_left.get(kind, 1) > 0
            and self._rng.random() < self.drop[kind]
        ):
            if kind in self.drop_left:
                self.drop_left[kind] -= 1
            log.warning("fault: dropped %s to rank %d", kind, rank)
            return []
        out = [(payload, self.delay.get(kind, 0.0))]
        if kind in self.duplicate:
            out.append((payload, self.delay.get(kind, 0.0)))
        if kind in self.reorder:
            held = self._held.pop(kind, None)
            if held is None:
                self._held[kind] = (payload, 0.0)
                return []
            out.append(held)
        return out

    # ------------------------------------------------------------ the hooks
    def _text(self, rid: str, tokens: np.ndarray | None) -> str:
        """The prompt as text, which only markers read (built once per request)."""
        if rid not in self._texts:
            self._texts[rid] = detokenize(tokens.tolist()) if tokens is not None else ""
        return self._texts[rid]

    def at_point(self, point: str, rid: str, tokens: np.ndarray | None) -> PointDecision:
        if not self.points:
            return GO
        found = self.at(point, self._text(rid, tokens))
        if found is None:
            return GO
        action, seconds = found
        log.warning("fault: request %s: %s at %s", rid, action, point)
        if action == "raise":
            raise InjectedFault(point)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "stop":
            subprocess.Popen(
                ["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True
            )
            os.kill(os.getpid(), signal.SIGSTOP)
            return GO
        if action == "pause":
            return PointDecision(Decision.PAUSE, seconds)
        return PointDecision(
            Decision.FAIL_PREFILL if action == "fail-prefill" else Decision.FAIL_TRANSFER
        )

    def before_decode_step(self, labels: Sequence[str]) -> None:
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)
        for label in labels:
            self.raise_at("owner-decode", label)

    def tamper_source(
        self, rid: str, tokens: np.ndarray, pool: Any, pages: Sequence[int], heads: tuple[int, int]
    ) -> None:
        """corrupt-page: negate the value vector of the prompt's second token (layer 0,
        the first head of this writer), after its checksum: the bytes on the wire no
        longer match the checksums sent. The second, because decode reads it (its first
        step's target; the answer's first token is the prefill's own), so without the
        checks the damage shows in the answer."""
        if self.corrupt_marker is None or self.corrupt_marker not in self._text(rid, tokens):
            return
        page_size = pool.kv.shape[4]
        position = min(1, len(pages) * page_size - 1)
        page = pages[position // page_size]
        pool.kv[page, 0, 1, heads[0], position % page_size, :].neg_()
        log.warning(
            "fault: request %s: corrupted position %d's values in source page %d after "
            "its checksum",
            rid,
            position,
            page,
        )

    def pages_to_write(self, rid: str, tokens: np.ndarray, pages: int) -> int:
        """short-write: the incident's shape, a 1-page stub written and noticed for a
        whole prompt."""
        if self.short_marker is None or self.short_marker not in self._text(rid, tokens):
            return pages
        log.warning("fault: request %s: writing 1 of its %d prompt pages", rid, pages)
        return 1

    def plan_first(self, rid: str, tokens: np.ndarray) -> bool:
        marker = self.plan_first_marker
        return marker is not None and marker in self._text(rid, tokens)

    def hold_in_flight(
        self,
        rt: Any,
        rid: str,
        tokens: np.ndarray,
        owner: int,
        segment: Any,
        triples: np.ndarray,
        point: str,
    ) -> tuple[np.ndarray, HeldWrite | None]:
        """Any action injected at ``point`` holds the second half of the write in flight:
        it lands after the action's seconds, or right after the writer's next write of
        another request into the same remote bytes (see :meth:`wrote`), or once another
        request's writes to the owner ended without touching them (:meth:`noticed`)."""
        mid = self.at(point, self._text(rid, tokens)) if self.points else None
        if mid is None or len(triples) < 2:
            return triples, None
        half = len(triples) // 2
        try:  # what a post binds to: this endpoint, this segment, this incarnation
            peer, remote = rt.peer(owner), rt.remote_segment(owner)
        except TransferError:
            return triples, None  # nothing can be posted: the write itself fails
        held = HeldWrite(
            rid, owner, rt.cards[owner].incarnation, segment, triples[half:], peer, remote
        )
        held.timer = rt.call_later(mid[1], lambda: held.land(rt), rid=rid)
        self._in_flight.setdefault(owner, []).append(held)
        return triples[:half], held

    def wrote(self, rt: Any, owner: int, rid: str, triples: np.ndarray) -> None:
        """An in-flight (held) write of another request into any of the remote bytes this
        write of ``rid`` just covered lands right after it: the fault that makes a late
        write overwrite reused pages. Landing on the first write to the owner instead
        would depend on how many pages the writer's batch carried then, which its
        measured rate sets: a smaller batch than usual (a loaded machine) left the reused
        pages to a later batch, which wrote them over the late write."""
        self._land(rt, owner, lambda h: h.rid != rid and h.overlaps(triples))

    def noticed(self, rt: Any, owner: int, rid: str) -> None:
        """Request ``rid`` wrote all it writes to ``owner`` and none of it touched a held
        write of another request (else that landed with it): the held write lands now,
        into pages nobody else holds (a quarantine keeps them), as it would while the
        owner waits for its writer's ack."""
        self._land(rt, owner, lambda h: h.rid != rid)

    def _land(self, rt: Any, owner: int, which: Callable[[HeldWrite], bool]) -> None:
        waiting = self._in_flight.get(owner, [])
        for held in [h for h in waiting if which(h)]:
            waiting.remove(held)
            held.land(rt)

    def forget(self, rid: str) -> None:
        self._texts.pop(rid, None)


def no_faults() -> FaultHooks:
    return FaultHooks()


__all__ = [
    "Decision",
    "FaultHooks",
    "FaultPlan",
    "FaultSpecError",
    "HeldWrite",
    "InjectedFault",
    "PointDecision",
    "no_faults",
]
