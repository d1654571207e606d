"""A long prompt's next model step computes on a thread of its own while the writer posts
the part its last step made final (cluster/stepahead.py): the step has always ended before
the writer gives the rank's loop its turn (where an ABORT may free the source pages), and
the writer sends exactly what it sends without it."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
from test_pipelined import _plan_then_prompt, _pump, _writer
from test_protocol_units import RecordingRuntime

from kvferry.cluster.stepahead import StepAhead


class LoopWatch(RecordingRuntime):
    """Records how many model steps are running each time the prefill hands the rank's
    loop its turn (a slice's end defers the next slice: messages are handled between)."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.model_steps: GatedSteps | None = None
        self.running_at_turns: list[int] = []

    def defer(self, fn, rid=None) -> None:
        assert self.model_steps is not None
        self.running_at_turns.append(self.model_steps.running)
        self.model_steps.release.set()  # a step still running may end now
        super().defer(fn, rid)


class GatedSteps:
    """Wraps a model's prefill generator: a step taken on another thread than the test's
    waits for ``release`` before it computes, so it is still running at any moment
    before that, whatever the scheduler does."""

    def __init__(self, model) -> None:
        self.model = model
        self.running = 0
        self.ahead = 0  # steps taken on the step-ahead thread
        self.release = threading.Event()

    def prefill_layers(self, *args, **kwargs):
        inner = self.model.prefill_layers(*args, **kwargs)
        while True:
            self.running += 1
            try:
                if threading.current_thread() is not threading.main_thread():
                    self.ahead += 1
                    assert self.release.wait(30), "a step ahead was never released"
                yielded = next(inner)
            except StopIteration as end:
                return end.value
            finally:
                self.running -= 1
            yield yielded

    def __getattr__(self, name):
        return getattr(self.model, name)


def _gated_writer(monkeypatch, settle_before_the_loop: bool):
    rt = LoopWatch(rank=1)
    writer, model = _writer(rt)
    steps = rt.model_steps = GatedSteps(model)
    writer.path.model = steps
    writer.path._ahead = cf.ThreadPoolExecutor(1)  # whatever this machine's CPU count
    start, settle = StepAhead.start, StepAhead.settle

    def gated_start(self) -> None:
        steps.release.clear()  # the step started now waits, until released
        start(self)

    def gated_settle(self) -> None:
        steps.release.set()
        settle(self)

    monkeypatch.setattr(StepAhead, "start", gated_start)
    monkeypatch.setattr(
        StepAhead, "settle", gated_settle if settle_before_the_loop else lambda self: None
    )
    return writer, rt, steps


def test_a_step_ahead_has_ended_before_the_rank_loop_runs(monkeypatch):
    _, rt, steps = _gated_writer(monkeypatch, settle_before_the_loop=True)
    _plan_then_prompt(rt, "p1")
    _pump(rt)
    assert steps.ahead >= 2, "the steps after each part ran ahead"
    assert rt.running_at_turns and set(rt.running_at_turns) == {0}
    assert [k for k in rt.kinds() if k in ("NOTICE_PART", "NOTICE")] == ["NOTICE_PART"] * 3 + [
        "NOTICE"
    ]


def test_broken_mode_a_step_ahead_left_running_into_the_loop_is_seen(monkeypatch):
    """Broken mode: the writer yields to the rank's loop without waiting for the step it
    started (an ABORT handled then could free the pages the step is writing)."""
    _, rt, _ = _gated_writer(monkeypatch, settle_before_the_loop=False)
    _plan_then_prompt(rt, "p1")
    _pump(rt)
    assert max(rt.running_at_turns) > 0


def test_the_writer_sends_the_same_with_and_without_steps_ahead():
    sent = []
    for ahead in (True, False):
        rt = RecordingRuntime(rank=1)
        writer, _ = _writer(rt)
        writer.pool.kv.zero_()  # the last page's unwritten slots: the same in both
        writer.path.step_ahead = ahead
        writer.path._ahead = cf.ThreadPoolExecutor(1) if ahead else None
        _plan_then_prompt(rt, "p1")
        _pump(rt)
        sent.append(rt)
    with_, without = sent
    assert with_.kinds() == without.kinds()
    for (_, kind, f), (_, _, g) in zip(with_.sent, without.sent, strict=True):
        for key in ("pages", "checksums", "first_token", "offset"):
            if key in f:
                assert np.array_equal(np.asarray(f[key]), np.asarray(g[key])), (kind, key)
    assert [r.tolist() for _, r in with_.writes] == [r.tolist() for _, r in without.writes]
