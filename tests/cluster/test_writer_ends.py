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
  last write. Broken mode: the notice names the pages the pause kept back.
- A notice or an ack whose flush failed proves nothing: the source pages stay held until
  an ack's flush completes. Broken modes: a failed flush taken as done.
- A raise injected after the notice still forgets the job. Broken mode: the job kept."""

from __future__ import annotations

import pytest
from test_pipelined import PLANNED, HoldingRuntime, _plan_then_prompt, _pump
from test_pipelined import _writer as _pipelined_writer
from test_protocol_units import RecordingRuntime, _writer

from kvferry.cluster import messages as m
from kvferry.cluster import ports, prefill_path
from kvferry.cluster import prefill as prefill_module
from kvferry.engine.protocol import writer as core
from kvferry.engine.protocol.table import Move
from kvferry.transfer import BatchStatus

PROMPT = 40  # 3 pages of 16


def _plan_then_marked_prompt(rt, rid: str) -> None:
    """Owner 2's PLAN of ``rid`` (7 pages), then its PREFILL: 100 tokens of "MARK ...",
    the text a fault plan's ``MARK`` matches."""
    from kvferry.engine.tokenizer import encode_array

    tokens = encode_array(("MARK " * 20)[:100])
    rt.deliver(m.PLAN, src=2, rid=rid, offset=0, total=7, pages=PLANNED, generations=[1] * 7)
    rt.deliver(
        m.PREFILL,
        src=0,
        rid=rid,
        tokens=tokens.tobytes(),
        offset=0,
        total=100,
        owner=2,
        owner_inc=1,
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
    rt.deliver_prompt("R", PROMPT, 2, share="R")
    rt.deliver_prompt("R.1", PROMPT, 3, share="R")
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
    rt.deliver_prompt("X", PROMPT, owner, share="X", owner_inc=inc)
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
        return BatchStatus.FAILED

    peek = status

    def reading(self) -> bool:
        return self.outstanding


class _TimedHolding(HoldingRuntime):
    """Write batches held until the test settles them; timers run when the test says; a
    watched object that is still pending waits for :meth:`settle_watches`."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.timers: list = []
        self.watches: list = []

    def call_later(self, delay, fn, rid=None):
        self.timers.append(fn)

    def fire_timers(self) -> None:
        timers, self.timers = self.timers, []
        for fn in timers:
            fn()

    def watch(self, batch, callback, rid=None) -> None:
        peek = getattr(batch, "peek", None)
        if peek is not None and peek() is BatchStatus.PENDING:
            self.watches.append((batch, callback))
        else:
            super().watch(batch, callback, rid)

    def settle_watches(self) -> None:
        """What RankRuntime's pump does with its watches: call back the settled ones."""
        current, self.watches = self.watches, []
        for batch, callback in current:
            if batch.peek() is BatchStatus.PENDING:
                self.watches.append((batch, callback))
            else:
                callback(batch)


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
    rt.deliver_prompt("A", 100)
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
    rt.settle_watches()  # the next pump: still reading
    assert set(writer.allocator.pages_of("A")) == sources and rt.watches
    failed.outstanding = False
    rt.settle_watches()  # the first pump after the puts ended goes on
    rt.pump()
    assert not writer.allocator.pages_of("A") and "A" not in writer.jobs
    assert rt.timers == []  # watched by the runtime, not polled by a timer


@pytest.mark.parametrize("held", [True, False], ids=["contract", "broken-part-counts-as-last"])
def test_a_part_that_lands_while_the_rest_is_paused_is_not_the_last(monkeypatch, held):
    """A pause injected before the rest of a pipelined prompt is posted, while a part is
    in flight: the part landing does not end the writes, and the notice, once everything
    is written, names only pages that were. Broken mode: the part counts as the last
    write, and the notice names the pages the pause kept back."""
    from kvferry.cluster.faults import FaultPlan

    if not held:
        monkeypatch.setattr(
            prefill_path.PrefillPath, "_writes_waiting", staticmethod(lambda job: job.queued())
        )
    rt = _TimedHolding(rank=1)
    rt.faults = FaultPlan.parse(["at:before-write:pause:MARK:0.5"])
    writer, _ = _pipelined_writer(rt)
    _plan_then_marked_prompt(rt, "r")
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


class _FailedFlush:
    """A notify whose flush failed (the owner's endpoint reset under it)."""

    error = "flush failed: UCS_ERR_CONNECTION_RESET"

    def status(self):
        return BatchStatus.FAILED

    peek = status


class _FlushFailing(RecordingRuntime):
    """Writes land at once; a notify of a kind in ``failing`` has its flush fail."""

    def __init__(self, rank: int, failing: set[str]) -> None:
        super().__init__(rank)
        self.failing = failing

    def notify(self, rank, kind, **fields):
        done = self.send(rank, kind, **fields)
        return _FailedFlush() if kind.name in self.failing else done


def _released(rt, rid: str) -> list[dict]:
    return [f for _, k, f in rt.sent if k == "RELEASED" and f["rid"] == rid]


def _ends(rt, rid: str) -> list[tuple[str, str]]:
    return [(f["how"], f["justification"]) for f in _released(rt, rid)]


@pytest.mark.parametrize("proof", [True, False], ids=["contract", "broken-failed-counts"])
def test_a_notice_whose_flush_failed_fails_the_request(monkeypatch, proof):
    """Every write landed, but the notice's flush fails: nothing proves the writes ended,
    so the request fails (the router and the owner told why) and the source pages wait
    for the ack, freed once its flush completes. Broken mode: the notice's watch feeds
    NOTICE_FLUSHED whatever the flush did; the request ends as served, its pages freed
    on a proof that never was."""
    if not proof:
        monkeypatch.setattr(
            prefill_path.WritePath,
            "_notice_settled",
            lambda self, job, b: self.driver.feed(job, core.WriterEvent.NOTICE_FLUSHED),
        )
    rt = _FlushFailing(rank=1, failing={"NOTICE"})
    writer, _ = _pipelined_writer(rt)
    _plan_then_prompt(rt, "N")
    _pump(rt)
    assert "NOTICE" in rt.kinds() and "N" not in writer.jobs
    assert not writer.allocator.pages_of("N")
    if not proof:
        assert _ends(rt, "N") == [("freed", "own-flush")] and "ABORT" not in rt.kinds()
        return
    told = sorted(to for to, k, f in rt.sent if k == "ABORT")
    reasons = {f["reason"] for _, k, f in rt.sent if k == "ABORT"}
    assert told == [0, 2] and reasons == {"notice to rank 2 failed to flush: " + _FailedFlush.error}
    assert rt.kinds().count("ABORT_ACK") == 1
    assert _ends(rt, "N") == [("aborted", "own-flush")]  # after the ack's flush


@pytest.mark.parametrize("proof", [True, False], ids=["contract", "broken-failed-counts"])
def test_an_ack_whose_flush_failed_frees_the_source_pages_as_drained(monkeypatch, proof):
    """An ABORT during the prefill; the ack's flush fails. The ack followed the drain,
    so no batch reads the source pages: they are freed, and RELEASED says ``drained``,
    not ``own-flush`` (the owner got no proof and waits for this writer's end). Broken
    mode: the table takes a failed ack's flush as done, and RELEASED claims a flush."""
    S, E, D = core.WriterState, core.WriterEvent, core.WriterDo
    if not proof:
        monkeypatch.setitem(
            core.WRITER_TABLE, (S.ACKING, E.ACK_FAILED), Move(S.ABORTED, (D.FREE_SOURCE,))
        )
    rt = _FlushFailing(rank=1, failing={"ABORT_ACK"})
    writer, _ = _pipelined_writer(rt)
    rt.deliver_prompt("K", 100)  # computing: no plan, nothing posted
    assert writer.allocator.pages_of("K")
    rt.deliver(m.ABORT, src=2, rid="K", owner=2, writers=[1], source="client", reason="gone")
    assert not writer.allocator.pages_of("K") and "K" not in writer.jobs
    if not proof:
        assert _ends(rt, "K") == [("aborted", "own-flush")]  # caught: a flush claimed
        return
    assert _ends(rt, "K") == [("aborted", "drained")]


@pytest.mark.parametrize("forgets", [True, False], ids=["contract", "broken-kept"])
def test_a_raise_after_the_notice_still_forgets_the_job(monkeypatch, forgets):
    """A raise injected at after-notice (the fault hook run once the job is DONE): the
    exception reaches the runtime, and the job is gone from the writer's books all the
    same. Broken mode: the removal after the hook, skipped by its raise."""
    from kvferry.cluster.faults import FaultPlan, InjectedFault

    if not forgets:

        def settled(self, job, move) -> None:
            if not move.ignored and job.state is core.WriterState.DONE:
                self.path.finished(job)
            if not move.ignored and job.state in (core.WriterState.DONE, core.WriterState.ABORTED):
                self.jobs.pop(job.rid, None)

        monkeypatch.setattr(prefill_module.PrefillRank, "_settled", settled)
    rt = RecordingRuntime(rank=1)
    rt.faults = FaultPlan.parse(["at:after-notice:raise:MARK"])
    writer, _ = _pipelined_writer(rt)
    _plan_then_marked_prompt(rt, "n")
    with pytest.raises(InjectedFault):
        _pump(rt)
    assert "NOTICE" in rt.kinds() and not writer.allocator.pages_of("n")
    if not forgets:
        assert "n" in writer.jobs  # the DONE job left behind: caught
        return
    assert "n" not in writer.jobs and not writer.in_flight()


class _AckUnposted(RecordingRuntime):
    """The owner cannot be sent an ack (unflushable, or severed): ``notify`` gives None."""

    def notify(self, rank, kind, **fields):
        return None if kind.name == "ABORT_ACK" else super().notify(rank, kind, **fields)


@pytest.mark.parametrize("honest", [True, False], ids=["contract", "broken-claims-a-flush"])
def test_an_ack_never_posted_frees_the_source_pages_as_drained(monkeypatch, honest):
    """An ABORT during the prefill, and the ack cannot be posted: no flush was made, so
    the source pages go as ``drained`` (nothing of the request reads them), never as
    ``own-flush``. Broken mode: the port reports a flush that was never made."""
    if not honest:
        real = ports.RankWriterWire.send_ack

        def send_ack(self, rid, owner, flushed):
            real(self, rid, owner, None if flushed is None else lambda ok: flushed(True))

        monkeypatch.setattr(ports.RankWriterWire, "send_ack", send_ack)
    rt = _AckUnposted(rank=1)
    writer, _ = _pipelined_writer(rt)
    rt.deliver_prompt("U", 100)  # computing: no plan, nothing posted
    rt.deliver(m.ABORT, src=2, rid="U", owner=2, writers=[1], source="client", reason="gone")
    assert not writer.allocator.pages_of("U") and "U" not in writer.jobs
    assert _ends(rt, "U") == [("aborted", "drained" if honest else "own-flush")]


class _Guarding(RecordingRuntime):
    """Runs deferred work and ``run_for`` as RankRuntime does: an exception ends the
    request it runs for (``on_request_error``), and the rank goes on."""

    def run_for(self, rid, what, fn) -> None:
        try:
            fn()
        except Exception as exc:
            self.on_request_error(rid, f"internal error in {what}: {exc}")

    def defer(self, fn, rid=None) -> None:
        super().defer(lambda: self.run_for(rid, "a deferred step", fn), rid)


@pytest.mark.parametrize("own_id", [True, False], ids=["contract", "broken-share-blamed"])
def test_an_exception_in_one_members_writes_fails_that_member(monkeypatch, own_id):
    """Two members' jobs share one prefill (named by the first's id). When the prefill
    ends, the second job's writes raise: that job fails, under its own id, and the first,
    whose writes went out, goes on. Broken mode: the exception ends the share's id, the
    first job's, done already, and the second is left waiting for an abort from
    elsewhere."""
    if not own_id:

        def kv_ready(self, run) -> None:
            for job in run.checksummed:
                if job.state in prefill_path.COMPUTING:
                    self.driver.feed(job, core.WriterEvent.KV_READY)

        monkeypatch.setattr(prefill_path.PrefillPath, "_kv_ready", kv_ready)
    real = prefill_path.PrefillPath.post_writes

    def post_writes(self, job) -> None:
        if job.rid == "R.1":
            raise RuntimeError("writes of R.1 refused")
        real(self, job)

    monkeypatch.setattr(prefill_path.PrefillPath, "post_writes", post_writes)
    writer, rt = _writer(runtime=_Guarding)
    rt.deliver(m.PLAN, src=2, rid="R", offset=0, total=3, pages=[5, 6, 7], generations=[1] * 3)
    rt.deliver(m.PLAN, src=3, rid="R.1", offset=0, total=3, pages=[1, 2, 3], generations=[1] * 3)
    rt.deliver_prompt("R", PROMPT, 2, share="R")
    rt.deliver_prompt("R.1", PROMPT, 3, share="R")
    rt.pump()
    aborted = sorted({f["rid"] for _, k, f in rt.sent if k == "ABORT"})
    if not own_id:
        assert aborted == []  # caught: the share's id (R, done) blamed, R.1 left as it was
        assert "R.1" in writer.jobs
        return
    assert aborted == ["R.1"] and "R.1" not in writer.jobs  # failed, acked, forgotten
    assert "writes of R.1 refused" in next(
        f["reason"] for _, k, f in rt.sent if k == "ABORT" and f["rid"] == "R.1"
    )
