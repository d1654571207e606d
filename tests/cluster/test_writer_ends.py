"""What a writer (prefill rank) does with messages that come after, or around, the
request's own course.

- A request whose notice went (DONE) is tombstoned: a late ABORT (a decode group's, a
  client's during decode) is acked and reports nothing, where a fresh book reported
  "nothing held" and ended the reservation a group's other member still holds the
  prompt's pages under. Broken mode: the DONE row without its tombstone.
- A PLAN that came before the PREFILL binds the owner: a PREFILL that names another
  owner (or incarnation) fails the request, and nothing of that plan is written into the
  named owner's pool. Broken mode: the PREFILL's owner taken as it comes.
- A batch that failed with puts still outstanding holds the source pages until they end.
  Broken mode: the pages go back to the pool at once.
- A part that lands while the rest of the writes is paused (an injected pause) is not the
  last write. Broken mode: the notice names the pages the pause kept back."""

from __future__ import annotations

import numpy as np
import pytest
from test_pipelined import HoldingRuntime
from test_pipelined import _writer as _pipelined_writer
from test_protocol_units import _writer

from kvferry.cluster import messages as m
from kvferry.cluster import prefill as prefill_module
from kvferry.cluster import prefill_path
from kvferry.engine.protocol import writer as core
from kvferry.engine.protocol.table import Move

PROMPT = 40  # 3 pages of 16


def _prefill(rt, rid: str, owner: int, share: str, owner_inc: int = 1) -> None:
    rt.deliver(
        m.PREFILL,
        src=0,
        rid=rid,
        tokens=np.arange(PROMPT, dtype="<i4").tobytes(),
        offset=0,
        total=PROMPT,
        owner=owner,
        owner_inc=owner_inc,
        share=share,
    )


@pytest.mark.parametrize("tombstoned", [True, False], ids=["contract", "broken-forgotten"])
def test_a_late_abort_of_a_finished_member_ends_nothing_the_group_holds(monkeypatch, tombstoned):
    if not tombstoned:
        key = (core.WriterState.NOTIFYING, core.WriterEvent.NOTICE_FLUSHED)
        monkeypatch.setitem(
            core.WRITER_TABLE, key, Move(core.WriterState.DONE, (core.WriterDo.FREE_SOURCE,))
        )
    writer, rt = _writer()
    # member R into owner 2, member R.1 into owner 3, both held under the share R
    rt.deliver(m.PLAN, src=2, rid="R", offset=0, total=3, pages=[5, 6, 7], generations=[1] * 3)
    _prefill(rt, "R", 2, "R")
    _prefill(rt, "R.1", 3, "R")
    rt.pump()
    assert "R" not in writer.jobs and writer.jobs["R.1"]  # R is done; R.1 waits for its plan
    before = len(rt.sent)
    rt.deliver(m.ABORT, src=0, rid="R", owner=2, writers=[1], source="client", reason="gone")
    rt.pump()
    released = [f for _, k, f in rt.sent[before:] if k == "RELEASED" and f["rid"] == "R"]
    if not tombstoned:
        assert released and released[0]["justification"] == "nothing-posted"  # caught
        return
    assert released == []
    acks = [(to, f["rid"]) for to, k, f in rt.sent[before:] if k == "ABORT_ACK"]
    assert acks == [(2, "R")]


@pytest.mark.parametrize("bound", [True, False], ids=["contract", "broken-overwritten"])
@pytest.mark.parametrize("differs", ["rank", "incarnation"])
def test_a_plan_before_its_prefill_binds_the_owner(monkeypatch, bound, differs):
    if not bound:
        monkeypatch.setattr(
            prefill_module.PrefillRank, "_planned_by_another", staticmethod(lambda job, msg: None)
        )
    _, rt = _writer()
    rt.deliver(m.PLAN, src=2, rid="X", offset=0, total=3, pages=[5, 6, 7], generations=[1] * 3)
    owner, inc = (3, 1) if differs == "rank" else (2, 99)
    _prefill(rt, "X", owner, "X", owner_inc=inc)
    rt.pump()
    written_to = sorted({rank for rank, _ in rt.writes})
    if not bound:
        assert written_to == [owner]  # the plan's pages written into another pool: caught
        return
    assert written_to == []
    told = [f for _, k, f in rt.sent if k == "ABORT" and f["rid"] == "X"]
    assert told and "its PLAN came from rank 2" in told[0]["reason"]


