"""Memory a peer on this host registered itself, written and read by the kernel's
cross-memory copy (many pages per system call): byte-exact across the per-call batch
boundary, refused when the transports leave out shared memory, caught by the target's
check when a page is skipped, and never written once the target's process exited, even
when its pid now names another process (the broken mode re-resolves the pid and writes
into that process)."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
from conftest import close_link, make_link
from transfer_peer import pattern

from kvferry.transfer import BatchStatus, PeerFailedError, TransferConfig, TransferEngine

PAGE_SIZES = (512, 2048, 16 << 10)


def _mixed_pages(n: int, src_len: int, dst_len: int, seed: int) -> np.ndarray:
    """n non-overlapping runs of mixed sizes at shuffled slots: [n, 3] int64."""
    rng = np.random.default_rng(seed)
    slot = max(PAGE_SIZES)
    sizes = rng.choice(PAGE_SIZES, n)
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = rng.permutation(src_len // slot)[:n] * slot
    out[:, 1] = rng.permutation(dst_len // slot)[:n] * slot
    out[:, 2] = sizes
    return out


def _check(lk, src, pages, k: int, seed: int = 21) -> dict:
    return lk.request(
        {"op": "check", "round": k, "seed": seed, "src_len": src.length, "pages": pages.tolist()},
        notify=True,
    )


def test_registered_destination_written_and_read_by_cross_memory_copy():
    lk = make_link("shm", mode="register", size=64 << 20)
    try:
        assert lk.rseg.direct is None and lk.rseg.cross_memory
        assert lk.rseg.path == "cross-memory"
        assert lk.eng.describe()["peers"]["target"]["segment_paths"] == {"cross-memory": 1}
        src = lk.eng.register(np.zeros(64 << 20, dtype=np.uint8))
        written = 0
        for k, n in enumerate((1, 1023, 1024, 1025, 3000)):
            src.as_numpy()[:] = pattern(21, k, src.length)
            pages = _mixed_pages(n, src.length, lk.rseg.length, seed=k)
            batch = lk.eng.write(lk.peer, src, lk.rseg, pages)
            assert batch.status() is BatchStatus.COMPLETED  # synchronous: done when posted
            assert _check(lk, src, pages, k) == {"round": k, "ok": True, "bad_pages": []}
            written += n
        c = lk.eng.counters
        assert c.pages_cross_memory == c.pages_direct == written and c.notifies_flushed == 0

        assert lk.request({"op": "fill", "seed": 5}) == {"ok": True}
        dst = lk.eng.register(np.zeros(64 << 20, dtype=np.uint8))
        pages = _mixed_pages(2500, dst.length, lk.rseg.length, seed=99)
        lk.eng.read(lk.peer, dst, lk.rseg, pages).wait(10.0)
        remote, got = pattern(5, 0, lk.rseg.length), dst.as_numpy()
        bad = [
            i
            for i, (lo, ro, ln) in enumerate(pages)
            if not (np.array_equal(got[lo : lo + ln], remote[ro : ro + ln]))
        ]
        assert bad == [] and c.pages_cross_memory == written + 2500
    finally:
        close_link(lk)


def test_tcp_keeps_the_operators_transport():
    """Transports without shared memory: the registered destination gets UCX's puts."""
    lk = make_link("tcp", mode="register", size=8 << 20)
    try:
        assert not lk.rseg.cross_memory and lk.rseg.path == "ucp_put"
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        pages = _mixed_pages(64, src.length, lk.rseg.length, seed=3)
        src.as_numpy()[:] = pattern(21, 0, src.length)
        lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
        assert _check(lk, src, pages, 0)["ok"] and lk.eng.counters.pages_cross_memory == 0
    finally:
        close_link(lk)


