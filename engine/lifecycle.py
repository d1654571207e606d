"""The request life cycle as a table.

Upholds I2: REJECTED, ABORTED, FAILED and FINISHED are terminal. The terminal set is not
written by hand: it is derived from :data:`TRANSITIONS` (the states with no way out), and
:func:`is_live` is its complement, so "live" and "may still move" cannot disagree (the
incident's ``finished()`` said False for a rejected request; here there is one predicate,
and every queue filters with it). An illegal transition raises with the request id and
both states.

Paths: monolithic QUEUED > ADMITTED > PREFILLING > DECODING > FINISHED; a prefill rank
QUEUED > ADMITTED > PREFILLING > TRANSFERRING > FINISHED; a decode rank QUEUED > ADMITTED >
TRANSFERRING (receiving pages) > DECODING > FINISHED. REJECTED is reachable only from
QUEUED: admission happens before any page is allocated (I1).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum


class RequestState(Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"
    FAILED = "failed"


S = RequestState
_ENDINGS = frozenset({S.ABORTED, S.FAILED})

TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.ADMITTED, S.REJECTED}) | _ENDINGS,
    S.ADMITTED: frozenset({S.PREFILLING, S.TRANSFERRING}) | _ENDINGS,
    S.PREFILLING: frozenset({S.TRANSFERRING, S.DECODING}) | _ENDINGS,
    S.TRANSFERRING: frozenset({S.DECODING, S.FINISHED}) | _ENDINGS,
    S.DECODING: frozenset({S.FINISHED}) | _ENDINGS,
    S.FINISHED: frozenset(),
    S.REJECTED: frozenset(),
    S.ABORTED: frozenset(),
    S.FAILED: frozenset(),
}


def terminal_states(
    table: Mapping[RequestState, frozenset[RequestState]],
) -> frozenset[RequestState]:
    """States with no way out in ``table``."""
    return frozenset(state for state, targets in table.items() if not targets)


TERMINAL: frozenset[RequestState] = terminal_states(TRANSITIONS)
LIVE: frozenset[RequestState] = frozenset(RequestState) - TERMINAL


def is_live(state: RequestState) -> bool:
    """True while the request may still move; False for every terminal state."""
    return state not in TERMINAL


def reachable_from(
    start: RequestState, table: Mapping[RequestState, frozenset[RequestState]] = TRANSITIONS
) -> frozenset[RequestState]:
    """Every state reachable from ``start`` in one or more steps of ``table``."""
    seen: set[RequestState] = set()
    frontier = list(table.get(start, ()))
    while frontier:
        state = frontier.pop()
        if state not in seen:
            seen.add(state)
            frontier.extend(table.get(state, ()))
    return frozenset(seen)


def table_violations(table: Mapping[RequestState, frozenset[RequestState]]) -> list[str]:
    """What is wrong with a transition table against I1/I2; empty for :data:`TRANSITIONS`.
    Used by the tests, and run against broken tables to show it can fail."""
    problems = []
    for ending in (S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED):
        if table.get(ending):
            problems.append(
                f"{ending.value} is not terminal: leads to {sorted(s.value for s in table[ending])}"
            )
    for state, targets in table.items():
        if S.REJECTED in targets and state is not S.QUEUED:
            problems.append(f"{state.value} -> rejected: rejection must precede allocation")
    for ending in terminal_states(table):
        for work in (S.TRANSFERRING, S.DECODING, S.PREFILLING):
            if work in reachable_from(ending, table):
                problems.append(f"{work.value} reachable from terminal {ending.value}")
    return problems


class IllegalTransition(Exception):
    def __init__(
        self, request_id: str, current: RequestState, wanted: RequestState, reason: str = ""
    ) -> None:
        super().__init__(
            f"request {request_id!r}: illegal transition {current.value} -> {wanted.value}"
            + (f" ({reason})" if reason else "")
        )
        self.request_id = request_id
        self.current = current
        self.wanted = wanted


@dataclass(frozen=True)
class TransitionRecord:
    source: RequestState
    target: RequestState
    reason: str
    at: float


@dataclass
class Request:
    """One request as a rank sees it. ``prompt_tokens`` are token ids."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    state: RequestState = RequestState.QUEUED
    error: str | None = None
    output_tokens: list[int] = field(default_factory=list)
    history: list[TransitionRecord] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def live(self) -> bool:
        return is_live(self.state)

    def transition(self, new_state: RequestState, reason: str = "") -> None:
        if new_state not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.request_id, self.state, new_state, reason)
        self.history.append(TransitionRecord(self.state, new_state, reason, time.monotonic()))
        self.state = new_state
        if new_state in (S.REJECTED, S.ABORTED, S.FAILED) and reason and self.error is None:
            self.error = reason


def live_requests(requests: Iterable[Request]) -> list[Request]:
    """The live ones, in order. Queues and loops filter with this and nothing else."""
    return [r for r in requests if is_live(r.state)]
