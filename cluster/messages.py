"""The control messages between ranks (codec ``kvf.cluster`` version 3).

Every message carries a header: the sender's rank, its incarnation and a per-sender
sequence number, so a receiver drops duplicates and messages of a stale incarnation and
counts them (abort protocol, step 2). Field sizes are bounded so that bad input is refused
by the decoder and never reaches the protocol logic.

Flow of one request (router R, prefill writers W1..Wt, decode owner D):

    R -> W*  PREFILL(rid, tokens, owner)          compute KV into the writer's own pages
    R -> D   ASSIGN(rid, prompt_len, max_tokens, writers)
    D -> W*  PLAN(rid, pages, generations)        where to write (after D allocated)
    W -> D   NOTICE(rid, tokens, checksums, first_token, ...)
                                                  sent by notify: after the writer's flush
    W -> D   NOTICE_PART(rid, offset, pages, ...) a long prompt, pipelined: these pages
                                                  landed (notify); the owner checks them now

PREFILL, PLAN and NOTICE carry lists as long as the prompt; each is cut into chunks of
``offset`` and ``total`` (see :mod:`.chunks`), so that no prompt the context length
admits ever makes a message too big to send. Pages, generations and checksums travel as
int64 arrays (packed bytes; each decoded message holds arrays of its own): a million-token
prompt's plan and notice then cost the ranks microseconds a chunk, not a Python object a
page.
    D -> R   TOKENS(rid, offset, tokens) ..., DONE(rid, outcome, error, count)
    any -> * ABORT(rid, reason);  W -> D ABORT_ACK(rid) after the writer's flush
    W/D -> R RELEASED(rid, pages)                 the rank freed the request's pages
    any -> R STATS(...)                           pool and transfer figures for /metrics
    D -> R   SEVERED(peer_rank, incarnation)      D cut that writer off: route nothing to it

A decode group that splits the KV heads of a model that mixes them (cluster.group_decode;
lead L, the group's first member, and members M):
    M -> L   MEMBER_READY(rid, member)            M's pages verified: it can attend
    L -> M   ATTEND(step, layer, rids, q, k, v)   per layer of a step: M's heads' query
    M -> L   ATTENDED(step, layer, rids, out, failed)   their attention over M's pages
    L -> M   STEPPED(rids, tokens)                the step's tokens (M reports them too)
"""

from __future__ import annotations

from kvferry.engine.protocol.words import AbortSource, Kind, Outcome, Release
from kvferry.transfer.wire import Codec, Field, FieldType, Message, MessageKind

from .chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK
from .topology import Role

MAX_REQUEST_ID = 128
MAX_TOKENS_PER_MESSAGE = 1 << 20  # generated tokens in one TOKENS message
MAX_ERROR_CHARS = 4096  # DONE.error
MAX_REASON_CHARS = 1024  # ABORT.reason, SEVERED.reason

# version 3: page checksums over 16-bit words (kvferry.engine.integrity)
CODEC = Codec("kvf.cluster", version=3, max_bytes=16 << 20)

_RID = Field(FieldType.STR, max_len=MAX_REQUEST_ID)
_HEADER = dict(src=Field(FieldType.INT), inc=Field(FieldType.UINT64), seq=Field(FieldType.UINT64))

