"""Two real processes over shared memory and tcp: scattered pages written and read
byte-exact, write+notify rounds checked by the target on arrival, and the same checks
against an injected fault (a skipped page) to show they can fail."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from conftest import close_link, make_link
from transfer_peer import pattern, scattered_pages

from kvferry.transfer import BatchStatus, TransferEngine


def _round(link, src, k: int, npages: int, page: int, seed: int = 11) -> dict:
    src.as_numpy()[:] = pattern(seed, k, src.length)
    pages = scattered_pages(npages, page, src.length, link.rseg.length, seed=1000 + k)
    batch = link.eng.write(link.peer, src, link.rseg, pages)
    batch.wait(10.0)
    assert batch.status() is BatchStatus.COMPLETED
    return link.request(
        {"op": "check", "round": k, "seed": seed, "src_len": src.length, "pages": pages.tolist()},
        notify=True,
    )


def _noticed_round(lk, src, k: int, npages: int, page: int, seed: int = 13) -> dict:
    """One write whose notice (posted by the same call) asks the target to check it."""
    src.as_numpy()[:] = pattern(seed, k, src.length)
    pages = scattered_pages(npages, page, src.length, lk.rseg.length, seed=3000 + k)
    n = len(lk.replies)
    notice = msgpack.packb(
        {"op": "check", "round": k, "seed": seed, "src_len": src.length, "pages": pages.tolist()}
    )
    lk.eng.write(lk.peer, src, lk.rseg, pages, notice=notice).wait(10.0)
    return lk.wait_reply(n)


def test_scattered_write_byte_exact(link):
    src = link.eng.register(np.zeros(8 << 20, dtype=np.uint8))
    reply = _round(link, src, 0, npages=256, page=16 << 10)
    assert reply == {"round": 0, "ok": True, "bad_pages": []}
    assert link.eng.counters.bytes_written == 256 * (16 << 10)


def test_a_settled_batch_no_longer_reads_its_memory(link):
    """``reading``: a batch's local bytes may be touched while any of its operations is
    posted and not completed; a completed one touches them no more."""
    src = link.eng.register(np.zeros(1 << 20, dtype=np.uint8))
    pages = scattered_pages(16, 4096, src.length, link.rseg.length, seed=7)
    batch = link.eng.write(link.peer, src, link.rseg, pages)
    batch.wait(10.0)
    assert batch.status() is BatchStatus.COMPLETED
    assert not link.eng.reading(batch)


def test_write_notify_rounds_checked_on_arrival(link):
    src = link.eng.register(np.zeros(4 << 20, dtype=np.uint8))
    for k in range(25):
        reply = _round(link, src, k, npages=8 + k, page=4096 * (1 + k % 4))
        assert reply["ok"], f"round {k}: pages {reply['bad_pages']} differ"
    assert link.eng.counters.failures == 0


def test_scattered_read_byte_exact(link):
    assert link.request({"op": "fill", "seed": 5}) == {"ok": True}
    dst = link.eng.allocate(4 << 20)
    pages = scattered_pages(128, 8192, dst.length, link.rseg.length, seed=3)
    link.eng.read(link.peer, dst, link.rseg, pages).wait(10.0)
    remote = pattern(5, 0, link.rseg.length)
    got = dst.as_numpy()
    for lo, ro, ln in pages:
        assert np.array_equal(got[lo : lo + ln], remote[ro : ro + ln])
    assert link.eng.counters.bytes_read == 128 * 8192


@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_registered_destination_one_sided(transports):
    """Destination memory registered by the target (not UCX-allocated), with the
    cross-memory copy off: puts via UCX's cma/tcp."""
    lk = make_link(transports, mode="register", size=8 << 20, cross_memory_copy=False)
    try:
        assert lk.rseg.direct is None and not lk.rseg.cross_memory
        src = lk.eng.register(np.zeros(4 << 20, dtype=np.uint8))
        for k in range(3):
            assert _round(lk, src, k, npages=64, page=16 << 10)["ok"]
    finally:
        close_link(lk)


@pytest.mark.parametrize("noticed", [False, True], ids=["write,notify", "write(notice=)"])
@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_injected_skipped_page_is_caught(transports, noticed):
    """Broken mode: the engine silently skips one page (the notice still goes); the
    target's byte check must name the page."""
    lk = make_link(transports, fault_skip_page=3)
    try:
        src = lk.eng.register(np.zeros(4 << 20, dtype=np.uint8))
        round_ = _noticed_round if noticed else _round
        reply = round_(lk, src, 0, npages=32, page=16 << 10)
        assert not reply["ok"] and reply["bad_pages"] == [3]
    finally:
        close_link(lk)


def _notices_behind_unwaited_writes(
    mode: str, rounds: int = 6, bytes_must_match: bool = True, **cfg
):
    """Rounds of a write posted without waiting, then a notice; the target checks the
    bytes on arrival. Returns the link's segment, the engine's counters and the rounds
    whose bytes differed (an assertion instead, unless ``bytes_must_match`` is False)."""
    lk = make_link("shm", mode=mode, size=8 << 20, **cfg)
    try:
        src = lk.eng.register(np.zeros(4 << 20, dtype=np.uint8))
        torn: list[int] = []
        for k in range(rounds):
            src.as_numpy()[:] = pattern(11, k, src.length)
            pages = scattered_pages(64, 16 << 10, src.length, lk.rseg.length, seed=2000 + k)
            lk.eng.write(lk.peer, src, lk.rseg, pages)
            reply = lk.request(
                {
                    "op": "check",
                    "round": k,
                    "seed": 11,
                    "src_len": src.length,
                    "pages": pages.tolist(),
                },
                notify=True,
            )
            if not reply["ok"]:
                assert not bytes_must_match, f"round {k}: pages {reply['bad_pages']} differ"
                torn.append(k)
        return lk.rseg, lk.eng.counters, torn
    finally:
        close_link(lk)


