"""How many pages a writer posts at once, sized from the transfer it actually gets.

A writer posts one batch at a time, so an aborted writer waits for at most one batch before
it acks, and that batch must land well inside the owner's abort deadline. How long a batch
takes depends on the transport in use: a shared-memory copy moves gigabytes a second, tcp
on loopback a few hundred megabytes, and a loaded owner (decoding many streams, progressing
its worker between steps) less. So the writer measures each batch it posts to an owner
(bytes over the time from posting to completion, which includes the owner's progress) and
sizes the next one to take ``target_s``, never more than ``max_bytes`` (the bound from the
host's copy bandwidth, logged at start-up) and never less than ``min_bytes``. The first
batch to a new owner is ``min_bytes``: small enough for any transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_BATCH_BYTES = 4 << 20
SMOOTHING = 0.5  # weight of the newest measurement


@dataclass
class BatchSizer:
    target_s: float
    max_bytes: int
    min_bytes: int = MIN_BATCH_BYTES
    rate: dict[int, float] = field(default_factory=dict)  # owner -> bytes per second

    def batch_bytes(self, owner: int) -> int:
        """Bytes the next batch to ``owner`` may carry."""
        rate = self.rate.get(owner)
        if rate is None:
            return min(self.max_bytes, self.min_bytes)
        return int(min(self.max_bytes, max(self.min_bytes, rate * self.target_s)))

    def settled(self, owner: int, nbytes: int, seconds: float) -> None:
        """A batch of ``nbytes`` to ``owner`` completed ``seconds`` after it was posted."""
        if nbytes < self.min_bytes // 4 or seconds <= 0:
            return  # too small to say anything about the link
        measured = nbytes / seconds
        old = self.rate.get(owner)
        self.rate[owner] = measured if old is None else SMOOTHING * measured + (1 - SMOOTHING) * old