PREFILL = CODEC.kind(
    Kind.PREFILL,
    **_HEADER,
    rid=_RID,
    tokens=Field(FieldType.BYTES, max_len=4 * TOKENS_PER_CHUNK),  # int32 little-endian
    offset=Field(FieldType.INT),  # of this chunk's first token in the prompt
    total=Field(FieldType.INT),  # the prompt's length
    owner=Field(FieldType.INT),
    owner_inc=Field(FieldType.UINT64),
    # the request id the writer holds the prompt's source pages under (None: rid): a
    # decode group's members that one writer writes into share one prefill and its pages
    share=Field(FieldType.STR, max_len=MAX_REQUEST_ID, optional=True),
)
ASSIGN = CODEC.kind(
    Kind.ASSIGN,
    **_HEADER,
    rid=_RID,
    prompt_len=Field(FieldType.INT),
    max_tokens=Field(FieldType.INT),
    writers=Field(FieldType.INT_LIST, max_len=256),
    last_token=Field(FieldType.INT),  # decode's first input (see engine.models)
    # a decode group's members (their request ids and ranks, in group order) when the
    # group splits the heads of a model that mixes them (cluster.group_decode)
    group_rids=Field(FieldType.STR_LIST, max_len=64, optional=True),
    group_ranks=Field(FieldType.INT_LIST, max_len=64, optional=True),
)
PLAN = CODEC.kind(
    Kind.PLAN,
    **_HEADER,
    rid=_RID,
    offset=Field(FieldType.INT),  # of this chunk's first page in the plan
    total=Field(FieldType.INT),  # pages in the whole plan
    pages=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
    generations=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
)
NOTICE = CODEC.kind(
    Kind.NOTICE,
    **_HEADER,
    rid=_RID,
    tokens=Field(FieldType.INT),  # prompt positions whose KV was written
    offset=Field(FieldType.INT),  # of this chunk's first page in the notice
    total=Field(FieldType.INT),  # pages the writer wrote in all
    pages=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
    generations=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
    checksums=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),  # empty: checks off
    bytes=Field(FieldType.INT),  # bytes the writer posted (checked by the owner)
    prefill_ms=Field(FieldType.FLOAT, optional=True),  # the writer's prefill compute time
    first_token=Field(FieldType.INT, optional=True),  # the answer's first, from the prefill
)
NOTICE_PART = CODEC.kind(
    Kind.NOTICE_PART,
    **_HEADER,
    rid=_RID,
    offset=Field(FieldType.INT),  # of the part's first page in the writer's pages
    pages=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
    generations=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
    checksums=Field(FieldType.INT64_ARRAY, max_len=PAGES_PER_CHUNK),
)  # pipelined: these pages landed (flush first); later writes may still be in flight
TOKENS = CODEC.kind(
    Kind.TOKENS,
    **_HEADER,
    rid=_RID,
    offset=Field(FieldType.INT),  # index of the first token in the answer
    tokens=Field(FieldType.INT_LIST, max_len=MAX_TOKENS_PER_MESSAGE),
)
DONE = CODEC.kind(
    Kind.DONE,
    **_HEADER,
    rid=_RID,
    outcome=Field(FieldType.STR, max_len=32, choices=Outcome),
    error=Field(FieldType.STR, max_len=MAX_ERROR_CHARS, optional=True),
    count=Field(FieldType.INT, optional=True),  # tokens generated in all (finished)
    transfer_ms=Field(FieldType.FLOAT, optional=True),
    prefill_ms=Field(FieldType.FLOAT, optional=True),
    # the owner's CLOCK_MONOTONIC (ns) when its writers' last notice arrived: every byte
    # had landed (a router on the same host times the first token from there)
    landed_ns=Field(FieldType.INT, optional=True),
)
ABORT = CODEC.kind(
    Kind.ABORT,
    **_HEADER,
    rid=_RID,
    owner=Field(FieldType.INT),  # the decode rank owning the pages
    writers=Field(FieldType.INT_LIST, max_len=256),
    source=Field(FieldType.STR, max_len=32, choices=AbortSource),
    reason=Field(FieldType.STR, max_len=MAX_REASON_CHARS),
)
ABORT_ACK = CODEC.kind(Kind.ABORT_ACK, **_HEADER, rid=_RID)
RELEASED = CODEC.kind(
    Kind.RELEASED,
    **_HEADER,
    rid=_RID,
    pages=Field(FieldType.INT),
    how=Field(FieldType.STR, max_len=32, choices=Release),
    justification=Field(FieldType.STR, max_len=96),  # engine.protocol.proof.justification
    abort_ms=Field(FieldType.FLOAT, optional=True),  # owner: from the abort to the release
    released_ns=Field(FieldType.UINT64, optional=True),
)  # owner's CLOCK_MONOTONIC then
STATS = CODEC.kind(
    Kind.STATS,
    **_HEADER,
    free=Field(FieldType.INT),
    owned=Field(FieldType.INT),
    quarantined=Field(FieldType.INT),
    capacity_tokens=Field(FieldType.INT),
    context_length=Field(FieldType.INT),
    bytes_written=Field(FieldType.INT),
    batches=Field(FieldType.INT),
    integrity_failures=Field(FieldType.INT),
    severed=Field(FieldType.INT),
    allocations=Field(FieldType.INT),
    dropped_duplicate=Field(FieldType.INT),
    dropped_stale=Field(FieldType.INT),
    dropped_malformed=Field(FieldType.INT),
    # messages without a valid MAC of the cluster's secret (never decoded, never acted on)
    dropped_unauthenticated=Field(FieldType.INT, optional=True),
    # a decode rank's second ASSIGNs of a live request (the router's bug; the first stands)
    dropped_duplicate_assign=Field(FieldType.INT, optional=True),
    # failure domains: the card epoch this rank has adopted, and the writer incarnations
    # ("rank:inc" in hex) whose ack or proof its quarantined pages still wait on
    cards_epoch=Field(FieldType.INT, optional=True),
    fenced=Field(FieldType.STR_LIST, max_len=1024, optional=True),
    # a decode rank's quarantined requests: pages, what each waits on, the proofs so far
    quarantines=Field(FieldType.STR_LIST, max_len=64, optional=True),
    # pages held for requests of another router incarnation (a restarted router's count)
    other_routers=Field(FieldType.INT, optional=True),
)
SEVERED = CODEC.kind(
    Kind.SEVERED,
    **_HEADER,
    peer_rank=Field(FieldType.INT),
    incarnation=Field(FieldType.UINT64),
    reason=Field(FieldType.STR, max_len=MAX_REASON_CHARS),
)
SHUTDOWN = CODEC.kind(Kind.SHUTDOWN, **_HEADER)

