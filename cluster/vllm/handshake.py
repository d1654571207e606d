"""A prefill engine's handshake as a decode worker takes it: checked once, as it arrives.

The handshake (served by the prefill's scheduler, :meth:`.connector._SchedulerSide.
serve_handshake`, fetched over the authenticated side channel) is a map: ``engine_id``,
``tp_size``, ``kv_heads`` and ``workers``, one card per TP rank with the worker's transfer
``address``, ``pid`` and KV geometry (``regions``). Only engines holding the secret can
serve one, but an engine of another version, or a buggy one, can serve one that does not
fit. Every load the decode plans from it, every abort it sends through it and every
writer's exit it watches reads these fields, so they are checked here, all at once: a
handshake that does not fit is a failed handshake (its loads fail with the reason, in
vLLM's ``finished_recving``), never an exception in the middle of a load's plan.

A writer's pid matters most: the decode takes a local writer's exit as the proof that
none of its writes can land any more (I4), so it must be the pid of the process behind
the transfer address, which the transfer engine wrote into that address itself.
"""

from __future__ import annotations

from typing import Any

from kvferry.transfer import decode_address

from .layout import KVRegions
from .wire import CODEC as WIRE


def _count(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


def handshake_problem(hs: Any) -> str:
    """'' for a handshake the decode can plan from, else what does not fit."""
    if not isinstance(hs, dict):
        return f"the handshake is a {type(hs).__name__}, not a map"
    if not isinstance(hs.get("engine_id"), str):
        return f"engine_id {hs.get('engine_id')!r} is not a string"
    version = hs.get("wire")
    if version != WIRE.version:  # its messages would be dropped one by one as malformed
        spoken = f"{WIRE.protocol} {version!r}" if version is not None else "an older codec"
        return (
            f"its control messages are {spoken}, this engine's {WIRE.protocol} "
            f"{WIRE.version}: run one kvferry version on both sides"
        )
    tp, heads = hs.get("tp_size"), hs.get("kv_heads")
    if not isinstance(tp, int) or not _count(tp, 1):
        return f"tp_size {tp!r} is not a positive integer"
    if not _count(heads, 0):
        return f"kv_heads {heads!r} is not a count"
    workers = hs.get("workers")
    if not isinstance(workers, dict):
        return f"workers is a {type(workers).__name__}, not a map of TP ranks to cards"
    ranks = sorted(workers, key=repr)
    if ranks != list(range(tp)):
        shown = ", ".join(map(repr, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        return f"workers has cards for TP ranks [{shown}]; tp_size {tp} needs 0 to {tp - 1}"
    seen: dict[bytes, int] = {}
    for rank in range(tp):
        card = workers[rank]
        why = _card_problem(card)
        if why:
            return f"prefill worker tp{rank}: {why}"
        address = card["address"]
        if address in seen:
            return f"prefill workers tp{seen[address]} and tp{rank} give one transfer address"
        seen[address] = rank
    return ""


def _card_problem(card: Any) -> str:
    if not isinstance(card, dict):
        return f"its card is a {type(card).__name__}, not a map"
    address = card.get("address")
    if not isinstance(address, bytes) or not address:
        return f"its transfer address is a {type(address).__name__}, not bytes"
    try:
        info = decode_address(address)
    except Exception as exc:  # bytes from another engine: whatever the decoder raises
        return f"its transfer address does not decode: {type(exc).__name__}: {exc}"
    pid = card.get("pid")
    if not _count(pid, 1) or pid != info.pid:
        return f"its pid {pid!r} is not its transfer address's ({info.pid})"
    regions = card.get("regions")
    if not regions:
        return "it gave no KV geometry"
    try:
        KVRegions.from_wire(regions)
    except Exception as exc:  # a geometry of another version: whatever its parse raises
        return f"its KV geometry does not parse: {type(exc).__name__}: {exc}"
    return ""
