"""Local segments (registered or UCX-allocated memory), their descriptors and opened
remote segments.

A :class:`SegmentDescriptor` names the owner's incarnation; opening a descriptor of
another incarnation is refused (a restarted peer's memory is not the memory we were told
about). Memory stays registered until :meth:`TransferEngine.deregister`; freeing memory
that a peer may still write is the caller's decision to prove safe (I4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import TransferError, WireError
from .memtypes import MemoryType
from .protocol import CODEC, SEGMENT

if TYPE_CHECKING:
    from .peer import Peer

INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class SegmentDescriptor:
    """What a peer needs to write into a segment: serialises with msgpack (wire codec)."""

    base: int
    length: int
    rkey: bytes
    incarnation: int
    allocated: bool = False
    memory_type: str = "host"  # "host" or "cuda" (MemoryType's values)

    def pack(self) -> bytes:
        return CODEC.encode(
            SEGMENT.make(
                base=self.base,
                length=self.length,
                rkey=self.rkey,
                incarnation=self.incarnation,
                allocated=self.allocated,
                memory_type=self.memory_type,
            )
        )

    @classmethod
    def unpack(cls, data: bytes) -> SegmentDescriptor:
        msg = CODEC.decode(data)
        if msg.kind != "SEGMENT":
            raise WireError(f"expected a SEGMENT descriptor, got {msg.kind}")
        fields = dict(msg.fields)
        kind = fields.pop("memory_type", None)
        base, length = int(fields["base"]), int(fields["length"])
        if base + length > INT64_MAX:  # the native layer's offsets are int64
            raise WireError(
                f"SEGMENT descriptor: base {base:#x} + length {length} passes 2**63 - 1"
            )
        return cls(**fields, memory_type=MemoryType(kind or "host").value)


@dataclass(eq=False)
class Segment:
    """Local memory known to UCX. ``base``/``length`` are the mapped range; ``owner`` keeps
    the user's buffer alive while it is registered. ``memory_type`` is ``"host"`` or
    ``"cuda"`` (then ``device`` is the CUDA device ordinal, where known)."""

    base: int
    length: int
    rkey: bytes
    incarnation: int
    allocated: bool
    memh: Any = field(repr=False)
    owner: Any = field(default=None, repr=False)
    registered: bool = True
    memory_type: str = "host"
    device: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.memory_type == MemoryType.CUDA.value

    def descriptor(self) -> SegmentDescriptor:
        return SegmentDescriptor(
            self.base, self.length, self.rkey, self.incarnation, self.allocated, self.memory_type
        )

    def as_numpy(self) -> np.ndarray:
        """A uint8 view of the whole segment (zero-copy; host memory only)."""
        from ._native import ffi

        if self.is_cuda:
            raise TransferError("as_numpy: a CUDA segment has no host view (use as_torch)")

        return np.frombuffer(ffi.buffer(ffi.cast("char *", self.base), self.length), dtype=np.uint8)

    def as_torch(self) -> Any:
        """A uint8 tensor viewing the whole segment (zero-copy): on the CPU, or for a CUDA
        segment registered from a torch tensor, a flat view of that tensor on its device;
        typed Any, since torch is optional for this package."""
        import torch

        if self.is_cuda:
            if not isinstance(self.owner, torch.Tensor):
                raise TransferError("as_torch: this CUDA segment was not registered from a tensor")
            return self.owner.reshape(-1).view(torch.uint8)[: self.length]

        return torch.from_numpy(self.as_numpy())


@dataclass(eq=False)
class RemoteSegment:
    """A peer's segment opened on this engine: the unpacked rkey, and, when the memory is
    mapped into this process (``direct`` is its local address), a direct copy path; when
    it is not but the peer's process on this host can be written by the kernel's
    cross-memory copy, ``cross_memory`` is True."""

    peer: Peer
    descriptor: SegmentDescriptor
    rkey: Any = field(repr=False)
    direct: int | None = None
    cross_memory: bool = False

    @property
    def path(self) -> str:
        """How pages reach it: ``"direct"`` (mapped here), ``"cross-memory"`` (the
        kernel's copy into the peer's process) or ``"ucp_put"`` (one UCX put each)."""
        if self.direct is not None:
            return "direct"
        return "cross-memory" if self.cross_memory else "ucp_put"

    @property
    def length(self) -> int:
        return self.descriptor.length

    @property
    def base(self) -> int:
        return self.descriptor.base
