"""Fault hooks at the control-plane and transfer seams, off unless a test enables them.

Each hook is one ``--fault`` string; a rank applies the hooks that name its role or none:

    drop:KIND[:PROB]          drop outgoing messages of KIND (e.g. ABORT_ACK) with probability PROB
    dup:KIND                  send every outgoing KIND twice
    delay:KIND:SECONDS        hold outgoing KIND this long before sending
    reorder:KIND              hold one outgoing KIND back and send it after the next one
    corrupt-page:MARKER       a writer corrupts a source page of any request whose prompt
                              contains MARKER, after computing its checksums
    short-write:MARKER        a writer writes and notices only the first page of such a
                              request's prompt, claiming the whole prompt's length
    decode-delay:SECONDS      a decode rank sleeps this long in every decode step (a slow
                              decoder, so that a late write can land while it still reads)
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
                              waits for it, as a posted one-sided write would), after-write
                              (every page flushed, notice not sent), after-notice.
                              ACTION: pause (hold there for SECONDS or until an abort),
                              fail-prefill, fail-transfer, kill (SIGKILL itself),
                              stop (SIGSTOP itself, SIGCONT after SECONDS), raise (an
                              exception in the rank's code: a bug, or input it cannot take).
                              Owner and router points take only raise: an owner knows no
                              prompt text, so MARKER is matched against "prompt_len=N"
                              there. POINT: owner-assign (pages allocated, plan not sent),
                              owner-notice (every notice in, before the checks),
                              owner-decode (in a decode step), router-dispatch (pages
                              reserved, before PREFILL is sent).

The hooks sit where messages leave a rank (:meth:`FaultPlan.on_send`, applied to every
message by ``RankRuntime``), where a writer reaches a protocol point and where it posts
pages; the protocol logic never looks at them.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

log = logging.getLogger("kvferry.cluster")


WRITER_POINTS = ("prefill", "before-write", "mid-transfer", "after-write", "after-notice")
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


@dataclass
class FaultPlan:
    drop: dict[str, float] = field(default_factory=dict)
    duplicate: set[str] = field(default_factory=set)
    delay: dict[str, float] = field(default_factory=dict)
    reorder: set[str] = field(default_factory=set)
    corrupt_marker: str | None = None
    short_marker: str | None = None
    points: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    decode_delay_s: float = 0.0
    swallow_errors: bool = False
    seed: int = 0
    _held: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, specs: list[str], seed: int = 0) -> "FaultPlan":
        plan = cls(seed=seed)
        for spec in specs:
            parts = spec.split(":")
            try:
                what = parts[0]
                if what == "drop":
                    plan.drop[parts[1]] = float(parts[2]) if len(parts) > 2 else 1.0
                elif what == "dup":
                    plan.duplicate.add(parts[1])
                elif what == "delay":
                    plan.delay[parts[1]] = float(parts[2])
                elif what == "reorder":
                    plan.reorder.add(parts[1])
                elif what == "corrupt-page":
                    plan.corrupt_marker = parts[1]
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
                    if point not in WRITER_POINTS and action != "raise":
                        raise FaultSpecError(f"{point} takes only the raise action, not {action!r}")
                    seconds = float(parts[4]) if len(parts) > 4 else 3.0
                    plan.points.setdefault(point, []).append((action, marker, seconds))
                else:
                    raise FaultSpecError(f"unknown fault {what!r} in {spec!r}")
            except (IndexError, ValueError) as exc:
                raise FaultSpecError(f"bad fault spec {spec!r}: {exc}") from None
        if specs:
            log.warning("FAULT INJECTION ENABLED: %s", specs)
        return plan

    @property
    def enabled(self) -> bool:
        return bool(self.drop or self.duplicate or self.delay or self.reorder
                    or self.corrupt_marker or self.short_marker or self.points
                    or self.decode_delay_s or self.swallow_errors)

    def at(self, point: str, text: str) -> tuple[str, float] | None:
        """The action (and its seconds) for a request whose prompt is ``text`` at ``point``."""
        for action, marker, seconds in self.points.get(point, ()):
            if marker in text:
                return action, seconds
        return None

    def raise_at(self, point: str, text: str) -> None:
        """Raise InjectedFault if a ``raise`` is injected at ``point`` for ``text``."""
        found = self.at(point, text)
        if found is not None and found[0] == "raise":
            log.warning("fault: raising at %s (%s)", point, text[:40])
            raise InjectedFault(point)

    def on_send(self, kind: str, rank: int, payload: bytes) -> list[tuple[bytes, float]]:
        """What to actually send for one outgoing message: [(payload, delay_s)]."""
        if not self.enabled:
            return [(payload, 0.0)]
        if kind in self.drop and self._rng.random() < self.drop[kind]:
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

    def corrupts(self, text: str) -> bool:
        return self.corrupt_marker is not None and self.corrupt_marker in text

    def short_writes(self, text: str) -> bool:
        return self.short_marker is not None and self.short_marker in text
