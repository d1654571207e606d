"""Severing is not proof that nothing more lands: over tcp, a write batch force-closed
mid-flight reads FAILED while its puts are still queued, and they land after the close.
An engine closed or failed with writes not flushed is unflushable: every later notice or
flush to it, on any endpoint, raises UnflushableError, so no ack can claim to follow
those writes. Broken mode: an engine that forgets them sends the notice on a new endpoint
while the old puts are still outstanding, and the test catches it.

Two engines in this process over tcp on loopback; the target does not progress while the
writer posts (as a busy or stalled owner would not), so its puts stay queued."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvferry.transfer import (
    BatchStatus,
    TransferConfig,
    TransferEngine,
    UnflushableError,
    ucxinfo,
)
from kvferry.transfer.liveness import PeerTable

_RUNNING = tuple(int(x) for x in ucxinfo.versions()["running"].split(".")[:2])
pytestmark = pytest.mark.skipif(
    _RUNNING < (1, 14),
    reason="UCX 1.13 (Debian's) aborts in its tcp teardown after a force-closed endpoint "
    "is followed by a new one to the same engine; seen in CI, not understood yet",
)

N = 32 << 20  # well over a socket's buffers: most of it stays queued in UCX
RUN = 1 << 20


def _engines():
    return (
        TransferEngine(TransferConfig(transports="tcp", name="writer")),
        TransferEngine(TransferConfig(transports="tcp", name="owner")),
    )


def _connected(w: TransferEngine, o: TransferEngine, seen: list):
    """The writer's endpoint to the owner, once a first message crossed it."""
    peer = w.connect(o.address, "owner")
    w.send(peer, b"hello")
    deadline = time.monotonic() + 10
    while not seen:
        assert time.monotonic() < deadline, "the first message did not cross"
        w.progress(0.005)
        o.progress(0.005)
    seen.clear()
    return peer


def _posted_and_severed(w, o, dst, seen):
    """A write of N bytes into ``dst`` posted while the owner does not progress, then the
    writer's endpoint force-closed with it in flight. Returns the write's batch."""
    peer = _connected(w, o, seen)
    rseg = w.open_segment(peer, dst.descriptor())
    src = w.allocate(N)
    src.as_numpy()[:] = 0x11
    runs = np.array([[i, i, RUN] for i in range(0, N, RUN)], dtype=np.int64)
    batch = w.write(peer, src, rseg, runs)
    for _ in range(20):  # the writer pushes what the socket takes
        w.progress(0.005)
    assert batch.peek() is BatchStatus.PENDING, "the owner never progressed: it cannot be done"
    w.close(peer, force=True)
    return batch


@pytest.mark.parametrize("remembers", [True, False], ids=["contract", "broken-forgets"])
def test_no_notice_follows_writes_a_sever_left_in_flight(monkeypatch, remembers):
    if not remembers:
        monkeypatch.setattr(PeerTable, "_note_unflushed", lambda self, peer, how: None)
    w, o = _engines()
    with w, o:
        dst = o.allocate(N)
        view = dst.as_numpy()
        view[:] = 0
        seen: list = []
        o.set_message_handler(lambda s, p: seen.append((p, int(np.count_nonzero(view)))))
        batch = _posted_and_severed(w, o, dst, seen)
        assert batch.peek() is BatchStatus.FAILED
        assert w.reading(batch), "its puts are still queued: the sever stopped nothing"
        again = w.connect(o.address, "owner")  # a new endpoint to the same engine
        if remembers:
            with pytest.raises(UnflushableError, match="not flushed"):
                w.notify(again, b"MARKER")
            with pytest.raises(UnflushableError):
                w.quiesce(again)
            assert w.counters.unflushable_peers == 1 and w.counters.notices_refused == 2
            w.send(again, b"control")  # plain messages still go: they claim nothing
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                w.progress(0.002)
                o.progress(0.002)
            assert [p for p, _ in seen] == [b"control"]
            return
        note = w.notify(again, b"MARKER")  # BROKEN: posted behind nothing it should follow
        assert w.reading(batch), "the notice went while the old puts were outstanding"
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            w.progress(0.002)
            o.progress(0.002)
        assert note.peek() is not BatchStatus.FAILED
        assert [p for p, _ in seen] == [b"MARKER"]


def test_a_close_after_the_writes_flushed_leaves_the_engine_flushable():
    w, o = _engines()
    with w, o:
        dst = o.allocate(N)
        seen: list = []
        o.set_message_handler(lambda s, p: seen.append(p))
        peer = _connected(w, o, seen)
        rseg = w.open_segment(peer, dst.descriptor())
        src = w.allocate(N)
        runs = np.array([[0, 0, RUN]], dtype=np.int64)
        batch = w.write(peer, src, rseg, runs)
        deadline = time.monotonic() + 10
        while batch.peek() is BatchStatus.PENDING:
            assert time.monotonic() < deadline, "the write did not complete"
            w.progress(0.002)
            o.progress(0.002)
        assert batch.peek() is BatchStatus.COMPLETED
        w.close(peer, force=True)  # nothing in flight: the flush had covered it
        again = w.connect(o.address, "owner")
        w.notify(again, b"after")
        assert w.counters.unflushable_peers == 0 and w.counters.notices_refused == 0
