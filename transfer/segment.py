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

from .errors import WireError
from .protocol import CODEC, SEGMENT

if TYPE_CHECKING:
    from .peer import Peer


@dataclass(frozen=True)
class SegmentDescriptor:
    """What a peer needs to write into a segment: serialises with msgpack (wire codec)."""

    base: int
    length: int
    rkey: bytes
    incarnation: int
    allocated: bool = False

    def pack(self) -> bytes:
        return CODEC.encode(
            SEGMENT.make(
                base=self.base,
                length=self.length,
                rkey=self.rkey,
                incarnation=self.incarnation,
                allocated=self.allocated,
            )
        )

    @classmethod
    def unpack(cls, data: bytes) -> SegmentDescriptor:
        msg = CODEC.decode(data)
        if msg.kind != "SEGMENT":
            raise WireError(f"expected a SEGMENT descriptor, got {msg.kind}")
        return cls(**msg.fields)


@dataclass(eq=False)
class Segment:
    """Local memory known to UCX. ``base``/``length`` are the mapped range; ``owner`` keeps
    the user's buffer alive while it is registered."""

    base: int
    length: int
    rkey: bytes
    incarnation: int
    allocated: bool
    memh: Any = field(repr=False)
    owner: Any = field(default=None, repr=False)
    registered: bool = True

    def descriptor(self) -> SegmentDescriptor:
        return SegmentDescriptor(
            self.base, self.length, self.rkey, self.incarnation, self.allocated
        )

    def as_numpy(self) -> np.ndarray:
        """A uint8 view of the whole segment (zero-copy)."""
        from ._native import ffi

        return np.frombuffer(ffi.buffer(ffi.cast("char *", self.base), self.length), dtype=np.uint8)

    def as_torch(self) -> Any:
        """A uint8 CPU tensor viewing the whole segment (zero-copy); typed Any, since
        torch is optional for this package."""
        import torch

        return torch.from_numpy(self.as_numpy())


@dataclass(eq=False)
class RemoteSegment:
    """A peer's segment opened on this engine: the unpacked rkey, and, when the memory is
    mapped into this process (``direct`` is its local address), a direct copy path."""

    peer: Peer
    descriptor: SegmentDescriptor
    rkey: Any = field(repr=False)
    direct: int | None = None

    @property
    def length(self) -> int:
        return self.descriptor.length

    @property
    def base(self) -> int:
        return self.descriptor.base
