"""What the engine refuses before a byte moves: a peer's segment descriptor that claims
more than UCX mapped here (a direct write past it would land in another peer's pool in
this process; broken mode: a run past the real mapping passes a write's bounds check), a
descriptor whose base and length pass the native layer's int64 offsets, a read-only
array given to register, a copy into a deregistered segment or a non-contiguous tensor."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.transfer import (
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    TransferError,
    WireError,
    copy_runs,
    copy_tensor_runs,
)
from kvferry.transfer.runs import check_runs

MiB = 1 << 20


@pytest.mark.parametrize("checked", [True, False], ids=["contract", "broken-trusts-length"])
def test_a_descriptor_longer_than_its_mapping_is_refused(monkeypatch, checked):
    if not checked:
        monkeypatch.setattr(TransferEngine, "_require_mapped", lambda self, peer, rseg: None)
    cfg = dict(transports="shm")
    with (
        TransferEngine(TransferConfig(name="writer", **cfg)) as w,
        TransferEngine(TransferConfig(name="x", **cfg)) as x,
        TransferEngine(TransferConfig(name="y", **cfg)) as y,
    ):
        sx, sy = x.allocate(MiB), y.allocate(MiB)
        sx.as_numpy()[:] = 0xAA  # another request's pages
        px, py = w.connect(x.address, "x"), w.connect(y.address, "y")
        w.open_segment(px, sx.descriptor())
        d = sy.descriptor()
        longer = SegmentDescriptor(d.base, 64 * MiB, d.rkey, d.incarnation, d.allocated)
        if checked:
            with pytest.raises(TransferError, match=r"claims 67108864 bytes .* 1048576 bytes"):
                w.open_segment(py, longer.pack())
            assert w.counters.bounds_refused == 1
            assert w.open_segment(py, d).length == MiB  # the true one opens
            return
        ry = w.open_segment(py, longer.pack())
        # BROKEN: the claimed length is trusted, so a run past y's real 1 MiB passes every
        # check a write makes (posted, its stores would land in whatever this process
        # maps there: x's pool in the review's layout; not posted here, it would be
        # memory of the test process in another layout)
        assert ry.length == 64 * MiB
        src = w.allocate(4096)
        assert check_runs(np.array([[0, MiB, 4096]], dtype=np.int64), src.length, ry.length)


def test_a_descriptor_past_int64_offsets_is_malformed():
    d = SegmentDescriptor(1 << 62, 1 << 62, b"rkey", 7, True)
    with pytest.raises(WireError, match="2\\*\\*63 - 1"):
        SegmentDescriptor.unpack(d.pack())


def test_register_refuses_a_read_only_array():
    with TransferEngine(TransferConfig(transports="shm", name="t")) as t:
        with pytest.raises(ValueError, match="read-only"):
            t.register(np.frombuffer(bytes(4096), dtype=np.uint8))


def test_copy_runs_refuses_a_deregistered_segment():
    with TransferEngine(TransferConfig(transports="shm", name="t")) as t:
        src, dst = t.allocate(4096), t.allocate(4096)
        t.deregister(dst)
        with pytest.raises(TransferError, match="destination segment was deregistered"):
            copy_runs(dst, src, np.array([[0, 0, 64]], dtype=np.int64))


def test_copy_tensor_runs_refuses_a_destination_it_would_copy():
    torch = pytest.importorskip("torch", reason="copy_tensor_runs copies torch tensors")
    src = torch.arange(32, dtype=torch.uint8)
    dst = torch.zeros(8, 4, dtype=torch.uint8).t()  # not contiguous
    with pytest.raises(TypeError, match="contiguous"):
        copy_tensor_runs(dst, src, np.array([[0, 0, 32]], dtype=np.int64))


def test_a_mapping_split_by_its_protections_counts_whole(tmp_path):
    from kvferry.transfer.mappings import mapped_span

    maps = tmp_path / "maps"
    maps.write_text(
        "1000-2000 rw-s 00000000 00:1a 77 /dev/shm/seg (deleted)\n"
        "2000-3000 r--s 00001000 00:1a 77 /dev/shm/seg (deleted)\n"
        "3000-4000 rw-s 00000000 00:1a 78 /dev/shm/other (deleted)\n"
        "4000-5000 rw-p 00000000 00:00 0\n"
        "5000-6000 rw-p 00000000 00:00 0\n"
    )
    assert mapped_span(0x1800, str(maps)) == (0x1000, 0x3000)
    assert mapped_span(0x3000, str(maps)) == (0x3000, 0x4000)  # another object
    assert mapped_span(0x4800, str(maps)) == (0x4000, 0x5000)  # anonymous: not joined
    assert mapped_span(0x9000, str(maps)) is None
