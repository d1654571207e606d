"""The protocol core's tables (kvferry.engine.protocol), walked without processes.

Every (state, event) pair of both tables has an entry; a hypothesis state machine drives
each table with arbitrary inputs in arbitrary order (notices, acks, aborts, timeouts,
failures, severed writers, processes gone) through the real drivers (the owner's and the
writer's, the code the ranks run), whose ports here are fakes over the real page
allocator that check I2 and I4 at each effect and after every step. Each walk is also run against a
broken table (the one the ``--unsafe`` switch runs, and a writer that acks with writes in
flight) and must catch it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvferry.engine.allocator import PageAllocator
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol import writer as wc
from kvferry.engine.protocol.owner import OwnerDo, OwnerEvent, OwnerState
from kvferry.engine.protocol.owner_driver import OwnerDriver, OwnerPorts, OwnerTimes
from kvferry.engine.protocol.ports import SourceFreed
from kvferry.engine.protocol.proof import Proof, is_justified
from kvferry.engine.protocol.table import Move, replace, terminal
from kvferry.engine.protocol.words import AbortSource
from kvferry.engine.protocol.writer import WriterDo, WriterEvent, WriterState
from kvferry.engine.protocol.writer_driver import WriterDriver, WriterPorts

WALK = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,  # the same search on every machine: no replay of a local find
    suppress_health_check=[HealthCheck.too_slow],
)
HUNT = settings(WALK, max_examples=1000)  # a broken table must be found, every run
RELEASES = {OwnerDo.FREE, OwnerDo.RELEASE_ACKED, OwnerDo.RELEASE_SEVERED, OwnerDo.RELEASE_UNSAFE}


class _Quiet:
    """A port whose every call does nothing (messages nobody in a walk reads)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class _Handle:
    def cancel(self) -> None:
        pass


class _Timers:
    """Timers that never fire: a walk feeds the events they would (deadline, retry)."""

    def call_later(self, delay_s, fn, rid=None) -> _Handle:
        return _Handle()


class _Clock:
    def now(self) -> float:
        return 0.0


@pytest.mark.parametrize(
    "table,states,events",
    [(oc.OWNER_TABLE, OwnerState, OwnerEvent), (wc.WRITER_TABLE, WriterState, WriterEvent)],
)
def test_every_state_event_pair_has_an_entry(table, states, events):
    assert set(table) == {(s, e) for s in states for e in events}


def test_the_terminal_states_absorb_and_every_state_reaches_one():
    for table, states, ends, start in [
        (oc.OWNER_TABLE, OwnerState, {OwnerState.CLOSED}, OwnerState.NEW),
        (wc.WRITER_TABLE, WriterState, {WriterState.DONE, WriterState.ABORTED}, WriterState.NEW),
    ]:
        assert terminal(table, states) == ends
        reach = {start}
        while True:
            more = {m.to for (s, _), m in table.items() if s in reach} - reach
            if not more:
                break
            reach |= more
        assert reach == set(states), "every state is reachable from the start"


def test_the_owner_releases_only_on_its_proofs():
    """Read off the table: from a state where a writer may still write (AWAITING,
    QUARANTINED, FENCED), the only entries that free or release pages are those whose
    event is the proof."""
    proofs = {
        OwnerEvent.ABORT_FLUSHED,
        OwnerEvent.FAIL_FLUSHED,
        OwnerEvent.CORRUPT_FLUSHED,
        OwnerEvent.LAST_FLUSH,
        OwnerEvent.PROOF,
    }
    for (state, event), move in oc.OWNER_TABLE.items():
        if state in (
            OwnerState.AWAITING,
            OwnerState.QUARANTINED,
            OwnerState.FENCED,
        ) and RELEASES & set(move.effects):
            assert event in proofs, (state, event)
        assert OwnerDo.RELEASE_UNSAFE not in move.effects


