"""Which control messages a rank acts on: the one receive filter the rank runtime and the
simulator's runtime both apply, after decoding and before any handler.

A message is refused when it comes from an incarnation of its sender that is not the
current one (a restarted rank's old self, or one this rank never met), or from a
severed sender, except an ABORT_ACK: a severed writer's late ack still counts, since it
follows that writer's flush and is the proof its owner waits for. Duplicates and replays
are refused by a :class:`SeqWindow` of each sender's sequence numbers (the service's ranks
and the vLLM connector's workers; the simulated network says which messages it doubled).
"""

from __future__ import annotations

import enum
from collections import OrderedDict

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


DEDUP_WINDOW = 4096  # sequence numbers of one sender remembered one by one


class SeqWindow:
    """The sequence numbers one sender's messages carried (under their MAC), so that none
    is taken twice: the last ``size`` seen, each remembered, and below them a floor per
    sender incarnation (the highest number evicted) at or under which every number counts
    as seen. A message out of order within the window is taken; a replay, inside the
    window or older than it, is not. Numbers start at 1 in each incarnation."""

    __slots__ = ("_floor", "_seen", "size")

    def __init__(self, size: int = DEDUP_WINDOW) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._floor: dict[int, int] = {}  # incarnation -> highest number evicted

    def floor(self, inc: int) -> int:
        """Every number of incarnation ``inc`` at or below this counts as seen."""
        return self._floor.get(inc, 0)

    def take(self, inc: int, seq: int) -> bool:
        """Whether ``seq`` of incarnation ``inc`` is new (and now remembered); False for
        one seen already or at or below the floor."""
        key = (inc, seq)
        if key in self._seen or seq <= self._floor.get(inc, 0):
            return False
        self._seen[key] = None
        if len(self._seen) > self.size:
            (old_inc, old_seq), _ = self._seen.popitem(last=False)
            if old_seq > self._floor.get(old_inc, 0):
                self._floor[old_inc] = old_seq
        return True
