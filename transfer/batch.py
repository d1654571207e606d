"""A batch of posted operations (page puts, gets, a flush, a notice) and its status.

A :class:`Batch` is a record: the engine that posted it fills in its outcome. The engine
evaluates batches, as UCX (``ucp_request_check_status`` / ``ucp_worker_progress``) and
Mooncake do:

- ``engine.poll(batch)``: the status now, from the native completion tracker; never
  blocks, drives no progress, touches no endpoint;
- ``engine.wait(batch, timeout_s)``: drives progress until the batch settles or the
  deadline passes, and returns its final status (TIMED_OUT with a
  :class:`DeadlineExceeded` in ``batch.error`` at the deadline).

The methods here are thin accessors over those: ``peek()`` is ``engine.poll(batch)``,
``status()`` is ``engine.progress(0)`` then ``engine.poll(batch)``, and ``wait()`` is
``engine.wait`` raising ``batch.error``.

``wait(timeout_s)`` takes a *relative* timeout in seconds (or ``deadline=``, an absolute
``time.monotonic()`` value). Every wait is bounded: it returns, or raises
:class:`PeerFailedError` naming the peer, :class:`DeadlineExceeded`, or a named
:class:`UcxError`. A timed-out batch stays TIMED_OUT even if its requests finish later:
UCX cannot cancel a posted put, so the bytes may still land. Severing the peer
(``engine.close(peer, force=True)``) does not stop them either: UCX over tcp delivers what
it had queued after the close. Proof that nothing more lands is a completed flush, or
the writer's process gone (I4); a peer closed with writes not flushed is unflushable, and
the engine refuses any later notice to it (:class:`UnflushableError`).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from .errors import TransferError

if TYPE_CHECKING:
    from .engine import TransferEngine
    from .peer import Peer


class BatchStatus(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class Batch:
    """Handle of one submitted batch. ``op`` is write, read, write+notify, quiesce, notify
    or send.

    Filled by the engine: ``final`` (None while pending, then the settled status, which
    never changes again), ``error`` (the exception of a FAILED or TIMED_OUT batch) and
    ``finished_at``. ``native`` is the ``kvf_batch_t`` the native layer completes; it
    belongs to the engine."""

    def __init__(
        self, engine: TransferEngine, peer: Peer, op: str, nbytes: int, npages: int, native: Any
    ):
        self.engine = engine
        self.peer = peer
        self.op = op
        self.nbytes = nbytes
        self.npages = npages
        self.posted_at = time.monotonic()
        self.finished_at: float | None = None
        self.native: Any = native  # kvf_batch_t * (a cffi pointer)
        self.final: BatchStatus | None = None
        self.error: TransferError | None = None

    def __repr__(self) -> str:
        return (
            f"Batch(op={self.op}, peer={self.peer.name!r}, pages={self.npages}, "
            f"bytes={self.nbytes}, status={self.final or 'pending'})"
        )

    def done(self) -> bool:
        return self.status() is not BatchStatus.PENDING

    def status(self) -> BatchStatus:
        """Progress the engine once (non-blocking) and report the batch's status:
        ``engine.progress(0)`` (while pending) then ``engine.poll(self)``."""
        if self.final is None:
            self.engine.progress(0)
        return self.engine.poll(self)

    def reading(self) -> bool:
        """Whether operations of it may still read or write its local memory: a FAILED
        batch's can (``engine.reading(self)``); its memory is reused only once this is
        False."""
        return self.engine.reading(self)

    def peek(self) -> BatchStatus:
        """The batch's status as of the engine's last progress: ``engine.poll(self)``
        (does not drive the engine, never blocks)."""
        return self.engine.poll(self)

    def wait(self, timeout_s: float | None = None, *, deadline: float | None = None) -> Batch:
        """Block until done or until the deadline (default: the engine's
        ``config.default_timeout_s``): ``engine.wait(self, ...)``. Returns self on
        completion; raises ``error`` otherwise."""
        self.engine.wait(self, timeout_s, deadline=deadline)
        if self.error is not None:
            raise self.error
        return self
