"""How a writer sizes its batches and how a decoding owner shares its time with the
transfers into it (the loaded-owner case: over tcp the owner's own progress moves the
bytes), each with its broken mode."""

from __future__ import annotations

import pytest
from test_cluster_units import _Engine, _runtime

from kvferry.cluster.batching import MIN_BATCH_BYTES, BatchSizer
from kvferry.engine.protocol.words import Kind

GIB = 1 << 30


@pytest.mark.parametrize("measured", [True, False], ids=["measured", "broken-copy-bound"])
def test_batches_take_what_the_measured_rate_moves_in_the_target_time(measured):
    """First batch to an owner: the minimum. After a batch measured at tcp speed (100 MB/s)
    the next carries what that moves in the target time (0.5 s), so an aborted writer's
    last batch lands inside the deadline; a fast link grows it up to the copy bound.
    Broken mode (the bound from the host's copy bandwidth, whatever the transport) posts a
    batch that takes 10 s over that link, and the test sees it."""
    sizer = BatchSizer(target_s=0.5, max_bytes=GIB)
    if not measured:
        sizer.batch_bytes = lambda owner: sizer.max_bytes
    first = sizer.batch_bytes(2)
    sizer.settled(2, 16 << 20, (16 << 20) / 100e6)  # 100 MB/s, as tcp under load
    slow = sizer.batch_bytes(2)
    if not measured:
        assert slow / 100e6 > 5.0  # the test catches the batch past the deadline
        return
    assert first == MIN_BATCH_BYTES
    assert slow / 100e6 <= 0.5 + 1e-9 and slow >= MIN_BATCH_BYTES
    for _ in range(8):
        sizer.settled(3, 256 << 20, (256 << 20) / 20e9)  # a fast copy
    assert sizer.batch_bytes(3) == GIB  # capped at the bound
    assert sizer.batch_bytes(2) == slow  # per owner
    sizer.settled(2, 1 << 10, 1.0)  # too small to say anything
    assert sizer.batch_bytes(2) == slow


@pytest.mark.parametrize("drains", [True, False], ids=["drains", "broken-one-poll"])
def test_a_decoding_owner_keeps_progressing_while_the_wire_is_busy(drains, monkeypatch):
    """progress_for pumps until the engine has nothing more (or the budget is spent): a
    burst of arrivals is taken in one call. Broken mode (one poll per decode step, as
    before) leaves most of the burst waiting behind the next step, and the test sees it."""
    from kvferry.cluster import messages as m
    from kvferry.cluster.runtime import RankRuntime

    engine = _Engine()
    rt = _runtime(engine)
    got: list[str] = []
    rt.set_handlers({k: lambda msg: got.append(msg.rid) for k in Kind}, role="test")
    arrivals = [
        rt.seal_to_self(m.encode(m.ABORT_ACK.make(src=1, inc=7, seq=i + 1, rid=f"r{i}")))
        for i in range(20)
    ]

    def progress(
        timeout_s=0, stay_awake=False, drain_us=0
    ):  # one message per poll, as a busy socket
        if arrivals:
            engine.handler(b"rank1", arrivals.pop(0))
            return 1
        return 0

    engine.progress = progress
    if not drains:
        monkeypatch.setattr(RankRuntime, "progress_for", lambda self, budget_s: self.pump(0.0))
    rt.progress_for(1.0)
    if not drains:
        assert len(got) == 1  # the test catches the starved transfers
        return
    assert got == [f"r{i}" for i in range(20)]