# A decode group that splits a head-mixing model's KV heads (cluster.group_decode): the
# lead's step asks each member for each layer's attention over the member's heads.
MAX_GROUP_BATCH = 256  # requests in one group step
MAX_SHARE_BYTES = 1 << 20  # one of a layer's q, k, v or attention tensors for one member
MEMBER_READY = CODEC.kind(
    Kind.MEMBER_READY, **_HEADER, rid=_RID, member=Field(FieldType.INT)
)  # rid: the lead's request; member: the sender's position in the group
ATTEND = CODEC.kind(
    Kind.ATTEND,
    **_HEADER,
    step=Field(FieldType.UINT64),  # the lead's step number
    layer=Field(FieldType.INT),
    rids=Field(FieldType.STR_LIST, max_len=MAX_GROUP_BATCH),  # the member's request ids
    positions=Field(FieldType.INT64_ARRAY, max_len=MAX_GROUP_BATCH),  # where the K/V goes
    q=Field(FieldType.BYTES, max_len=MAX_SHARE_BYTES),  # [batch, held q heads, head_dim]
    k=Field(FieldType.BYTES, max_len=MAX_SHARE_BYTES),  # [batch, held kv heads, head_dim]
    v=Field(FieldType.BYTES, max_len=MAX_SHARE_BYTES),
)
ATTENDED = CODEC.kind(
    Kind.ATTENDED,
    **_HEADER,
    step=Field(FieldType.UINT64),
    layer=Field(FieldType.INT),
    rids=Field(FieldType.STR_LIST, max_len=MAX_GROUP_BATCH),  # the ATTEND's, in its order
    out=Field(FieldType.BYTES, max_len=MAX_SHARE_BYTES),  # [batch, held q heads, head_dim]
    failed=Field(FieldType.STR_LIST, max_len=MAX_GROUP_BATCH),  # rids it could not attend
    error=Field(FieldType.STR, max_len=MAX_ERROR_CHARS, optional=True),  # why
)
STEPPED = CODEC.kind(
    Kind.STEPPED,
    **_HEADER,
    rids=Field(FieldType.STR_LIST, max_len=MAX_GROUP_BATCH),  # the member's request ids
    tokens=Field(FieldType.INT_LIST, max_len=MAX_GROUP_BATCH),
)

