"""Faults with real processes: a peer killed mid-batch fails with an error naming it
within a stated bound (never a hang); out-of-range pages are refused before anything is
posted; descriptors of another incarnation are refused; malformed control input is
refused while the worker keeps running."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np
import pytest
from conftest import close_link, make_link
from transfer_peer import scattered_pages

from kvferry.transfer import (
    DeadlineExceeded,
    PeerFailedError,
    SegmentBoundsError,
    StaleIncarnationError,
    TransferConfig,
    TransferEngine,
    TransferError,
    WireError,
)
from kvferry.transfer.envelope import Envelope, encode

# Stated bound for noticing a killed peer: shm via the process watch (5 ms period), tcp
# via request errors (milliseconds) or the same watch. Generous for a loaded 2-core box.
PEER_DEATH_BOUND_S = 2.0


@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_peer_killed_mid_batch_fails_naming_peer(transports):
    lk = make_link(transports, size=32 << 20)
    try:
        src = lk.eng.register(np.zeros(32 << 20, dtype=np.uint8))
        pages = scattered_pages(64, 256 << 10, src.length, lk.rseg.length, seed=1)
        lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
        inflight = lk.eng.write(lk.peer, src, lk.rseg, pages)
        os.kill(lk.target.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        error = None
        while time.monotonic() - killed_at < PEER_DEATH_BOUND_S + 1.0 and error is None:
            try:
                inflight.wait(0.5)
                inflight = lk.eng.write(lk.peer, src, lk.rseg, pages)
                lk.eng.notify(lk.peer, b"x").wait(0.5)
            except PeerFailedError as exc:
                error = exc
        elapsed = time.monotonic() - killed_at
        assert isinstance(error, PeerFailedError), f"no PeerFailedError after {elapsed:.2f} s"
        assert error.peer == "target" and "target" in str(error)
        assert elapsed < PEER_DEATH_BOUND_S
        assert not lk.eng.peer_alive(lk.peer)
        with pytest.raises(PeerFailedError, match="target"):
            lk.eng.write(lk.peer, src, lk.rseg, pages)
        assert lk.eng.counters.peers_failed == 1
    finally:
        close_link(lk)


def test_unwatched_dead_peer_still_bounded():
    """Broken mode: the process watch is off, so over shared memory nothing reports the
    death. The wait for the peer's answer must still end at its deadline, not hang."""
    lk = make_link("shm", liveness_interval_s=3600.0)
    try:
        lk.peer.pidfd = None  # injected fault: no process watch
        os.kill(lk.target.proc.pid, signal.SIGKILL)
        lk.target.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises((DeadlineExceeded, TimeoutError, PeerFailedError)):
            lk.request({"op": "ping"}, timeout_s=0.5)
        assert time.monotonic() - t0 < 3.0
    finally:
        close_link(lk)


BAD_PAGES = [
    ([[0, -4096, 4096]], "negative remote offset"),
    ([[-1, 0, 4096]], "negative local offset"),
    ([[0, 0, 0]], "non-positive length"),
    ([[0, (16 << 20) - 4095, 4096]], "ends past the remote segment"),
    ([[(1 << 20) - 1, 0, 4096]], "ends past the local segment"),
    ([[0, 1 << 62, 1 << 62]], "longer than"),
    ([[0, 0, 4096], [4096, (16 << 20), 4096]], "ends past the remote segment"),
]


@pytest.mark.parametrize("with_notice", [False, True], ids=["write", "write+notice"])
@pytest.mark.parametrize("pages,why", BAD_PAGES)
def test_out_of_range_refused_before_posting(pages, why, with_notice):
    lk = make_link("shm")
    try:
        src = lk.eng.register(np.full(1 << 20, 7, dtype=np.uint8))
        before = lk.eng.counters.pages_posted
        notice = msgpack.packb({"op": "ping"}) if with_notice else None
        with pytest.raises(SegmentBoundsError, match=why) as info:
            lk.eng.write(lk.peer, src, lk.rseg, pages, notice=notice)
        assert lk.eng.counters.pages_posted == before
        assert lk.eng.counters.bounds_refused == 1
        assert lk.eng.counters.notifies == 0
        assert info.value.remote_len == 16 << 20 and info.value.local_len == 1 << 20
        # the valid first page of a mixed list was not posted either, nor the notice (its
        # reply would come first, with ok True)
        reply = lk.request(
            {"op": "check", "round": 0, "seed": 0, "src_len": 4096, "pages": [[0, 0, 4096]]}
        )
        assert reply["ok"] is False  # target still holds zeros, not the pattern
        assert len(lk.replies) == 1
    finally:
        close_link(lk)


