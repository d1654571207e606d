"""The engine's memory: buffers registered zero-copy and memory UCX allocates, each a
:class:`~.segment.Segment` with its packed remote key (what a peer needs to write it).

One job: map and unmap. The engine (:class:`~.engine.TransferEngine`) owns the worker
and hands it here; nothing here posts, connects or polls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _native as native
from . import memtypes
from ._native import ffi, lib
from .errors import CudaMemoryUnavailableError, TransferError, ucx_error
from .memtypes import MemoryType
from .segment import Segment

__all__ = ["CudaMemoryUnavailableError", "SegmentMap"]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise ucx_error(status, what)


def _buffer_pointer(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous host buffer: numpy array, CPU torch tensor, or any
    writable buffer-protocol object."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("register: numpy array must be C-contiguous")
        if not buf.flags.writeable:  # peers write it: an immutable object would change
            raise ValueError("register: numpy array is read-only (peers write registered memory)")
        return buf.ctypes.data, buf.nbytes
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor
        if buf.device.type != "cpu":
            raise ValueError(f"register: tensor on {buf.device} (only CPU memory here)")
        if not buf.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    view = ffi.from_buffer(buf, require_writable=True)
    return int(ffi.cast("uintptr_t", view)), len(view)


class SegmentMap:
    """The segments of one engine (``segments``, in the order mapped)."""

    def __init__(
        self,
        worker: Any,
        config: Any,
        incarnation: int,
        memory: memtypes.UcxMemoryReport,
        require_open: Callable[[], None],
    ) -> None:
        self._worker = worker
        self.config = config
        self.incarnation = incarnation
        self._memory = memory
        self._require_open = require_open
        self.segments: list[Segment] = []

    def register(
        self, buf: Any, *, memory_type: str | None = None, nbytes: int | None = None
    ) -> Segment:
        """Register contiguous memory zero-copy; the segment keeps a reference to ``buf``.

        ``buf``: a host buffer (numpy, CPU torch tensor, bytearray...), a CUDA torch
        tensor or an object with ``__cuda_array_interface__`` (CuPy), or an int address
        with ``nbytes`` and ``memory_type``. ``memory_type`` (``"host"``/``"cuda"``) is
        inferred from ``buf`` when not given. CUDA memory is mapped as CUDA memory
        (``UCS_MEMORY_TYPE_CUDA``) after the UCX context is checked to support it:
        :class:`CudaMemoryUnavailableError` names what is missing otherwise, and the
        engine must have been created with ``memory_types`` including ``"cuda"``. Map a
        pool that is one plain ``cudaMalloc`` allocation (cuda_ipc exports the whole
        allocation; VMM or memory-pool memory needs other handles)."""
        self._require_open()
        device: int | None = None
        if isinstance(buf, int) and not isinstance(buf, bool):
            if nbytes is None or memory_type is None:
                raise ValueError("register: an address needs nbytes= and memory_type=")
            kind = memtypes.parse(memory_type)
            address, size = buf, nbytes
        else:
            cuda = memtypes.cuda_pointer(buf)
            if cuda is not None:
                kind = MemoryType.CUDA
                address, size, device = cuda
            else:
                kind = MemoryType.HOST
                address, size = _buffer_pointer(buf)
            if memory_type is not None and memtypes.parse(memory_type) is not kind:
                raise ValueError(f"register: buffer is {kind.value} memory, not {memory_type}")
        if size <= 0:
            raise ValueError("register: empty buffer")
        if kind is MemoryType.CUDA:
            memtypes.require(kind, self._memory)
            if not self.config.wants_cuda():
                raise TransferError(
                    "register: CUDA memory needs an engine created with "
                    "TransferConfig(memory_types=('host', 'cuda')) (CUDA initialised "
                    "before ucp_init, the cuda transports in UCX_TLS)"
                )
            if device is None:
                device = self.config.cuda_device
        return self._map(address, size, allocate=False, owner=buf, memory_type=kind, device=device)

    def allocate(self, nbytes: int, prefault: bool = True) -> Segment:
        """UCX-allocated memory (``UCP_MEM_MAP_ALLOCATE``: shared memory that peers on this
        host map and write directly). ``prefault`` touches every page once."""
        self._require_open()
        if nbytes <= 0:
            raise ValueError(f"allocate: nbytes must be positive, got {nbytes}")
        seg = self._map(0, nbytes, allocate=True, owner=None)
        if prefault:
            seg.as_numpy()[::4096] = 0
        return seg

    def _map(
        self,
        address: int,
        nbytes: int,
        allocate: bool,
        owner: Any,
        memory_type: MemoryType = MemoryType.HOST,
        device: int | None = None,
    ) -> Segment:
        memh, base, mlen = ffi.new("kvf_mem_h *"), ffi.new("void **"), ffi.new("size_t *")
        params = ffi.new("kvf_mem_map_params_t *")
        params.field_mask = (
            native.MEM_MAP_PARAM_FIELD_ADDRESS
            | native.MEM_MAP_PARAM_FIELD_FLAGS
            | native.MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        )
        params.address = ffi.cast("void *", address)
        params.length = nbytes
        params.flags = native.MEM_MAP_FLAG_ALLOCATE if allocate else 0
        params.memory_type = memtypes.NATIVE_TYPE[memory_type]
        _check(
            lib.kvf_mem_map(self._worker, params, memh, base, mlen),
            f"mapping {nbytes} bytes of {memory_type.value} memory",
        )
        rbuf, rsize = ffi.new("void **"), ffi.new("size_t *")
        st = lib.kvf_rkey_pack(self._worker, memh[0], rbuf, rsize)
        if st != 0:
            lib.kvf_mem_unmap(self._worker, memh[0])
            _check(st, "packing an rkey")
        rkey = bytes(ffi.buffer(rbuf[0], rsize[0]))
        lib.kvf_rkey_buffer_release(rbuf[0])
        length = nbytes if not allocate else min(nbytes, int(mlen[0]))
        seg = Segment(
            base=int(ffi.cast("uintptr_t", base[0])),
            length=length,
            rkey=rkey,
            incarnation=self.incarnation,
            allocated=allocate,
            memh=memh[0],
            owner=owner,
            memory_type=memory_type.value,
            device=device,
        )
        self.segments.append(seg)
        return seg

    def deregister(self, seg: Segment) -> None:
        """Unmap a segment. For allocated segments this releases the memory: only do it
        once no peer can write it any more (I4); peers that mapped it keep their mapping."""
        if seg.registered:
            seg.registered = False
            self.segments.remove(seg)
            _check(lib.kvf_mem_unmap(self._worker, seg.memh), "unmapping a segment")
