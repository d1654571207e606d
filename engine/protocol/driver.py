"""The one executor of the protocol's tables: events in, effects out, in order.

A host (a decode or prefill rank, the vLLM connector, the simulator, the property walk)
turns what arrives into an event and feeds it here. The driver moves the subject's book
by the table and carries out the row's effects through the host's ``perform``, all of
them, in the row's order, before it takes the next event. An effect that produces an
event of its own (a check that fails, a flush that completed at once, a proof found
while severing) feeds it like any other input: it waits in the queue until the row in
progress is done. So no row is ever interrupted by another, whatever the order of its
entries; without this, the safety of a row depended on that order, which nothing checked.

A subject may be pinned (:meth:`Driver.pin`) while work outside the driver uses its
pages (a decode step running on another thread reads them and writes the new token's KV
into them): its events wait, in order, until it is unpinned, so no effect frees or
releases pages under that work; other subjects' events go on meanwhile.

Two hooks see every move: ``observe`` right after the book moved (before the effects:
when the abort began, which states count as busy) and ``settled`` after its effects (a
subject that reached a terminal state is forgotten by its host).

No I/O, no clock: plain Python, for every host alike.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from .ports import Clock
from .table import Move, step

__all__ = ["Clock", "Driver", "TableDriver"]

S = TypeVar("S", bound=enum.Enum)  # the table's states
E = TypeVar("E", bound=enum.Enum)  # its events
D = TypeVar("D", bound=enum.Enum)  # its effects
T = TypeVar("T")  # the subject: anything with a ``book`` whose ``state`` the table moves


class Driver(Generic[S, E, D, T]):
    """Carries out ``table`` for the subjects fed to it, one event at a time.

    ``perform(effect, subject)`` does one effect (the host's port for it). ``observe(
    subject, event, before, move)`` is called once the book moved, ``settled(subject,
    move)`` once the move's effects are done; both optional."""

    def __init__(
        self,
        table: Mapping[tuple[S, E], Move[S, D]],
        perform: Callable[[D, T], None],
        *,
        observe: Callable[[T, E, S, Move[S, D]], None] | None = None,
        settled: Callable[[T, Move[S, D]], None] | None = None,
    ) -> None:
        self.table = table
        self.perform = perform
        self.observe = observe
        self.settled = settled
        self._queue: deque[tuple[T, E]] = deque()
        self._draining = False
        self._pinned: dict[int, tuple[T, list[E]]] = {}  # id(subject) -> its waiting events
        self.moves = 0  # moves made, ignored ones included

    @property
    def draining(self) -> bool:
        """A row's effects are being carried out now (a feed waits in the queue)."""
        return self._draining

    def feed(self, subject: T, event: E) -> None:
        """Move ``subject`` by ``event`` and carry out the effects, now, or right after
        the row in progress when called from one of its effects. An exception in an
        effect does not drop the events queued behind it: they are carried out, then
        the first exception is raised to the caller (whose host ends the request)."""
        self._queue.append((subject, event))
        self._drain()

    def _drain(self) -> None:
        if self._draining:
            return
        self._draining = True
        first: BaseException | None = None
        try:
            while self._queue:
                subj, ev = self._queue.popleft()
                pinned = self._pinned.get(id(subj))
                if pinned is not None:
                    pinned[1].append(ev)
                    continue
                try:
                    self._move(subj, ev)
                except Exception as exc:
                    first = first or exc
        finally:
            self._draining = False
        if first is not None:
            raise first

    def pin(self, subject: T) -> None:
        """Hold ``subject``'s events from now until :meth:`unpin`."""
        self._pinned.setdefault(id(subject), (subject, []))

    def unpin(self, subject: T) -> None:
        """Carry out the events ``subject`` received while pinned, in their order."""
        _, waiting = self._pinned.pop(id(subject), (subject, []))
        self._queue.extend((subject, event) for event in waiting)
        self._drain()

    def pinned(self, subject: T) -> bool:
        return id(subject) in self._pinned

    def _move(self, subject: T, event: E) -> None:
        book: Any = subject.book  # type: ignore[attr-defined]
        before = book.state
        move = step(book, event, self.table)
        self.moves += 1
        if self.observe is not None:
            self.observe(subject, event, before, move)
        for effect in move.effects:
            self.perform(effect, subject)
        if self.settled is not None:
            self.settled(subject, move)


class TableDriver(Generic[S, E, D, T]):
    """What each side's driver shares: its table carried out through its own
    :meth:`perform` on one :class:`Driver` (one event queue, no re-entrant feed)."""

    def __init__(
        self,
        table: Mapping[tuple[S, E], Move[S, D]],
        *,
        observe: Callable[[T, E, S, Move[S, D]], None] | None = None,
        settled: Callable[[T, Move[S, D]], None] | None = None,
    ) -> None:
        self.driver: Driver[S, E, D, T] = Driver(
            table, self.perform, observe=observe, settled=settled
        )

    @property
    def table(self) -> Mapping[tuple[S, E], Move[S, D]]:
        return self.driver.table

    @table.setter
    def table(self, table: Mapping[tuple[S, E], Move[S, D]]) -> None:
        self.driver.table = table

    def feed(self, subject: T, event: E) -> None:
        self.driver.feed(subject, event)

    def pin(self, subject: T) -> None:
        self.driver.pin(subject)

    def unpin(self, subject: T) -> None:
        self.driver.unpin(subject)

    def perform(self, do: D, subject: T) -> None:
        """One effect of a row (each side's driver says what each effect means)."""
        raise NotImplementedError