def test_skipped_page_on_the_cross_memory_path_is_caught():
    """Broken mode: page 3 of every write is skipped; the target's check names it."""
    lk = make_link("shm", mode="register", size=8 << 20, fault_skip_page=3)
    try:
        assert lk.rseg.cross_memory
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        src.as_numpy()[:] = pattern(21, 0, src.length)
        pages = _mixed_pages(32, src.length, lk.rseg.length, seed=4)
        lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
        assert _check(lk, src, pages, 0) == {"round": 0, "ok": False, "bad_pages": [3]}
    finally:
        close_link(lk)


def _killed_then_written(reresolve_pid: bool) -> tuple[Exception | None, int]:
    """Target A killed and reaped; B, another live process, then holds A's pid and maps
    memory at A's segment's address (both emulated: the engine's record of A's pid and
    segment pointed at B). The engine's own liveness check is an hour away, so only the
    native check before the copy stands between the write and B. Returns the write's
    error and the sum of B's bytes afterwards."""
    a = make_link("shm", mode="register", size=1 << 20, liveness_interval_s=3600.0)
    b = make_link("shm", mode="register", size=1 << 20)
    try:
        src = a.eng.register(np.full(1 << 20, 7, dtype=np.uint8))
        pages = np.array([[0, 0, 4096], [8192, 8192, 4096]], dtype=np.int64)
        a.eng.write(a.peer, src, a.rseg, pages).wait(5.0)
        os.kill(a.target.proc.pid, signal.SIGKILL)
        a.target.proc.wait(10)
        a.peer.info = dataclasses.replace(a.peer.info, pid=b.target.proc.pid)
        a.rseg.descriptor = dataclasses.replace(a.rseg.descriptor, base=b.rseg.base)
        if reresolve_pid:  # broken: the process is looked up by its pid at post time
            os.close(a.peer.pidfd)
            a.peer.pidfd = os.pidfd_open(b.target.proc.pid)
        error = None
        try:
            a.eng.write(a.peer, src, a.rseg, pages).wait(5.0)
        except PeerFailedError as exc:
            error = exc
        return error, b.request({"op": "sum"})["sum"]
    finally:
        close_link(a)
        close_link(b)


def test_write_to_an_exited_process_fails_and_never_reaches_a_reused_pid():
    error, b_sum = _killed_then_written(reresolve_pid=False)
    assert isinstance(error, PeerFailedError) and "target" in str(error)
    assert "UCS_ERR_CONNECTION_RESET" in str(error)
    assert b_sum == 0


def test_a_pid_re_resolved_at_post_time_writes_into_another_process():
    """Broken mode: the pidfd is opened from the pid when posting, so it names whichever
    process holds that pid now; the write lands in B."""
    error, b_sum = _killed_then_written(reresolve_pid=True)
    assert error is None and b_sum == 2 * 4096 * 7


@pytest.mark.parametrize("cross_memory_copy", [True, False])
def test_cross_memory_copy_can_be_turned_off(cross_memory_copy):
    lk = make_link("shm", mode="register", size=1 << 20, cross_memory_copy=cross_memory_copy)
    try:
        assert lk.rseg.cross_memory is cross_memory_copy
    finally:
        close_link(lk)


def test_engines_side_by_side_in_one_process_use_it_too():
    """A peer in this very process (benchmarks, in-process hosts) is on this host too:
    watched through its own pidfd, written by the cross-memory copy, byte-exact."""
    a = TransferEngine(TransferConfig(transports="shm", name="one"))
    b = TransferEngine(TransferConfig(transports="shm", name="two"))
    try:
        dst_buf = np.zeros(1 << 20, dtype=np.uint8)
        dst = b.register(dst_buf)
        peer = a.connect(b.address, name="two")
        rseg = a.open_segment(peer, dst.descriptor())
        assert peer.pidfd is not None and rseg.direct is None and rseg.cross_memory
        src_buf = pattern(21, 0, 1 << 20)
        src = a.register(src_buf)
        pages = _mixed_pages(40, 1 << 20, 1 << 20, seed=8)
        a.write(peer, src, rseg, pages).wait(5.0)
        for lo, ro, ln in pages:
            assert np.array_equal(dst_buf[ro : ro + ln], src_buf[lo : lo + ln])
        assert a.counters.pages_cross_memory == 40
    finally:
        a.shutdown()
        b.shutdown()


