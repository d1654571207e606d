"""CUDA memory in the transfer engine, as far as a machine without a GPU can check it:
the refusal (by the memory-type check on a report whose mask lacks CUDA, and through this
machine's real UCX context, which has no CUDA driver), the native layer's own refusal
(UCX's ucp_mem_map would report success), descriptors carrying the memory type, no direct
CPU copy into or out of CUDA memory, and writes from a CUDA segment waiting for their
producer before anything is posted."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvferry.transfer import (
    CudaMemoryUnavailableError,
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    memtypes,
)
from kvferry.transfer._native import lib
from kvferry.transfer.errors import UcxError
from kvferry.transfer.memtypes import MemoryType, UcxMemoryReport

HOST_ONLY, HOST_AND_CUDA = 1 << 0, (1 << 0) | (1 << 1)
UCS_MEMORY_TYPE_HOST, UCS_MEMORY_TYPE_CUDA = 0, 1  # ucs_memory_type_t


def fake_ucx(tmp_path, with_module: bool) -> str:
    """A libucp path whose ucx/ folder has (or lacks) the CUDA module."""
    (tmp_path / "ucx").mkdir()
    if with_module:
        (tmp_path / "ucx" / "libuct_cuda.so").write_bytes(b"")
    return str(tmp_path / "libucp.so.0")


def report(lib_path, mask=HOST_ONLY, tls="sm,self,cuda_copy,cuda_ipc", components=()):
    return UcxMemoryReport(mask, mask, "1.99.0", lib_path, tls, tuple(components))


@pytest.mark.parametrize(
    "with_module, components, tls, missing, words",
    [
        (False, ("self", "posix"), "sm,self", "ucx-build", "built without --with-cuda"),
        (True, ("self", "posix"), "sm,self,cuda_copy", "cuda-transports", "not loaded"),
        (True, ("self", "cuda_cpy", "cuda_ipc"), "sm,self", "cuda-transports", "UCX_TLS=sm,self"),
        (True, ("self", "cuda_cpy", "cuda_ipc"), "sm,self,cuda_ipc", "device", "no usable CUDA"),
        (True, ("self", "cuda_cpy", "cuda_ipc"), None, "device", "no usable CUDA"),
    ],
    ids=["no-module", "module-not-loaded", "tls-excludes", "no-device", "default-tls"],
)
def test_a_mask_without_cuda_is_refused_naming_what_is_missing(
    tmp_path, with_module, components, tls, missing, words
):
    lib_path = fake_ucx(tmp_path, with_module)
    with pytest.raises(CudaMemoryUnavailableError) as err:
        memtypes.require(MemoryType.CUDA, report(lib_path, HOST_ONLY, tls, components))
    assert err.value.missing == missing and words in str(err.value)
    assert "UCX 1.99.0" in str(err.value) and lib_path in str(err.value)
    assert err.value.ucx_version == "1.99.0" and err.value.ucx_library == lib_path
    # the same UCX with CUDA in its mask passes, and host memory always does
    memtypes.require(MemoryType.CUDA, report(lib_path, HOST_AND_CUDA, tls, components))
    memtypes.require(MemoryType.HOST, report(lib_path, HOST_ONLY, tls, components))


def test_tls_lists():
    assert memtypes.tls_names_cuda(None) and memtypes.tls_names_cuda("all")
    assert memtypes.tls_names_cuda("tcp,cuda_copy") and not memtypes.tls_names_cuda("sm,self")
    assert memtypes.tls_names_cuda("^tcp") and not memtypes.tls_names_cuda("^cuda_ipc,cuda_copy")


def test_registering_cuda_memory_through_this_ucx_is_refused(engine):
    """This machine's UCX context has no CUDA memory type (no driver): registering a
    device pointer is refused with the UCX version and library, nothing is mapped."""
    assert not engine.supports_memory_type("cuda") and engine.supports_memory_type("host")
    info = engine.describe()
    with pytest.raises(CudaMemoryUnavailableError) as err:
        engine.register(0x7F00_0000_0000, nbytes=1 << 20, memory_type="cuda")
    assert err.value.missing in ("ucx-build", "cuda-transports", "device")
    assert info["ucx_version"] in str(err.value) and info["ucx_library"] in str(err.value)
    assert "never bounces" in str(err.value)
    described = engine.describe()["memory_types"]
    assert described["ucx"] == ["host"] and described["registered"] == {}
    assert described["requested"] == ["host"] and described["cuda_transports"] == []


def test_the_native_map_refuses_cuda_memory_the_context_lacks(engine):
    """Below the Python check: kvf_mem_map itself asks the context, where UCX's own
    ucp_mem_map would return success and a key that reads device pointers as host."""
    buf = np.zeros(1 << 16, np.uint8)
    with pytest.raises(UcxError) as err:
        engine.memory._map(buf.ctypes.data, buf.nbytes, False, buf, MemoryType.CUDA)
    assert err.value.ucs_name == "UCS_ERR_UNSUPPORTED"


def test_an_engine_asking_for_cuda_memory_is_refused_at_start_without_a_device():
    with pytest.raises(CudaMemoryUnavailableError) as err:
        TransferEngine(TransferConfig(transports="shm", memory_types=("host", "cuda")))
    assert err.value.missing in ("device", "ucx-build", "cuda-transports")


def test_cuda_presets_add_the_cuda_transports():
    cfg = TransferConfig(transports="shm", memory_types=("host", "cuda"))
    assert cfg.tls() == "sm,self,cuda_copy,cuda_ipc" and cfg.wants_cuda()
    assert TransferConfig(transports="tcp").tls() == "tcp,self"
    assert TransferConfig(transports="sm,cuda_ipc", memory_types=("cuda",)).tls() == "sm,cuda_ipc"
    with pytest.raises(ValueError, match="unknown memory type"):
        TransferConfig(memory_types=("rocm",)).wants_cuda()


def test_descriptors_carry_the_memory_type():
    d = SegmentDescriptor(1 << 40, 4096, b"k" * 9, 77, False, "cuda")
    assert SegmentDescriptor.unpack(d.pack()) == d
    # an older peer's descriptor (no memory_type field) is host memory
    from kvferry.transfer.protocol import CODEC, SEGMENT

    old = CODEC.encode(SEGMENT.make(base=1, length=2, rkey=b"r", incarnation=3, allocated=True))
    assert SegmentDescriptor.unpack(old).memory_type == "host"


class Recorder:
    """A stream whose synchronize() records how many batches the engine had posted."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []

    def synchronize(self):
        self.seen.append(self.engine.counters.batches)


