"""A decode request's ``kv_transfer_params``: what they name, and the ticket that proves a
prefill engine issued them for this request's prompt.

The parameters are a client's input: any request that reaches the decode's front door can
carry them. Without a proof, a client naming another request's ``remote_request_id`` and
a prompt of the same length would load that request's KV, and decode its own tokens over
another prompt's pages. So the prefill's scheduler seals what it hands out:
``kvferry_ticket`` is HMAC-SHA256, under a key HKDF derives from the engines' secret for
this use alone (:class:`~.sidechannel.HandshakeKey`), over the fields a load is planned
from (prefill engine id, host, port, request id, TP size, block ids) and a digest of the
prompt's token ids. The decode's scheduler checks the ticket against its own request's
prompt before it plans anything. A ticket that does not check (a field changed, a prompt
that differs in one token, engines of another secret) loads nothing: the prompt is
computed at the decode, logged with the request id and why. A ticket copied into another
request with the very same prompt loads the KV of those tokens, which that request would
compute itself; a second load of one prefill request is refused at its plan.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from . import wire

TICKET = "kvferry_ticket"
_TICKET_VERSION = b"kvferry vllm load ticket v1"


INT64_MAX = (1 << 63) - 1
MAX_TP_SIZE = 1 << 16  # no engine is wider


class BadRemoteParams(ValueError):
    """A request's ``kv_transfer_params`` that name no prefill kvferry can load from."""


def check_id(what: str, rid: str) -> None:
    """BadRemoteParams when ``rid`` is longer than the wire carries."""
    if len(rid) > wire.MAX_REQUEST_ID:
        raise BadRemoteParams(
            f"its {what} has {len(rid)} characters, the wire carries {wire.MAX_REQUEST_ID}"
        )


def parse(params: dict[str, Any], rid: str) -> dict[str, Any]:
    """The prefill a decode request ``rid`` loads from, as its ``kv_transfer_params``
    name it (unchecked: :func:`checked` also proves them); BadRemoteParams says what does
    not parse."""
    try:
        remote_rid = str(params.get("remote_request_id", ""))
        port = int(params.get("remote_port") or 0)
        tp_size = int(params.get("tp_size") or 0)
        src = [int(b) for b in params.get("remote_block_ids") or ()]
    except (TypeError, ValueError) as exc:
        raise BadRemoteParams(f"kv_transfer_params do not parse: {exc}") from None
    check_id("request id", rid)
    check_id("remote_request_id", remote_rid)
    if not 0 <= port < 1 << 16 or not 0 <= tp_size <= MAX_TP_SIZE:
        raise BadRemoteParams(f"remote_port {port}, tp_size {tp_size} (at most {MAX_TP_SIZE})")
    bad = next((b for b in src if not 0 <= b <= INT64_MAX), None)
    if bad is not None:  # a block id no engine has (and no wire carries)
        raise BadRemoteParams(f"remote_block_ids holds {bad}, outside [0, 2**63)")
    return {
        "engine": str(params.get("remote_engine_id", "")),
        "host": str(params.get("remote_host", "")),
        "port": port,
        "rid": remote_rid,
        "tp_size": tp_size,
        "src": src,
    }


def prompt_digest(token_ids: Sequence[int] | None) -> bytes:
    """BLAKE2b-256 of a prompt's token ids as little-endian int64 (about 50 ms for a
    million tokens on one core); BadRemoteParams for a prompt given without token ids."""
    if token_ids is None:
        raise BadRemoteParams("the prompt has no token ids (prompt embeddings): no ticket binds it")
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=32).digest()


def seal(key: bytes, remote: dict[str, Any], digest: bytes) -> str:
    """The ticket (hex) of ``remote`` (as :func:`parse` returns it) for the prompt of
    ``digest``."""
    body = msgpack.packb(
        [
            _TICKET_VERSION,
            remote["engine"],
            remote["host"],
            remote["port"],
            remote["rid"],
            remote["tp_size"],
            remote["src"],
            digest,
        ]
    )
    return hmac.digest(key, body, "sha256").hex()


def checked(
    key: bytes, params: dict[str, Any], rid: str, token_ids: Sequence[int] | None
) -> dict[str, Any]:
    """What decode request ``rid`` (of prompt ``token_ids``) loads from, once its ticket
    proves that a prefill engine of this secret issued these parameters for this prompt;
    BadRemoteParams otherwise, saying which."""
    remote = parse(params, rid)
    ticket = params.get(TICKET)
    if not isinstance(ticket, str) or not ticket:
        raise BadRemoteParams(
            f"kv_transfer_params carry no {TICKET} (a prefill with kvferry's connector adds "
            "one to the parameters it returns; pass them on unchanged)"
        )
    want = seal(key, remote, prompt_digest(token_ids))
    if not hmac.compare_digest(want.encode(), ticket.lower().encode("utf-8", "replace")):
        raise BadRemoteParams(
            f"{TICKET} does not check for prefill request {remote['rid'][:64]!r} and this "
            f"prompt of {len(token_ids or ())} tokens: a parameter was changed, the prompt "
            "is not the one the prefill computed, or the prefill holds another secret"
        )
    return remote