KINDS: dict[str, MessageKind] = dict(CODEC.kinds)
assert set(KINDS) == {k.value for k in Kind}, "every protocol word has its message"

SENDS: dict[Kind, tuple[frozenset[Role], frozenset[Role]]] = {
    # kind: (the roles that send it, the roles it is sent to)
    Kind.PREFILL: (frozenset({Role.ROUTER}), frozenset({Role.PREFILL})),
    Kind.ASSIGN: (frozenset({Role.ROUTER}), frozenset({Role.DECODE})),
    Kind.PLAN: (frozenset({Role.DECODE}), frozenset({Role.PREFILL})),
    Kind.NOTICE: (frozenset({Role.PREFILL}), frozenset({Role.DECODE})),
    Kind.NOTICE_PART: (frozenset({Role.PREFILL}), frozenset({Role.DECODE})),
    Kind.TOKENS: (frozenset({Role.DECODE}), frozenset({Role.ROUTER})),
    Kind.DONE: (frozenset({Role.DECODE}), frozenset({Role.ROUTER})),
    Kind.ABORT: (frozenset(Role), frozenset(Role)),
    Kind.ABORT_ACK: (frozenset({Role.PREFILL}), frozenset({Role.DECODE})),
    Kind.RELEASED: (frozenset({Role.PREFILL, Role.DECODE}), frozenset({Role.ROUTER})),
    Kind.STATS: (frozenset({Role.PREFILL, Role.DECODE}), frozenset({Role.ROUTER})),
    Kind.SEVERED: (frozenset({Role.DECODE}), frozenset({Role.ROUTER})),
    Kind.SHUTDOWN: (frozenset({Role.ROUTER}), frozenset({Role.PREFILL, Role.DECODE})),
    Kind.MEMBER_READY: (frozenset({Role.DECODE}), frozenset({Role.DECODE})),
    Kind.ATTEND: (frozenset({Role.DECODE}), frozenset({Role.DECODE})),
    Kind.ATTENDED: (frozenset({Role.DECODE}), frozenset({Role.DECODE})),
    Kind.STEPPED: (frozenset({Role.DECODE}), frozenset({Role.DECODE})),
}
"""Who sends each kind to whom; every role handles every kind sent to it (a test checks
the handler tables of the router and both ranks against this)."""


def receives(role: Role) -> frozenset[Kind]:
    """The kinds ``role`` must handle."""
    return frozenset(k for k, (_, to) in SENDS.items() if role in to)


FREE_TEXT = ("error", "reason")


def clip(text: str | None, limit: int) -> str | None:
    """Free text (an error, a reason) cut to fit its field: a long message must not make
    the report of a failure fail to send."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 24] + f"... [{len(text)} chars]"


def clip_free_text(kind: MessageKind, fields: dict) -> dict:
    """``fields`` with every free-text field of ``kind`` cut to its limit."""
    for name in FREE_TEXT:
        if isinstance(fields.get(name), str) and name in kind.fields:
            fields[name] = clip(fields[name], kind.fields[name].limit())
    return fields


def encode(msg: Message) -> bytes:
    return CODEC.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Decode one control message; raises WireError (never anything else) on bad input."""
    return CODEC.decode(data)
