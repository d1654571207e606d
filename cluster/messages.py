"""The control messages between ranks (codec ``kvf.cluster`` version 1).

Every message carries a header: the sender's rank, its incarnation and a per-sender
sequence number, so a receiver drops duplicates and messages of a stale incarnation and
counts them (abort protocol, step 2). Field sizes are bounded so that bad input is refused
by the decoder and never reaches the protocol logic.

Flow of one request (router R, prefill writers W1..Wt, decode owner D):

    R -> W*  PREFILL(rid, tokens, owner)          compute KV into the writer's own pages
    R -> D   ASSIGN(rid, prompt_len, max_tokens, writers)
    D -> W*  PLAN(rid, pages, generations)        where to write (after D allocated)
    W -> D   NOTICE(rid, tokens, checksums, ...)  sent by notify: after the writer's flush
    D -> R   TOKENS(rid, offset, tokens) ..., DONE(rid, outcome, error, count)
    any -> * ABORT(rid, reason);  W -> D ABORT_ACK(rid) after the writer's flush
    W/D -> R RELEASED(rid, pages)                 the rank freed the request's pages
    any -> R STATS(...)                           pool and transfer figures for /metrics
    D -> R   SEVERED(peer_rank, incarnation)      D cut that writer off: route nothing to it
"""

from __future__ import annotations

from kvferry.transfer.wire import Codec, Field, FieldType, Message, MessageKind

MAX_REQUEST_ID = 128
MAX_TOKENS_PER_MESSAGE = 1 << 20
MAX_PAGES_PER_MESSAGE = 1 << 16

CODEC = Codec("kvf.cluster", version=1, max_bytes=16 << 20)

_RID = Field(FieldType.STR, max_len=MAX_REQUEST_ID)
_HEADER = dict(src=Field(FieldType.INT), inc=Field(FieldType.UINT64), seq=Field(FieldType.UINT64))

PREFILL = CODEC.kind(
    "PREFILL", **_HEADER, rid=_RID,
    tokens=Field(FieldType.BYTES, max_len=4 * MAX_TOKENS_PER_MESSAGE),  # int32 little-endian
    owner=Field(FieldType.INT),
    owner_inc=Field(FieldType.UINT64))
ASSIGN = CODEC.kind(
    "ASSIGN", **_HEADER, rid=_RID,
    prompt_len=Field(FieldType.INT),
    max_tokens=Field(FieldType.INT),
    writers=Field(FieldType.INT_LIST, max_len=256),
    last_token=Field(FieldType.INT))            # decode's first input (see engine.models)
PLAN = CODEC.kind(
    "PLAN", **_HEADER, rid=_RID,
    pages=Field(FieldType.INT_LIST, max_len=MAX_PAGES_PER_MESSAGE),
    generations=Field(FieldType.INT_LIST, max_len=MAX_PAGES_PER_MESSAGE))
NOTICE = CODEC.kind(
    "NOTICE", **_HEADER, rid=_RID,
    tokens=Field(FieldType.INT),              # prompt positions whose KV was written
    pages=Field(FieldType.INT_LIST, max_len=MAX_PAGES_PER_MESSAGE),
    generations=Field(FieldType.INT_LIST, max_len=MAX_PAGES_PER_MESSAGE),
    checksums=Field(FieldType.INT_LIST, max_len=MAX_PAGES_PER_MESSAGE),
    bytes=Field(FieldType.INT))               # bytes the writer posted (checked by the owner)
TOKENS = CODEC.kind(
    "TOKENS", **_HEADER, rid=_RID,
    offset=Field(FieldType.INT),                # index of the first token in the answer
    tokens=Field(FieldType.INT_LIST, max_len=MAX_TOKENS_PER_MESSAGE))
DONE = CODEC.kind(
    "DONE", **_HEADER, rid=_RID,
    outcome=Field(FieldType.STR, max_len=32),    # finished, failed, aborted
    error=Field(FieldType.STR, max_len=4096, optional=True),
    count=Field(FieldType.INT, optional=True),   # tokens generated in all (finished)
    transfer_ms=Field(FieldType.FLOAT, optional=True))
ABORT = CODEC.kind(
    "ABORT", **_HEADER, rid=_RID,
    owner=Field(FieldType.INT),                 # the decode rank owning the pages
    writers=Field(FieldType.INT_LIST, max_len=256),
    source=Field(FieldType.STR, max_len=32),    # client, deadline, prefill, transfer, decode, integrity
    reason=Field(FieldType.STR, max_len=1024))
ABORT_ACK = CODEC.kind("ABORT_ACK", **_HEADER, rid=_RID)
RELEASED = CODEC.kind(
    "RELEASED", **_HEADER, rid=_RID,
    pages=Field(FieldType.INT),
    how=Field(FieldType.STR, max_len=32),       # freed, acked, severed, unsafe
    abort_ms=Field(FieldType.FLOAT, optional=True),   # owner: from the abort to the release
    released_ns=Field(FieldType.UINT64, optional=True))  # owner's CLOCK_MONOTONIC then
STATS = CODEC.kind(
    "STATS", **_HEADER,
    free=Field(FieldType.INT), owned=Field(FieldType.INT), quarantined=Field(FieldType.INT),
    capacity_tokens=Field(FieldType.INT), context_length=Field(FieldType.INT),
    bytes_written=Field(FieldType.INT), batches=Field(FieldType.INT),
    integrity_failures=Field(FieldType.INT), severed=Field(FieldType.INT),
    allocations=Field(FieldType.INT),
    dropped_duplicate=Field(FieldType.INT), dropped_stale=Field(FieldType.INT),
    dropped_malformed=Field(FieldType.INT))
SEVERED = CODEC.kind(
    "SEVERED", **_HEADER,
    peer_rank=Field(FieldType.INT), incarnation=Field(FieldType.UINT64),
    reason=Field(FieldType.STR, max_len=1024))
SHUTDOWN = CODEC.kind("SHUTDOWN", **_HEADER)

KINDS: dict[str, MessageKind] = dict(CODEC.kinds)


def encode(msg: Message) -> bytes:
    return CODEC.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one control message; raises WireError (never anything else) on bad input."""
    return CODEC.decode(data)