# ------------------------------------------------------------------------ the owner
def owner_walk(table):
    class OwnerWalk(RuleBasedStateMachine):
        """One request at an owner with 1-3 writers; each writer may flush (notice), ack,
        be severed at the deadline, or die. ``may_land`` is the ground truth of I4: a
        writer whose writes may still land (it has proven nothing and its process lives)."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = PageAllocator(8)
            self.book: oc.OwnerBook | None = None
            self.tombstoned = False
            self.released_while_landing: list[str] = []
            self.gone: set[int] = set()
            self.flushed: set[int] = set()  # the walk's own truth, apart from the book's

        @rule(writers=st.integers(1, 3), pages=st.integers(1, 10))
        @precondition(lambda self: self.book is None)
        def assign(self, writers: int, pages: int) -> None:
            self.book = oc.OwnerBook("r")
            granted = pages <= self.alloc.free_pages
            if granted:
                self.alloc.allocate("r", pages)
            self.feed(oc.on_assign(self.book, tuple(range(writers)), granted))

        @rule(writers=st.integers(0, 3), told=st.booleans())
        @precondition(lambda self: self.book is None)
        def abort_before_assign(self, writers: int, told: bool) -> None:
            """An abort that finds the request NEW: no ASSIGN yet at a rank, or a
            connector's request waiting for its peer's handshake (writers known)."""
            self.book = oc.OwnerBook("r", tuple(range(writers)))
            self.feed(oc.on_abort(self.book, writers_told=told))
            assert self.book.state is OwnerState.CLOSED

        def writer(self, data) -> int:
            assert self.book is not None and self.book.writers
            return data.draw(st.sampled_from(self.book.writers))

        @rule(data=st.data(), whole=st.booleans())
        @precondition(lambda self: self.book is not None and self.book.writers)
        def notice(self, data, whole: bool) -> None:
            writer = self.writer(data)
            self.flushed.add(writer)  # every notice chunk follows the writer's flush
            self.feed(oc.on_notice(self.book, writer, whole))

        @rule(data=st.data())
        @precondition(lambda self: self.book is not None and self.book.writers)
        def part(self, data) -> None:
            """A pipelined NOTICE_PART: some of a writer's pages landed, later writes may
            still be in flight (its check may then end in CORRUPT, a rule of its own)."""
            self.feed(oc.on_part(self.book, self.writer(data)))

        @rule(data=st.data(), severed=st.booleans())
        @precondition(lambda self: self.book is not None and self.book.writers)
        def ack(self, data, severed: bool) -> None:
            writer = self.writer(data)
            self.flushed.add(writer)  # an ack follows the writer's flush
            self.feed(oc.on_ack(self.book, writer, severed))

        @rule(told=st.booleans())
        @precondition(lambda self: self.book is not None)
        def abort(self, told: bool) -> None:
            self.feed(oc.on_abort(self.book, writers_told=told))

        @rule()
        @precondition(lambda self: self.book is not None)
        def fail(self) -> None:
            self.feed(oc.on_failure(self.book))

        @rule(
            event=st.sampled_from(
                [OwnerEvent.VERIFIED, OwnerEvent.CORRUPT, OwnerEvent.FINISHED, OwnerEvent.RETRY]
            )
        )
        @precondition(lambda self: self.book is not None)
        def internal(self, event: OwnerEvent) -> None:
            self.feed(event)

        @rule()
        @precondition(
            lambda self: self.book is not None and self.book.state is OwnerState.QUARANTINED
        )
        def deadline(self) -> None:
            self.feed(oc.on_deadline(self.book))

        @rule(data=st.data())
        @precondition(lambda self: self.book is not None and self.book.writers)
        def dies(self, data) -> None:
            self.gone.add(self.writer(data))

        @rule()
        @precondition(lambda self: self.book is not None and self.book.state is OwnerState.FENCED)
        def proof_check(self) -> None:
            self.feed(oc.on_proof_check(self.book, dict.fromkeys(self.gone, Proof.PROCESS_GONE)))

        def feed(self, event: OwnerEvent) -> None:
            """Through the owner's real driver, over this walk's fake ports (its pages
            check I4 at each release); ``observe`` checks I2 on every move."""
            assert self.book is not None
            if not hasattr(self, "driver"):
                ports = OwnerPorts(
                    wire=_Quiet(),
                    pages=self,
                    facts=self,
                    data=_Quiet(),
                    report=self,
                    tombstones=self,
                    timers=_Timers(),
                    clock=_Clock(),
                    times=OwnerTimes(transfer_timeout_s=5.0, abort_deadline_s=5.0),
                )
                self.driver = OwnerDriver(ports, table, observe=self.observe)
            self.moving = event
            self.driver.feed(self, event)

        def observe(self, subject, event: OwnerEvent, before: OwnerState, move) -> None:
            self.before = before
            if before is OwnerState.CLOSED:
                assert move.to is OwnerState.CLOSED, "I2: CLOSED has no way out"

        # the subject's fields the driver reads
        rid, prompt_len, timer, warned, abort_started = "r", 16, None, False, 0.0
        abort_source, abort_reason, error = AbortSource.CLIENT, "walk", ""
        notices: dict = {}  # noqa: RUF012 - never written

        @property
        def writers(self) -> tuple[int, ...]:
            assert self.book is not None
            return self.book.writers

        # the pages port: every release checked against the ground truth of I4
        def _released(self, how: str) -> list[int]:
            assert self.book is not None
            landing = [w for w in self.book.writers if w not in self.flushed and w not in self.gone]
            where = f"{self.before.name} --{self.moving.name}--> {how}"
            if landing:
                self.released_while_landing.append(
                    f"{where} with writers {landing} still able to write"
                )
            if not is_justified(self.book.justification()):
                self.released_while_landing.append(
                    f"{where}: released with justification {self.book.justification()!r}"
                )
            return []

        def stamp_canaries(self, req) -> None:
            pass

        def free(self, rid: str) -> list[int]:
            self._released("free")
            return self.alloc.free(rid)

        def release(self, rid: str) -> list[int]:
            self._released("release")
            return self.alloc.release(rid)

        def quarantine(self, req) -> None:
            self.alloc.quarantine(req.rid)

        def quarantined(self, rid: str) -> bool:
            return bool(self.alloc.quarantined_pages_of(rid))

        # the writer facts port, the report port and tombstones
        def restarted_since(self, req, writer: int) -> bool:
            return False

        def proven_gone(self, req, writers) -> dict:
            return {w: Proof.PROCESS_GONE for w in writers if w in self.gone}

        def is_severed(self, writer: int) -> bool:
            return False

        def tombstone(self, rid: str, at: float) -> None:
            self.tombstoned = True

        def done(self, req, outcome) -> None:
            pass

        def nothing_held(self, rid: str) -> None:
            pass

        def closed(self, req, pages: list[int], how) -> None:
            pass

        def integrity_failure(self, req) -> None:
            pass

        def stuck(self, req, waited_s: float) -> None:
            pass

        @invariant()
        def i4_no_release_while_a_write_may_land(self) -> None:
            assert not self.released_while_landing, self.released_while_landing

        @invariant()
        def i2_closed_means_tombstoned_and_nothing_held(self) -> None:
            self.alloc.check_invariants()
            if self.book is not None and self.book.state is OwnerState.CLOSED:
                assert self.tombstoned and not self.alloc.pages_of("r")
            if self.book is not None and self.book.state in (
                OwnerState.QUARANTINED,
                OwnerState.FENCED,
            ):
                assert self.alloc.quarantined_pages_of("r") or not self.alloc.pages_of("r")

    return OwnerWalk


def _abort_before_the_plan_is_handled(table, told: bool) -> bool:
    """Nothing was allocated, so nothing is quarantined or freed: the id is tombstoned,
    the router's reservation ends with RELEASED(0), and writers the abort did not reach
    are told to drop the request (a vLLM prefill holds its blocks until then)."""
    book = oc.OwnerBook("r", (0, 1))
    move = oc.step(book, oc.on_abort(book, writers_told=told), table)
    assert not RELEASES & set(move.effects) and OwnerDo.QUARANTINE not in move.effects
    return (
        book.state is OwnerState.CLOSED
        and OwnerDo.TOMBSTONE in move.effects
        and OwnerDo.REPORT_NOTHING_HELD in move.effects
        and (OwnerDo.ABORT_WRITERS in move.effects) is (not told)
    )


@pytest.mark.parametrize("told", [False, True], ids=["untold", "told"])
def test_an_abort_before_the_plan_closes_at_once_and_tells_untold_writers(told):
    assert _abort_before_the_plan_is_handled(oc.OWNER_TABLE, told)


def test_an_owner_table_that_forgets_the_untold_writers_is_caught():
    """Broken mode: NEW | ABORT closes without ABORT_WRITERS (the prefill keeps its blocks
    until its hold timeout); the check above sees it."""
    broken = replace(
        oc.OWNER_TABLE,
        {
            (OwnerState.NEW, OwnerEvent.ABORT): Move(
                OwnerState.CLOSED, (OwnerDo.TOMBSTONE, OwnerDo.REPORT_NOTHING_HELD)
            )
        },
    )
    assert not _abort_before_the_plan_is_handled(broken, told=False)
    assert _abort_before_the_plan_is_handled(broken, told=True)


def test_the_owner_table_keeps_i2_and_i4_on_every_walk():
    run_state_machine_as_test(owner_walk(oc.OWNER_TABLE), settings=WALK)


@pytest.mark.parametrize("broken", ["unsafe", "release_on_sever", "single_ack"])
def test_the_walk_catches_a_broken_owner_table(broken):
    if broken == "single_ack":  # release on the first ack, as the spin model's mutant
        table = replace(
            oc.OWNER_TABLE,
            {
                (OwnerState.QUARANTINED, OwnerEvent.FLUSH): Move(
                    OwnerState.CLOSED, (OwnerDo.RELEASE_ACKED,)
                )
            },
        )
    else:
        table = oc.owner_table(**{broken: True})
    with pytest.raises(AssertionError, match="still able to write"):
        run_state_machine_as_test(owner_walk(table), settings=HUNT)


# ------------------------------------------------------------------------ the writer
def writer_walk(table):
    class WriterWalk(RuleBasedStateMachine):
        """One request at a writer: the prompt, the plan, the KV, batches posted and
        settling, aborts and failures in any order. I4, writer side: no ack while a batch
        is in flight, the source pages kept until a flush, nothing posted after an abort."""

        def __init__(self) -> None:
            super().__init__()
            self.alloc = PageAllocator(8)
            self.book = wc.WriterBook("r", owner=2)
            self.queued = 0
            self.stopped = False
            self.problems: list[str] = []
            self.flushes = {WriterEvent.ACK_FLUSHED, WriterEvent.NOTICE_FLUSHED}
            # an ack follows the drain: one that failed to flush frees them too (drained)
            self.ends = self.flushes | {WriterEvent.ACK_FAILED}

        @rule()
        @precondition(
            lambda self: (
                not self.alloc.pages_of("r")
                and self.book.state in (WriterState.NEW, WriterState.PLANNED)
            )
        )
        def prompt(self) -> None:
            self.alloc.allocate("r", 2)
            self.feed(WriterEvent.PROMPT)

        @rule()
        def plan(self) -> None:
            self.feed(WriterEvent.PLAN)

        @rule()
        def kv_ready(self) -> None:
            self.feed(WriterEvent.KV_READY)

        @rule()
        def kv_part(self) -> None:
            """More pages final while the rest is computed (the pipelined path)."""
            self.feed(WriterEvent.KV_PART)

        @rule(ok=st.booleans())
        @precondition(lambda self: self.book.in_flight > 0)
        def settles(self, ok: bool) -> None:
            self.feed(wc.on_settled(self.book, ok, self.queued > 0))

        @rule()
        def abort(self) -> None:
            self.feed(wc.on_abort(self.book))

        @rule()
        def fail(self) -> None:
            self.feed(wc.on_failure(self.book))

        @rule(
            event=st.sampled_from(
                [
                    WriterEvent.NOTICE_FLUSHED,
                    WriterEvent.ACK_FLUSHED,
                    WriterEvent.NOTICE_FAILED,  # a failed flush: no proof, nothing freed
                    WriterEvent.ACK_FAILED,
                ]
            )
        )
        def flushed(self, event: WriterEvent) -> None:
            self.feed(event)

        def feed(self, event: WriterEvent) -> None:
            """Through the writer's real driver, over this walk's fake ports (its data
            path, wire and source pages check I4, writer side); ``observe`` checks I2 on
            every move."""
            if not hasattr(self, "driver"):
                ports = WriterPorts(
                    data=self,
                    wire=self,
                    source=self,
                    report=_Quiet(),
                    tombstones=self,
                    clock=_Clock(),
                )
                self.driver = WriterDriver(ports, table, observe=self.observe)
            self.driver.feed(self, event)

        def observe(self, subject, event: WriterEvent, before: WriterState, move) -> None:
            self.where, self.event = f"{before.name} --{event.name}-->", event
            if before in (WriterState.DONE, WriterState.ABORTED):
                assert move.to is before, "I2: DONE and ABORTED have no way out"

        # the subject's fields the driver reads
        rid, abort_source, abort_reason = "r", AbortSource.CLIENT, "walk"

        # the data path port
        def start_prefill(self, job) -> None:
            pass

        def _post(self, what: str) -> None:
            if self.stopped:
                self.problems.append(f"{self.where} {what} after an abort")
            wc.on_posted(self.book)
            self.queued = max(0, self.queued - 1)

        def post_writes(self, job) -> None:
            self.queued = 2
            self._post("POST_WRITES")

        def post_next(self, job) -> None:
            self._post("POST_NEXT")

        def post_part(self, job) -> None:
            if not self.queued and not self.book.in_flight:  # one part at a time
                self.queued = 1
                self._post("POST_PART")

        def send_part(self, job) -> None:
            if self.book.in_flight:
                self.problems.append(f"{self.where} a part's notice before it landed")

        def send_notice(self, job) -> None:
            pass

        def stop_posting(self, job) -> None:
            self.stopped, self.queued = True, 0

        # the wire, the source pages and tombstones
        def tell_abort(self, rid, owner, source, reason) -> None:
            pass

        def send_ack(self, rid, owner, flushed) -> None:
            if self.book.in_flight:
                self.problems.append(
                    f"{self.where} an ack with {self.book.in_flight} batches in flight"
                )

        def free(self, rid: str) -> SourceFreed:
            if self.event not in self.ends or self.book.in_flight:
                self.problems.append(f"{self.where} FREE_SOURCE before a flush")
            return SourceFreed(rid, len(self.alloc.free(rid)) if self.alloc.pages_of(rid) else 0)

        def tombstone(self, rid: str, at: float) -> None:
            self.stopped = True

        @invariant()
        def i4_writer_side(self) -> None:
            assert not self.problems, self.problems
            self.alloc.check_invariants()

    return WriterWalk


def test_the_writer_table_keeps_i4_on_every_walk():
    run_state_machine_as_test(writer_walk(wc.WRITER_TABLE), settings=WALK)


@pytest.mark.parametrize("path", ["whole", "pipelined"])
@pytest.mark.parametrize("broken", ["ack_in_flight", "free_source_at_abort"])
def test_the_walk_catches_a_broken_writer_table(broken, path):
    """The writer walk on the path that reaches the changed entry must report it: plan,
    prompt, KV, one batch posted, then the abort (``whole``); or plan, prompt, one part
    posted while the rest is computed, then the abort (``pipelined``: a writer there may
    look unstarted, but a part is in flight). The path is fixed rather than searched
    for: a search of this depth is not certain to take it on every machine."""
    S, E, D = WriterState, WriterEvent, WriterDo
    move = (
        Move(S.ACKING, (D.STOP_POSTING, D.TOMBSTONE, D.SEND_ACK))
        if broken == "ack_in_flight"
        else Move(S.ABORTED, (D.STOP_POSTING, D.TOMBSTONE, D.FREE_SOURCE, D.ACK_NOW))
    )
    at = S.WRITING if path == "whole" else S.COMPUTING_PLANNED
    for table, caught in (
        (wc.WRITER_TABLE, False),
        (replace(wc.WRITER_TABLE, {(at, E.ABORT): move}), True),
    ):
        walk = writer_walk(table)()
        walk.plan()
        walk.prompt()
        walk.kv_ready() if path == "whole" else walk.kv_part()
        assert walk.book.state is at and walk.book.in_flight == 1
        walk.abort()
        if not caught:
            assert walk.book.state is S.DRAINING
            walk.i4_writer_side()  # the real table: nothing to report on the same path
            continue
        with pytest.raises(AssertionError, match=r"in flight|before a flush"):
            walk.i4_writer_side()


def test_the_walk_catches_a_failed_flush_taken_as_done():
    """A notice whose flush failed frees no source page: on the fixed path to the notice
    the real table keeps them (the request fails, and they wait for its ack); a table
    that takes the failure as the flush is reported."""
    S, E, D = WriterState, WriterEvent, WriterDo
    event = E.NOTICE_FAILED
    for table, caught in (
        (wc.WRITER_TABLE, False),
        (
            replace(
                wc.WRITER_TABLE,
                {(S.NOTIFYING, event): Move(S.DONE, (D.TOMBSTONE, D.FREE_SOURCE))},
            ),
            True,
        ),
    ):
        walk = writer_walk(table)()
        walk.plan()
        walk.prompt()
        walk.kv_ready()
        walk.settles(True)  # the first batch, then the queued one
        walk.settles(True)
        assert walk.book.state is S.NOTIFYING and walk.book.in_flight == 0
        walk.flushed(event)
        if not caught:
            walk.i4_writer_side()
            assert walk.alloc.pages_of("r")  # held: no flush proved anything
            continue
        with pytest.raises(AssertionError, match="before a flush"):
            walk.i4_writer_side()


@pytest.mark.parametrize("counted", [False, True], ids=["part-proves-nothing", "broken-part-flush"])
def test_the_walk_catches_a_notice_part_counted_as_a_flush(counted, monkeypatch):
    """A NOTICE_PART arrives while its writer still writes the rest; the abort that
    follows must quarantine. Broken mode: an owner that takes a part as the writer's
    flush (as a notice chunk is) frees the pages under the rest of the writes."""
    if counted:

        def part_as_notice(book, writer):
            book.noticed.add(writer)
            return oc.OwnerEvent.FLUSH

        monkeypatch.setattr(oc, "on_part", part_as_notice)
    walk = owner_walk(oc.OWNER_TABLE)()
    walk.assign(writers=1, pages=2)
    walk.feed(oc.on_part(walk.book, 0))
    walk.abort(told=True)
    if not counted:
        assert walk.book.state is OwnerState.QUARANTINED
        walk.i4_no_release_while_a_write_may_land()
        return
    with pytest.raises(AssertionError, match="still able to write"):
        walk.i4_no_release_while_a_write_may_land()


def test_both_tables_render_for_a_reader():
    owner, writer = oc.render_owner_table(), wc.render_writer_table()
    assert "| QUARANTINED | LAST_FLUSH | CLOSED | RELEASE_ACKED |" in owner
    assert "| DRAINING | DRAINED | ACKING | SEND_ACK |" in writer
