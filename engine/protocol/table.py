"""Transition tables: (state, event) -> (next state, effects), total over both enums.

A machine is written as the rows that matter; :func:`complete` fills every other
(state, event) pair with "ignored" (the state stays, nothing is done: the input is late,
duplicated or stale), so every pair has an entry that a test or a simulator can walk and
that :func:`render` prints. The step is a dictionary lookup: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
D = TypeVar("D", bound=enum.Enum)


@dataclass(frozen=True)
class Move(Generic[S, D]):
    """One table entry: where the machine goes and what the rank must do, in order."""

    to: S
    effects: tuple[D, ...] = ()
    ignored: bool = False  # filled in by :func:`complete`, not written by hand


Table = Mapping[tuple[S, E], Move[S, D]]


def step(book: Any, event: E, table: Mapping[tuple[S, E], Move[S, D]]) -> Move[S, D]:
    """Move ``book`` (anything with a ``state``) by ``table``; returns the entry, whose
    effects are the host's to carry out (:class:`.driver.Driver` does, in order)."""
    move = table[book.state, event]
    book.state = move.to
    return move


def complete(
    states: type[S], events: type[E], rows: Mapping[tuple[S, E], Move[S, D]]
) -> dict[tuple[S, E], Move[S, D]]:
    """``rows`` plus an "ignored" entry for every pair they leave out."""
    table: dict[tuple[S, E], Move[S, D]] = {}
    for state in states:
        for event in events:
            table[state, event] = rows.get((state, event), Move(state, (), ignored=True))
    return table


def replace(
    table: Mapping[tuple[S, E], Move[S, D]], changes: Mapping[tuple[S, E], Move[S, D]]
) -> dict[tuple[S, E], Move[S, D]]:
    """A copy of ``table`` with some entries changed (the broken modes are such copies)."""
    out = dict(table)
    for key, move in changes.items():
        if key not in out:
            raise KeyError(f"no entry {key} to replace")
        out[key] = move
    return out


def terminal(table: Mapping[tuple[S, E], Move[S, D]], states: Iterable[S]) -> set[S]:
    """The states no event leaves."""
    return {s for s in states if all(m.to is s for (st, _), m in table.items() if st is s)}


def render(table: Mapping[tuple[S, E], Move[S, D]], title: str) -> str:
    """The table's hand-written rows as markdown (the ignored ones are left out)."""
    lines = [f"{title}", "", "| state | event | next state | effects |", "|---|---|---|---|"]
    for (state, event), move in table.items():
        if move.ignored:
            continue
        effects = ", ".join(e.name for e in move.effects) or "-"
        lines.append(f"| {state.name} | {event.name} | {move.to.name} | {effects} |")
    return "\n".join(lines)
