"""The message envelope: a fixed binary header around every notify/send payload.

Every active message carries the sender's address (so the receiver can answer and check
the sender's incarnation), a sequence number and whether it was flush-ordered. The hot
path builds and parses it in C (``kvf_msg_send``, ``kvf_envelope_parse`` in
``native/kvf_ucp.c``); this module is the reference codec, the names of the refusal
reasons, and what the tests compare the native parser against.

Layout (little-endian, 32-byte header, nothing after the payload)::

    0  magic      4 bytes  b"KVFE"
    4  version    u8       2
    5  flags      u8       bit 0: flushed (a notice); other bits must be 0
    6  reserved   u16      0
    8  incarnation u64     the sender engine's incarnation
    16 seq        u64      the sender's message sequence number
    24 sender_len u32      1 .. max_sender
    28 payload_len u32     0 .. max_payload
    32 sender address bytes, then payload bytes

Upholds I6 for control input: a malformed envelope is refused with a named reason and
counted, never delivered.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from .errors import WireError

MAGIC = b"KVFE"
VERSION = 2
FLAG_FLUSHED = 1
HEADER = struct.Struct("<4sBBHQQII")
HEADER_BYTES = HEADER.size  # 32


class EnvelopeError(enum.IntEnum):
    """Refusal reasons, numbered as the native parser reports them."""

    OK = 0
    SHORT = 1
    MAGIC = 2
    VERSION = 3
    FLAGS = 4
    SENDER_SIZE = 5
    PAYLOAD_SIZE = 6
    LENGTH = 7


REASONS = {
    EnvelopeError.SHORT: "shorter than the 32-byte envelope header",
    EnvelopeError.MAGIC: "bad magic (not a kvferry envelope)",
    EnvelopeError.VERSION: f"envelope version is not {VERSION}",
    EnvelopeError.FLAGS: "unknown flag bits or non-zero reserved field",
    EnvelopeError.SENDER_SIZE: "sender address empty or over the limit",
    EnvelopeError.PAYLOAD_SIZE: "payload over the limit",
    EnvelopeError.LENGTH: "header lengths do not add up to the message length",
}


@dataclass(frozen=True)
class Envelope:
    incarnation: int
    seq: int
    flushed: bool
    sender: bytes
    payload: bytes


def encode(env: Envelope) -> bytes:
    """The envelope's bytes (what ``kvf_msg_send`` puts on the wire)."""
    if not 0 < len(env.sender) < (1 << 32) or len(env.payload) >= (1 << 32):
        raise WireError(
            f"envelope: sender of {len(env.sender)} or payload of "
            f"{len(env.payload)} bytes cannot be encoded"
        )
    return (
        HEADER.pack(
            MAGIC,
            VERSION,
            FLAG_FLUSHED if env.flushed else 0,
            0,
            env.incarnation,
            env.seq,
            len(env.sender),
            len(env.payload),
        )
        + env.sender
        + env.payload
    )


def check(data: bytes, max_sender: int, max_payload: int) -> EnvelopeError:
    """The refusal reason for ``data`` (``OK`` when well-formed), checked in the same
    order as the native parser."""
    if len(data) < HEADER_BYTES:
        return EnvelopeError.SHORT
    magic, version, flags, reserved, _inc, _seq, slen, plen = HEADER.unpack_from(data)
    if magic != MAGIC:
        return EnvelopeError.MAGIC
    if version != VERSION:
        return EnvelopeError.VERSION
    if flags & ~FLAG_FLUSHED or reserved:
        return EnvelopeError.FLAGS
    if slen == 0 or slen > max_sender:
        return EnvelopeError.SENDER_SIZE
    if plen > max_payload:
        return EnvelopeError.PAYLOAD_SIZE
    if HEADER_BYTES + slen + plen != len(data):
        return EnvelopeError.LENGTH
    return EnvelopeError.OK


def decode(data: bytes, max_sender: int, max_payload: int) -> Envelope:
    """Parse ``data``; raises WireError naming the reason when it is malformed."""
    why = check(data, max_sender, max_payload)
    if why is not EnvelopeError.OK:
        raise WireError(f"envelope of {len(data)} bytes refused: {REASONS[why]}")
    _m, _v, flags, _r, inc, seq, slen, _plen = HEADER.unpack_from(data)
    body = bytes(data[HEADER_BYTES:])
    return Envelope(inc, seq, bool(flags & FLAG_FLUSHED), body[:slen], body[slen:])