def _joined_pages(groups: int, per_group: int, piece: int, joined: str, seed: int) -> np.ndarray:
    """``groups`` regions of ``per_group`` pieces of ``piece`` bytes, [n, 3] int64, the
    pieces of a region consecutive on the side(s) ``joined`` names ("remote": a region
    fills one destination page in order from scattered source pieces, as a reshaped plan
    does; "local": the reverse; "both": a region split in pieces on both sides) and
    scattered on the other side."""
    rng = np.random.default_rng(seed)
    n = groups * per_group
    scattered = rng.permutation(n) * piece  # every piece a slot of its own
    region = (rng.permutation(groups) * per_group)[:, None] + np.arange(per_group)[None, :]
    contiguous = region.reshape(-1) * piece
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = contiguous if joined in ("local", "both") else scattered
    out[:, 1] = contiguous if joined in ("remote", "both") else scattered
    out[:, 2] = piece
    return out


@pytest.mark.parametrize("joined", ["remote", "local", "both"])
@pytest.mark.parametrize("groups, per_group", [(3, 1), (40, 16), (70, 33)])
def test_pieces_contiguous_on_one_side_are_joined_and_land_byte_exact(joined, groups, per_group):
    """Each side's contiguous neighbours go as one piece of a cross-memory call (a region
    of 33 pieces crosses the 1,024-piece call boundary); every byte lands where its own
    piece says, and the counters still count pieces."""
    lk = make_link("shm", mode="register", size=8 << 20)
    try:
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        src.as_numpy()[:] = pattern(21, 0, src.length)
        pages = _joined_pages(groups, per_group, 512, joined, seed=groups)
        lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
        assert _check(lk, src, pages, 0) == {"round": 0, "ok": True, "bad_pages": []}
        assert lk.eng.counters.pages_cross_memory == len(pages)
    finally:
        close_link(lk)


@pytest.mark.parametrize(
    "transports, mode", [("shm", "register"), ("shm", "allocate"), ("tcp", "register")]
)
def test_a_skipped_piece_inside_a_joined_run_is_caught(transports, mode):
    """Broken mode: piece 3, inside a run contiguous on both sides, is skipped; the join
    stops at it (cross-memory copy, direct copy, UCX puts) and the target's check names it."""
    lk = make_link(transports, mode=mode, size=8 << 20, fault_skip_page=3)
    try:
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        src.as_numpy()[:] = pattern(21, 0, src.length)
        pages = _joined_pages(2, 8, 2048, "both", seed=5)
        lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
        assert _check(lk, src, pages, 0) == {"round": 0, "ok": False, "bad_pages": [3]}
    finally:
        close_link(lk)


@pytest.mark.parametrize("transports, mode", [("shm", "allocate"), ("tcp", "register")])
def test_pieces_contiguous_on_both_sides_go_as_one_put_byte_exact(transports, mode):
    """The direct copy and UCX's puts take a run of pieces contiguous on both sides at
    once; every byte lands, and pieces contiguous on one side only still go one by one."""
    lk = make_link(transports, mode=mode, size=8 << 20)
    try:
        src = lk.eng.register(np.zeros(8 << 20, dtype=np.uint8))
        for k, joined in enumerate(("both", "remote", "local")):
            src.as_numpy()[:] = pattern(21, k, src.length)
            pages = _joined_pages(20, 16, 1024, joined, seed=k)
            lk.eng.write(lk.peer, src, lk.rseg, pages).wait(10.0)
            assert _check(lk, src, pages, k) == {"round": k, "ok": True, "bad_pages": []}
        assert lk.eng.counters.pages_posted == 3 * 20 * 16
    finally:
        close_link(lk)