@pytest.mark.parametrize(
    "mode,cross_memory", [("allocate", True), ("register", True), ("register", False)]
)
def test_notice_posted_at_once_waits_for_puts_only_when_it_must(mode, cross_memory):
    """Over the direct path (a UCX-allocated segment mapped here) and the cross-memory
    copy (a registered one) the bytes are there when ``write`` returns, so the notice
    needs no endpoint flush; after puts through UCX every notice is flushed."""
    rseg, c, _ = _notices_behind_unwaited_writes(mode, cross_memory_copy=cross_memory)
    if mode == "allocate":
        assert rseg.direct is not None and c.notifies_flushed == 0
    elif cross_memory:
        assert rseg.cross_memory and c.notifies_flushed == 0
        assert c.pages_cross_memory == c.pages_direct == 6 * 64
    else:
        assert rseg.direct is None and c.notifies_flushed == c.notifies == 6


def test_a_notice_skipping_its_flush_behind_puts_is_caught(monkeypatch):
    """Broken mode: notices never flush. A notice may then overtake its puts (the target's
    bytes check names the torn pages) or, by luck of timing, arrive after them; the flush
    count catches it either way, so the verdict never depends on which."""
    monkeypatch.setattr(TransferEngine, "_needs_flush", staticmethod(lambda peer: False))
    rseg, c, torn = _notices_behind_unwaited_writes(
        "register", bytes_must_match=False, cross_memory_copy=False
    )
    assert rseg.direct is None
    assert c.notifies == 6 and c.notifies_flushed == 0, (c.notifies, c.notifies_flushed, torn)


def test_write_with_notice_checked_on_arrival(link):
    """Rounds of small (cached copy) and large (streaming copy) writes whose notice rides
    in the same call; the target checks every page when the notice arrives."""
    src = link.eng.register(np.zeros(8 << 20, dtype=np.uint8))
    sizes = [(8, 16 << 10), (128, 16 << 10), (3, 4096), (64, 64 << 10)]
    for k in range(12):
        npages, page = sizes[k % len(sizes)]
        reply = _noticed_round(link, src, k, npages, page)
        assert reply == {"round": k, "ok": True, "bad_pages": []}
    c = link.eng.counters
    assert c.notifies == 12 and c.failures == 0
    if link.rseg.direct is not None:
        assert c.notifies_flushed == 0  # direct copies are visible when posted
    else:
        assert c.notifies_flushed == 12  # puts through UCX: every notice flushes


@pytest.mark.parametrize(
    "streaming_min_bytes",
    [0, 1 << 20, 1 << 62],
    ids=["always-stream", "stream-large", "never-stream"],
)
def test_direct_copies_byte_exact_either_side_of_the_streaming_threshold(streaming_min_bytes):
    lk = make_link("shm", streaming_min_bytes=streaming_min_bytes)
    try:
        assert lk.rseg.direct is not None
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        for k, (npages, page) in enumerate([(8, 16 << 10), (96, 16 << 10), (5, 1000)]):
            assert _round(lk, src, k, npages, page)["ok"]
            assert _noticed_round(lk, src, k + 10, npages, page)["ok"]
    finally:
        close_link(lk)


BIG = 200 << 10  # under the target's message limit, still many fragments


def _steps_until_reply(link, n: int, drain_us: int, step_s: float = 0.002) -> int:
    """Polls for reply ``n`` the way a busy rank does: one progress call between steps
    of ``step_s`` of compute; returns the steps it took (bounded)."""
    for step in range(1, 2000):
        link.eng.progress(0, drain_us=drain_us)
        if len(link.replies) > n:
            return step
        until = time.perf_counter() + step_s
        while time.perf_counter() < until:  # compute, holding the CPU as a prefill does
            pass
    raise AssertionError(f"no reply after 2000 steps (drain_us={drain_us})")


@pytest.mark.parametrize("transports", ["shm"])
def test_a_draining_progress_takes_a_big_message_between_two_steps(transports):
    """A message of many fragments crosses a transport's queue a burst at a time, each
    burst at the receiver's progress: a rank that progresses once per step of compute
    took a 1 MiB PLAN chunk over many steps (here: 200 KiB). Progress with ``drain_us`` keeps taking
    fragments while they come (the sender refills the queue as it progresses), so the
    message arrives in fewer steps than with one progress per step (``drain_us=0``, the
    broken mode here)."""
    link = make_link(transports)
    try:
        steps = {}
        for drain_us in (2000, 0):
            n = len(link.replies)
            link.eng.send(link.peer, msgpack.packb({"op": "big", "n": BIG})).wait(5.0)
            steps[drain_us] = _steps_until_reply(link, n, drain_us)
            assert len(link.replies[n]["big"]) == BIG
        assert steps[0] > steps[2000], steps  # 9 against 2-4 here
    finally:
        close_link(link)
