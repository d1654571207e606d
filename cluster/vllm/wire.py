"""The connector's control messages, carried as kvferry transfer-engine messages.

PLAN (decode worker -> prefill worker: where to write), NOTICE (prefill -> decode, sent
with ``notify``: after the flush of every write), ABORT (either way), ABORT_ACK (prefill
-> decode, with ``notify``: after the flush). msgpack maps with a kind, checked field by
field on receipt: a malformed message raises :class:`MalformedMessage` and is counted
and dropped, never acted on.
"""

from __future__ import annotations

from typing import Any

import msgpack

VERSION = 1
PLAN, NOTICE, ABORT, ABORT_ACK = "PLAN", "NOTICE", "ABORT", "ABORT_ACK"

_INT_LIST = "int-list"
_FIELDS: dict[str, dict[str, Any]] = {
    PLAN: {
        "rid": str,
        "orid": str,
        "blocks": _INT_LIST,
        "gens": _INT_LIST,
        "tokens": int,
        "regions": dict,
        "descs": list,
        "tp_rank": int,
        "tp_size": int,
    },
    NOTICE: {
        "rid": str,
        "orid": str,
        "tokens": int,
        "blocks": _INT_LIST,
        "gens": _INT_LIST,
        "checksums": _INT_LIST,
        "bytes": int,
    },
    ABORT: {"rid": str, "orid": str, "source": str, "reason": str},
    ABORT_ACK: {"rid": str, "orid": str},
}
MAX_LIST = 1 << 20


class MalformedMessage(ValueError):
    pass


def encode(kind: str, **fields: Any) -> bytes:
    spec = _FIELDS[kind]
    if set(fields) != set(spec):
        raise ValueError(f"{kind}: fields {sorted(fields)} != {sorted(spec)}")
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, use_bin_type=True)


def decode(payload: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise MalformedMessage(f"not msgpack: {exc}") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION or msg.get("k") not in _FIELDS:
        raise MalformedMessage(f"unknown message {str(msg)[:80]}")
    for name, want in _FIELDS[msg["k"]].items():
        value = msg.get(name)
        if want == _INT_LIST:
            ok = (
                isinstance(value, list)
                and len(value) <= MAX_LIST
                and all(type(x) is int for x in value)
            )
        else:
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if not ok:
            raise MalformedMessage(f"{msg['k']}: field {name} is {type(value).__name__}")
    return msg