@pytest.mark.parametrize("bad", [np.zeros((2, 2), np.int64), np.zeros((2, 3), np.float64)])
def test_malformed_page_arrays_refused(bad):
    with (
        TransferEngine(TransferConfig(transports="shm")) as a,
        TransferEngine(TransferConfig(transports="shm")) as b,
    ):
        seg, dst = a.allocate(1 << 16), b.allocate(1 << 16)
        peer = a.connect(b.address)
        rseg = a.open_segment(peer, dst.descriptor())
        with pytest.raises((TypeError, ValueError)):
            a.write(peer, seg, rseg, bad)


def test_stale_incarnation_refused():
    with (
        TransferEngine(TransferConfig(transports="shm", name="a")) as a,
        TransferEngine(TransferConfig(transports="shm", name="old")) as old,
        TransferEngine(TransferConfig(transports="shm", name="new")) as new,
    ):
        stale_desc = old.allocate(1 << 16).descriptor()
        peer_new = a.connect(new.address)
        with pytest.raises(StaleIncarnationError, match=f"{old.incarnation:#018x}"):
            a.open_segment(peer_new, stale_desc)
        fresh = new.allocate(1 << 16).descriptor()
        with pytest.raises(StaleIncarnationError):
            a.open_segment(peer_new, fresh, expected_incarnation=old.incarnation)
        assert a.open_segment(peer_new, fresh, expected_incarnation=new.incarnation)
        assert a.counters.stale_refused == 2


def test_malformed_control_input_refused_worker_keeps_running(link):
    garbage = [
        b"",
        b"\x00",
        b"\xc1",
        b"\x94\xa1x\x01\xa1y\x80",
        msgpack.packb([1, 2, 3]),
        encode(
            Envelope(incarnation=1, seq=1, flushed=False, sender=b"not an address", payload=b"p")
        ),
        encode(
            Envelope(incarnation=1, seq=1, flushed=True, sender=link.eng.address, payload=b"p")
        ),  # incarnation differs from the address's
        encode(Envelope(incarnation=1, seq=1, flushed=False, sender=b"s", payload=b"p"))[
            :-1
        ],  # truncated
        b"KVFE\x03" + bytes(27) + b"s",  # another envelope version
        msgpack.packb(["kvf.transfer", 1, "ENVELOPE", {}]),
        os.urandom(4096),
    ]
    for data in garbage:
        link.eng._send_raw(link.peer, data).wait(5.0)
    oversized = b"\x00" * (link.eng.config.max_message_bytes + (256 << 10))
    link.eng._send_raw(link.peer, oversized).wait(10.0)
    reply = link.request({"op": "ping"})
    assert reply["ok"] is True
    assert reply["malformed"] == len(garbage)
    # and ordinary traffic still flows
    assert link.request({"op": "ping"})["ok"] is True


def test_payload_limit_enforced_on_send():
    with (
        TransferEngine(TransferConfig(transports="shm", max_message_bytes=1024)) as a,
        TransferEngine(TransferConfig(transports="shm")) as b,
    ):
        peer = a.connect(b.address)
        with pytest.raises(WireError, match="exceeds"):
            a.send(peer, b"x" * 1025)
        seg, dst = a.allocate(1 << 16), b.allocate(1 << 16)
        rseg = a.open_segment(peer, dst.descriptor())
        with pytest.raises(WireError, match="exceeds"):  # nothing written either
            a.write(peer, seg, rseg, [[0, 0, 4096]], notice=b"x" * 1025)
        assert a.counters.pages_posted == 0 and a.counters.notifies == 0


def test_closed_peer_refuses_work():
    with (
        TransferEngine(TransferConfig(transports="shm")) as a,
        TransferEngine(TransferConfig(transports="shm")) as b,
    ):
        seg, dst = a.allocate(1 << 16), b.allocate(1 << 16)
        peer = a.connect(b.address, name="bee")
        rseg = a.open_segment(peer, dst.descriptor())
        a.close(peer, force=True)
        with pytest.raises(TransferError, match="bee"):
            a.write(peer, seg, rseg, [[0, 0, 4096]])