def settle(batch, *engines):
    """Both engines live in this thread: progress each until the batch settles."""
    for _ in range(20000):
        for eng in engines:
            eng.progress(0)
        if batch.peek().name != "PENDING":
            return batch.peek().name
    return "PENDING"


def test_a_write_from_a_cuda_segment_waits_for_its_producer_first():
    """A segment marked CUDA (host bytes here, so the CPU can check them) waits on the
    stream before anything is posted, never takes the direct CPU copy, tells UCX its
    requests' local buffer is CUDA memory (UCX picks the protocol by it: a device pointer
    passed as host memory is read by the CPU, a crash), and its notice still arrives
    after the pages. A host segment waits on nothing and is host memory to UCX."""
    src = TransferEngine(TransferConfig(transports="shm", name="src"))
    dst = TransferEngine(TransferConfig(transports="shm", name="dst"))
    try:
        target = dst.allocate(1 << 16)  # mappable: a host segment would copy directly
        target.as_numpy()[:] = 0
        local = src.register(np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy())
        peer = src.connect(dst.address)
        rseg = src.open_segment(peer, target.descriptor())
        assert rseg.direct is not None
        stream = Recorder(src)
        local.memory_type = "cuda"  # as register() marks a CUDA tensor's segment
        before = src.counters.batches
        batch = src.write(
            peer, local, rseg, [[0, 0, 4096], [8192, 4096, 4096]], b"n", stream=stream
        )
        assert stream.seen == [before] and src.counters.stream_syncs == 1
        assert lib.kvf_rma_ucs_memory_type(src._rma_param) == UCS_MEMORY_TYPE_CUDA
        got = []
        dst.set_message_handler(lambda sender, payload: got.append(payload))
        assert settle(batch, src, dst) == "COMPLETED" and src.counters.pages_direct == 0
        for _ in range(2000):
            dst.progress(0.001)
            if got:
                break
        view, want = target.as_numpy(), np.asarray(local.owner)
        assert got == [b"n"]
        assert (view[:4096] == want[:4096]).all() and (view[4096:8192] == want[8192:12288]).all()
        local.memory_type = "host"
        assert settle(src.write(peer, local, rseg, [[0, 0, 64]], stream=stream), src, dst) == (
            "COMPLETED"
        )
        assert len(stream.seen) == 1 and src.counters.pages_direct == 1
        assert lib.kvf_rma_ucs_memory_type(src._rma_param) == UCS_MEMORY_TYPE_HOST
        # an opened CUDA descriptor never gets the direct (CPU) path either
        cuda_desc = SegmentDescriptor(**{**target.descriptor().__dict__, "memory_type": "cuda"})
        assert src.open_segment(peer, cuda_desc).direct is None
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.skipif(
    os.environ.get("KVFERRY_CUDA_TESTS") != "1", reason="needs a CUDA device and a CUDA UCX"
)
def test_cuda_tensor_registers_as_cuda_memory():  # pragma: no cover - GPU machine only
    import torch

    eng = TransferEngine(TransferConfig(transports="shm", memory_types=("host", "cuda")))
    try:
        t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        seg = eng.register(t)
        assert seg.memory_type == "cuda" and seg.descriptor().memory_type == "cuda"
        assert eng.describe()["memory_types"]["registered"]["cuda"]["bytes"] == 1 << 20
    finally:
        eng.shutdown()


