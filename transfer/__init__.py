"""kvferry.transfer: one-sided page writes and reads between processes over UCX.

Knows nothing about requests or models. See :mod:`kvferry.transfer.engine` for the API,
its threading model and transport choices, and :mod:`kvferry.transfer.wire` for the
versioned msgpack codec that control messages use.

Quick tour::

    eng = TransferEngine(TransferConfig(transports="shm", name="prefill0"))
    seg = eng.register(np.zeros(1 << 20, np.uint8))        # or eng.allocate(nbytes)
    peer = eng.connect(peer_address, name="decode0")        # the peer's eng.address
    rseg = eng.open_segment(peer, SegmentDescriptor.unpack(desc_bytes))
    eng.write(peer, seg, rseg, [[0, 4096, 4096]]).wait(5.0) # visible at the target
    eng.notify(peer, b"done").wait(5.0)                     # arrives after the data
"""

from .batch import Batch, BatchStatus
from .engine import TransferConfig, TransferCounters, TransferEngine
from .errors import (
    CudaMemoryUnavailableError,
    DeadlineExceeded,
    PeerFailedError,
    RdmaUnavailableError,
    SegmentBoundsError,
    StaleIncarnationError,
    TransferError,
    UcxError,
    UnflushableError,
    WireError,
    ucx_error,
)
from .local_copy import copy_runs, copy_tensor_runs
from .memtypes import MemoryType
from .peer import Peer, PeerState
from .protocol import AddressInfo, IncomingMessage, decode_address
from .segment import RemoteSegment, Segment, SegmentDescriptor

__all__ = [
    "AddressInfo",
    "Batch",
    "BatchStatus",
    "CudaMemoryUnavailableError",
    "DeadlineExceeded",
    "IncomingMessage",
    "MemoryType",
    "Peer",
    "PeerFailedError",
    "PeerState",
    "RdmaUnavailableError",
    "RemoteSegment",
    "Segment",
    "SegmentBoundsError",
    "SegmentDescriptor",
    "StaleIncarnationError",
    "TransferConfig",
    "TransferCounters",
    "TransferEngine",
    "TransferError",
    "UcxError",
    "UnflushableError",
    "WireError",
    "copy_runs",
    "copy_tensor_runs",
    "decode_address",
    "ucx_error",
]
