"""Which control messages a rank acts on: the one receive filter the rank runtime and the
simulator's runtime both apply, after decoding and before any handler.

A message is refused when it comes from an incarnation of its sender that is not the
current one (a restarted rank's old self, or one this rank never met), or from a
severed sender, except an ABORT_ACK: a severed writer's late ack still counts, since it
follows that writer's flush and is the proof its owner waits for. Duplicates are each
runtime's own (a window of sequence numbers in the service; the simulated network says
which messages it doubled).
"""

from __future__ import annotations

import enum

from kvferry.engine.protocol.words import Kind


class Refusal(enum.StrEnum):
    """Why a message was dropped unread (each is counted: ``dropped_<value>``)."""

    STALE = "stale"
    SEVERED = "severed"


def refusal(kind: str, inc: int, current_inc: int | None, severed: bool) -> Refusal | None:
    """Why a ``kind`` message from incarnation ``inc`` of a sender whose current
    incarnation is ``current_inc`` (None: unknown) and that is ``severed`` or not, is
    refused; None when it is acted on."""
    if current_inc is None or inc != current_inc:
        return Refusal.STALE
    if severed and kind != Kind.ABORT_ACK:
        return Refusal.SEVERED
    return None