class _FailedReading:
    """A write batch that failed with some of its puts still outstanding (over tcp, a
    failed endpoint's queued puts go on), until the test says they ended."""

    error = "peer failed: UCS_ERR_ENDPOINT_TIMEOUT"

    def __init__(self) -> None:
        self.outstanding = True

    def status(self):
        from kvferry.transfer import BatchStatus

        return BatchStatus.FAILED

    peek = status

    def reading(self) -> bool:
        return self.outstanding


class _TimedHolding(HoldingRuntime):
    """Write batches held until the test settles them; timers run when the test says."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.timers: list = []

    def call_later(self, delay, fn, rid=None):
        self.timers.append(fn)

    def fire_timers(self) -> None:
        timers, self.timers = self.timers, []
        for fn in timers:
            fn()


@pytest.mark.parametrize("waits", [True, False], ids=["contract", "broken-frees-at-once"])
def test_source_pages_wait_for_a_failed_batch_s_puts(monkeypatch, waits):
    """A batch fails while its puts may still read the source pages: the pages go back to
    the pool (and the job ends) only once those puts ended. Broken mode: the pages go back
    at once, and a new request's prefill overwrites what the old puts still send."""
    if not waits:
        monkeypatch.setattr(_FailedReading, "reading", lambda self: False)
    rt = _TimedHolding(rank=1)
    writer, _ = _pipelined_writer(rt)
    writer.path.step_ahead = False
    tokens = np.arange(100, dtype="<i4").tobytes()
    rt.deliver(m.PREFILL, src=0, rid="A", tokens=tokens, offset=0, total=100, owner=2, owner_inc=1)
    rt.pump()
    rt.deliver(
        m.PLAN, src=2, rid="A", offset=0, total=7, pages=list(range(20, 27)), generations=[1] * 7
    )
    sources = set(writer.jobs["A"].src_pages)
    ((_, callback),) = rt.in_flight
    rt.in_flight.clear()
    failed = _FailedReading()
    callback(failed)
    rt.pump()
    held = set(writer.allocator.pages_of("A"))
    if not waits:
        assert not held  # freed while the puts may still read them: caught
        return
    assert held == sources and "A" in writer.jobs
    rt.fire_timers()  # looked at again: still reading
    assert set(writer.allocator.pages_of("A")) == sources
    failed.outstanding = False
    rt.fire_timers()
    rt.pump()
    assert not writer.allocator.pages_of("A") and "A" not in writer.jobs


@pytest.mark.parametrize("held", [True, False], ids=["contract", "broken-part-counts-as-last"])
def test_a_part_that_lands_while_the_rest_is_paused_is_not_the_last(monkeypatch, held):
    """A pause injected before the rest of a pipelined prompt is posted, while a part is
    in flight: the part landing does not end the writes, and the notice, once everything
    is written, names only pages that were. Broken mode: the part counts as the last
    write, and the notice names the pages the pause kept back."""
    from test_pipelined import PLANNED

    from kvferry.cluster.faults import FaultPlan
    from kvferry.engine.tokenizer import encode_array

    if not held:
        monkeypatch.setattr(
            prefill_path.PrefillPath, "_writes_waiting", staticmethod(lambda job: job.queued())
        )
    rt = _TimedHolding(rank=1)
    rt.faults = FaultPlan.parse(["at:before-write:pause:MARK:0.5"])
    writer, _ = _pipelined_writer(rt)
    tokens = encode_array(("MARK " * 20)[:100])
    rt.deliver(m.PLAN, src=2, rid="r", offset=0, total=7, pages=PLANNED, generations=[1] * 7)
    rt.deliver(
        m.PREFILL,
        src=0,
        rid="r",
        tokens=tokens.tobytes(),
        offset=0,
        total=100,
        owner=2,
        owner_inc=1,
    )
    rt.pump_once()  # the first step: part [0, 2) posted, in flight
    for _ in range(50):  # the rest of the prefill: its writes paused before they go
        rt.pump()
    rt.settle_all()  # the part lands during the pause
    rt.fire_timers()  # the pause ends
    rt.settle_all()
    for _ in range(5):
        rt.pump()
    page_bytes = writer.pool.page_bytes
    written = {int(p) for _, runs in rt.writes for p in runs[:, 1] // page_bytes}
    named = {int(p) for _, k, f in rt.sent if k == "NOTICE" for p in f["pages"]}
    if not held:
        assert named - written  # pages never written, named: caught
        return
    assert named == written == set(PLANNED)
