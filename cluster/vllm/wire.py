"""The connector's control messages, carried as kvferry transfer-engine messages.

PLAN (decode worker -> prefill worker: where to write, and which of the model's KV heads;
a PLAN with no heads tells a prefill worker whose heads others write that no write is
wanted from it), NOTICE_PART (prefill -> decode, with ``notify``: blocks ``offset ..`` of
the plan landed, to be checked while the rest is written), NOTICE (prefill -> decode, sent
with ``notify``: after the flush of every write), ABORT (either way), ABORT_ACK (prefill
-> decode, with ``notify``: after the flush). One codec for the whole project: the
transfer engine's typed codec (:class:`kvferry.transfer.wire.Codec`, the one the ranks'
``kvf.cluster`` messages use), whose kinds are the protocol core's words
(:class:`kvferry.engine.protocol.words.Kind`) and whose abort sources decode to
:class:`~kvferry.engine.protocol.words.AbortSource`. Every field is checked on receipt:
a malformed message raises :class:`MalformedMessage` and is counted and dropped, never
acted on.

PLAN's ``regions`` (how the decode worker's KV buffers are laid out) and ``descs`` (its
segments' packed descriptors) are nested values the typed fields do not describe: each
travels as one msgpack blob, unpacked and checked here.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvferry.engine.protocol.words import AbortSource, Kind
from kvferry.transfer.errors import WireError
from kvferry.transfer.protocol import MAX_PAYLOAD
from kvferry.transfer.wire import Codec, Field, FieldType

MAX_LIST = 1 << 20  # blocks in one request (a million-token prompt at block size 1)
MAX_REQUEST_ID = 256
MAX_HEADS = 1 << 12  # KV heads one plan names
MAX_BLOB = 16 << 20  # regions, descriptors
MAX_REASON = 4096  # characters of an ABORT's reason
# the transport's largest message: a NOTICE names every block of its load with a
# checksum, about 14 bytes a block, and a PLAN every block and generation; a
# million-token prompt at block size 16 makes a NOTICE of about 0.9 MiB
MESSAGE_BYTES = MAX_PAYLOAD


def clip_reason(reason: str) -> str:
    """``reason`` as an ABORT carries it: at most :data:`MAX_REASON` characters, the end
    of a longer one cut (the log keeps it whole)."""
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


# version 5: block checksums over 16-bit words (kvferry.engine.integrity)
# version 6: each message sealed after its sender's sequence number, replays refused
# (sidechannel.HandshakeKey.seal_message)
CODEC = Codec("kvf.vllm", version=6, max_bytes=64 << 20, max_items=MAX_LIST)
PLAN, NOTICE, ABORT, ABORT_ACK = Kind.PLAN, Kind.NOTICE, Kind.ABORT, Kind.ABORT_ACK
NOTICE_PART = Kind.NOTICE_PART

_RID = Field(FieldType.STR, max_len=MAX_REQUEST_ID)
_INTS = Field(FieldType.INT_LIST, max_len=MAX_LIST)
_IDS = dict(rid=_RID, orid=_RID)  # the receiver's request id, and the sender's own

CODEC.kind(
    PLAN,
    **_IDS,
    blocks=_INTS,
    gens=_INTS,
    tokens=Field(FieldType.INT),
    regions=Field(FieldType.BYTES, max_len=MAX_BLOB),
    descs=Field(FieldType.BYTES, max_len=MAX_BLOB),
    tp_rank=Field(FieldType.INT),
    tp_size=Field(FieldType.INT),
    kv_heads=Field(FieldType.INT),
    heads=Field(FieldType.INT_LIST, max_len=MAX_HEADS),
)
CODEC.kind(
    NOTICE_PART,
    **_IDS,
    offset=Field(FieldType.INT),  # the part's first block's place in the plan
    blocks=_INTS,
    gens=_INTS,
    checksums=_INTS,
)
CODEC.kind(
    NOTICE,
    **_IDS,
    tokens=Field(FieldType.INT),
    blocks=_INTS,
    gens=_INTS,
    checksums=_INTS,
    bytes=Field(FieldType.INT),
)
CODEC.kind(
    ABORT,
    **_IDS,
    source=Field(FieldType.STR, choices=AbortSource),
    reason=Field(FieldType.STR, max_len=MAX_REASON),
    tp_rank=Field(FieldType.INT),  # the sender's TP rank, TP size and KV heads in all
    tp_size=Field(FieldType.INT),
    kv_heads=Field(FieldType.INT),
)
CODEC.kind(ABORT_ACK, **_IDS)


class MalformedMessage(ValueError):
    pass


def encode(kind: Kind, **fields: Any) -> bytes:
    """One message of ``kind``; a PLAN's ``regions`` (a dict) and ``descs`` (a list of
    bytes) are packed here."""
    if kind is PLAN:
        fields["regions"] = msgpack.packb(fields["regions"], use_bin_type=True)
        fields["descs"] = msgpack.packb(list(fields["descs"]), use_bin_type=True)
    return CODEC.encode(CODEC.kinds[kind].make(**fields))


def decode(payload: bytes) -> dict[str, Any]:
    """The message's fields, with its kind under ``"k"``; raises MalformedMessage."""
    try:
        msg = CODEC.decode(payload)
    except WireError as exc:
        raise MalformedMessage(str(exc)) from None
    out: dict[str, Any] = {"k": Kind(msg.kind), **msg.fields}
    if out["k"] is PLAN:
        out["regions"] = _blob(out["regions"], dict, "regions")
        out["descs"] = _blob(out["descs"], list, "descs")
        if not all(isinstance(d, bytes) for d in out["descs"]):
            raise MalformedMessage("PLAN: descs must be a list of bytes")
    return out


def _blob(data: bytes, want: type, name: str) -> Any:
    try:
        value = msgpack.unpackb(
            data, raw=False, strict_map_key=False, max_bin_len=MAX_BLOB, max_str_len=MAX_BLOB
        )
    except Exception as exc:
        raise MalformedMessage(f"PLAN: {name} is not msgpack ({type(exc).__name__})") from None
    if not isinstance(value, want):
        raise MalformedMessage(f"PLAN: {name} is {type(value).__name__}, not {want.__name__}")
    return value
