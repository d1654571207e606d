"""The transfer engine's own wire schemas (codec ``kvf.transfer`` version 1).

- ``ADDRESS``: what :attr:`TransferEngine.address` holds: the UCX worker address plus the
  engine's incarnation, name and process identity (host, boot id, pid namespace, pid) so
  that a peer on the same host can watch the process for death.
- ``SEGMENT``: a segment descriptor (base, length, packed rkey, owner incarnation, and
  the memory type: absent from older peers' descriptors, which are host memory).

Active messages travel in a fixed binary envelope (sender address and incarnation, a
sequence number, the flushed flag, the payload), built and parsed natively: see
:mod:`kvferry.transfer.envelope`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .memtypes import MemoryType
from .wire import Codec, Field, FieldType

MAX_UCX_ADDRESS = 64 << 10
MAX_RKEY = 16 << 10
MAX_PAYLOAD = 4 << 20
MAX_SENDER = MAX_UCX_ADDRESS + 1024  # an encoded ADDRESS, in every envelope

CODEC = Codec("kvf.transfer", version=1, max_bytes=MAX_PAYLOAD + 2 * MAX_UCX_ADDRESS)

ADDRESS = CODEC.kind(
    "ADDRESS",
    ucx=Field(FieldType.BYTES, max_len=MAX_UCX_ADDRESS),
    incarnation=Field(FieldType.UINT64),
    name=Field(FieldType.STR, max_len=256),
    host=Field(FieldType.STR, max_len=256),
    boot_id=Field(FieldType.STR, max_len=64),
    pidns=Field(FieldType.UINT64),
    pid=Field(FieldType.INT),
)

SEGMENT = CODEC.kind(
    "SEGMENT",
    base=Field(FieldType.UINT64),
    length=Field(FieldType.UINT64),
    rkey=Field(FieldType.BYTES, max_len=MAX_RKEY),
    incarnation=Field(FieldType.UINT64),
    allocated=Field(FieldType.BOOL),
    memory_type=Field(FieldType.STR, optional=True, choices=MemoryType),
)


@dataclass(frozen=True)
class AddressInfo:
    """A decoded engine address."""

    ucx: bytes
    incarnation: int
    name: str
    host: str
    boot_id: str
    pidns: int
    pid: int

    def same_host(self, other: AddressInfo) -> bool:
        """Whether both engines run in one kernel boot and one PID namespace, so that
        each one's pid names the other's process in /proc. An engine that could not read
        its boot id or its namespace (an empty boot id, namespace 0) is on no one's host:
        taken for local, a writer on another host of the same name would be looked up
        here, and its absence read as its end."""
        known = bool(self.boot_id) and self.pidns != 0
        return known and (self.host, self.boot_id, self.pidns) == (
            other.host,
            other.boot_id,
            other.pidns,
        )


BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE_PATH = "/proc/self/ns/pid"


def read_boot_id() -> str:
    """This kernel boot's id as the kernel writes it (OSError where unreadable)."""
    with open(BOOT_ID_PATH) as f:
        return f.read().strip()


def read_pid_namespace() -> int:
    """The inode of this process's PID namespace (OSError where unreadable)."""
    return os.stat(PID_NAMESPACE_PATH).st_ino


def decode_address(address: bytes) -> AddressInfo:
    """Decode :attr:`TransferEngine.address` bytes (raises WireError if malformed)."""
    msg = CODEC.decode(address)
    if msg.kind != "ADDRESS":
        from .errors import WireError

        raise WireError(f"expected an ADDRESS, got {msg.kind}")
    return AddressInfo(**msg.fields)


@dataclass(frozen=True)
class IncomingMessage:
    """An active message as delivered to the engine's message handler."""

    sender_address: bytes
    sender_name: str
    sender_incarnation: int
    seq: int
    flushed: bool
    payload: bytes
