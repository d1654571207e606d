"""A prefill worker's staging memory: a batch of rows gathered into registered memory of
its own before it is posted, so that the wire moves one piece wherever the decode's bytes
are contiguous.

Between engines of different shapes a writer's rows are often scattered at the source and
contiguous at the target: a fan-out's share of each token's row (NHD, TP 1 -> 2: 2 KiB of
every 4 KiB), a head's half of a larger block (blocks 32 -> 16). The kernel's cross-memory
copy (and an RDMA NIC, per work request) pays for every piece, so such a batch costs many
times the homogeneous pair's. Gathered first, in the order the bytes land, the batch goes
as the target's pieces; the gather runs in C on a thread of its own with the GIL released
while the batch before it is on the wire, so the two overlap. KV buffers in CUDA memory
are gathered into staging memory on their device
(:func:`~kvferry.transfer.copy_tensor_runs`, on a stream of the staging's own), where the
gather is a device copy at memory speed and what it saves is the NIC's per-work-request
cost (GPUDirect writes of a few KiB each).

A slot is one batch of at most ``slot_bytes``. Its lifetime is the rule that keeps I5: a
slot is taken when its gather starts and given back only once the batch posted from it
has settled (landed, or failed and no longer read by the transport), or, if it was never
posted (an abort between the gather and the post), once the gather has finished. A slot
reused earlier would put one batch's bytes under another's write; the owner's checksums
would see it, but the rule means they never need to.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvferry.engine.reshard import coalesce
from kvferry.transfer import Segment, TransferEngine, copy_runs, copy_tensor_runs

STAGE_WHEN_PIECES = 2  # stage a batch whose source pieces are at least this many per target piece
# ... and whose target pieces are this large on average: where they are small (writers'
# heads interleaved in each token's row), they cost what the copy costs, gathered or not,
# and the gather only adds its pass (HND TP 4 -> NHD TP 1, blocks 16 -> 64: 1 KiB pieces,
# 0.30 of the homogeneous pair as the rows lie, 0.23-0.30 gathered)
STAGE_MIN_TARGET_PIECE = 4096


def pieces(offsets: np.ndarray, lengths: np.ndarray) -> int:
    """How many pieces runs at ``offsets`` (in their order) make once neighbours that
    follow each other are joined."""
    if not len(offsets):
        return 0
    return 1 + int(np.count_nonzero(offsets[1:] != offsets[:-1] + lengths[:-1]))


def worth_staging(triples: np.ndarray) -> bool:
    """Whether a batch of ``(local, remote, length)`` runs is scattered at the source
    where the target joins it: its source pieces (in the order the bytes land) at least
    :data:`STAGE_WHEN_PIECES` times its target's, and those of
    :data:`STAGE_MIN_TARGET_PIECE` bytes or more on average."""
    by = np.argsort(triples[:, 1], kind="stable")
    t = triples[by]
    target = pieces(t[:, 1], t[:, 2])
    return (
        pieces(t[:, 0], t[:, 2]) >= STAGE_WHEN_PIECES * target
        and int(t[:, 2].sum()) >= STAGE_MIN_TARGET_PIECE * target
    )


@dataclass
class Staged:
    """One gathered batch: its slot, the runs to post from the staging segment
    (``[n, 3]``: staging offset, remote offset, length; neighbours joined) and the gather
    (done once ``ready`` has a result)."""

    slot: int
    runs: np.ndarray
    ready: Future[int]


class Staging:
    """``slots`` batches of ``slot_bytes`` each on ``device`` (host memory, or the CUDA
    device the KV buffers are on), registered with ``engine``, and the thread that
    gathers into them. ``gather``: ``"native"`` (host memory only: the native copy,
    :func:`kvferry.transfer.copy_runs`) or ``"torch"``
    (:func:`kvferry.transfer.copy_tensor_runs` from the tensor a segment registers; on a
    CUDA device on a stream of the staging's own, which the thread waits for, so a batch
    is ready once its future is). Device memory is always gathered by torch."""

    def __init__(
        self,
        engine: TransferEngine,
        slot_bytes: int,
        slots: int,
        device: torch.device | str = "cpu",
        gather: str = "native",
    ) -> None:
        if slot_bytes <= 0 or slots <= 0:
            raise ValueError(f"staging of {slots} slots of {slot_bytes} bytes")
        if gather not in ("native", "torch"):
            raise ValueError(f"staging gathers 'native' or 'torch', not {gather!r}")
        self.slot_bytes = slot_bytes
        self.memory = torch.empty(slot_bytes * slots, dtype=torch.uint8, device=device)
        self.by_torch = gather == "torch" or self.memory.is_cuda
        self.engine = engine
        self.segment: Segment = engine.register(self.memory)
        self.free = list(range(slots))
        self.gather = ThreadPoolExecutor(1, thread_name_prefix="kvferry-gather")
        self.stream = torch.cuda.Stream(self.memory.device) if self.memory.is_cuda else None

    def fits(self, triples: np.ndarray) -> bool:
        """Whether a batch fits one slot (a run longer than a batch goes alone, as it
        lies)."""
        return int(triples[:, 2].sum()) <= self.slot_bytes

    def stage(self, src: Segment, triples: np.ndarray) -> Staged | None:
        """Start gathering ``triples`` (runs from ``src``) into a free slot, laid out in
        the order the bytes land; None when no slot is free (one is, once a staged batch
        settles: :meth:`release`)."""
        if not self.fits(triples):
            raise ValueError(
                f"a batch of {int(triples[:, 2].sum())} bytes does not fit a staging slot "
                f"of {self.slot_bytes}"
            )
        if not self.free:
            return None
        slot = self.free.pop()
        t = triples[np.argsort(triples[:, 1], kind="stable")]
        at = slot * self.slot_bytes + np.cumsum(t[:, 2]) - t[:, 2]
        gather = np.stack([t[:, 0], at, t[:, 2]], axis=1)
        joined = coalesce(np.stack([at, t[:, 1], t[:, 2]], axis=1))
        if self.by_torch:
            ready = self.gather.submit(self._gather_by_torch, src, gather)
        else:
            ready = self.gather.submit(copy_runs, self.segment, src, gather)
        return Staged(slot, joined, ready)

    def _gather_by_torch(self, src: Segment, runs: np.ndarray) -> int:
        """:func:`~kvferry.transfer.copy_tensor_runs` from the tensor ``src`` registers.
        On a CUDA device, on the staging's stream once the device's default stream (where
        the KV was written) is done with what it was given before; returns once the
        gather finished."""
        source = src.owner
        if (
            not isinstance(source, torch.Tensor)
            or source.device != self.memory.device
            or not source.is_contiguous()
        ):
            where = getattr(source, "device", "no device")
            raise TypeError(
                f"staging on {self.memory.device} gathers from a contiguous torch tensor "
                f"there; the segment holds {type(source).__name__} on {where}"
            )
        flat = source.reshape(-1).view(torch.uint8)
        if self.stream is None:
            return copy_tensor_runs(self.memory, flat, runs)
        self.stream.wait_stream(torch.cuda.default_stream(self.memory.device))
        with torch.cuda.stream(self.stream):
            n = copy_tensor_runs(self.memory, flat, runs)
        self.stream.synchronize()
        return n

    def release(self, staged: Staged) -> None:
        """Give ``staged``'s slot back: after the batch posted from it settled, or, never
        posted, once its gather is done (waited for here)."""
        staged.ready.exception()  # waits; a gather that failed read nothing more either
        self.free.append(staged.slot)

    def close(self) -> None:
        self.gather.shutdown(wait=True)
        self.engine.deregister(self.segment)