def test_the_native_layer_never_copies_device_memory_with_the_cpu():
    """A batch whose local segment is CUDA memory is refused (UCS_ERR_INVALID_PARAM, nothing
    posted) when it names a direct mapping or a cross-memory peer: those are CPU copies.
    The engine never asks for them; the native layer holds the line on its own."""
    from kvferry.transfer import _native as native
    from kvferry.transfer._native import ffi

    src = TransferEngine(TransferConfig(transports="shm", name="src"))
    dst = TransferEngine(TransferConfig(transports="shm", name="dst"))
    try:
        target = dst.allocate(1 << 16)
        local = src.register(np.zeros(1 << 16, dtype=np.uint8))
        peer = src.connect(dst.address)
        rseg = src.open_segment(peer, target.descriptor())
        assert rseg.direct is not None
        pages = np.array([[0, 0, 4096]], dtype=np.int64)
        for extra in ("direct", "cross-memory", None):
            param = ffi.new("kvf_rma_param_t *")
            param.field_mask = native.RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE
            param.local_memory_type = native.MEMORY_TYPE_CUDA
            param.local_base, param.local_length = local.base, local.length
            param.rkey, param.remote_base, param.remote_length = rseg.rkey, rseg.base, rseg.length
            param.pages, param.npages = ffi.from_buffer("int64_t[]", pages), 1
            if extra == "direct":
                param.field_mask |= native.RMA_PARAM_FIELD_DIRECT_BASE
                param.direct_base = rseg.direct
            elif extra == "cross-memory":
                param.field_mask |= native.RMA_PARAM_FIELD_PEER_PROCESS
                param.peer_pid, param.peer_pidfd = os.getpid(), -1
            else:
                assert lib.kvf_rma_ucs_memory_type(param) == UCS_MEMORY_TYPE_CUDA
                continue  # through UCX: allowed (not posted here: host bytes marked CUDA)
            handle = ffi.new("kvf_batch_t *")
            assert lib.kvf_put_pages(peer.ep, param, handle) == -5  # UCS_ERR_INVALID_PARAM
            assert handle.posted == 0
    finally:
        src.shutdown()
        dst.shutdown()
