"""A batch of posted operations (page puts, gets, a flush, a notice) and its status.

``Batch.wait(timeout_s)`` takes a *relative* timeout in seconds (or ``deadline=``, an
absolute ``time.monotonic()`` value). Every wait is bounded: it returns, or raises
:class:`PeerFailedError` naming the peer, :class:`DeadlineExceeded`, or a named
:class:`UcxError`. A timed-out batch stays TIMED_OUT even if its requests finish later:
UCX cannot cancel a posted put, so the bytes may still land; a caller that needs proof
that nothing more lands severs the peer (``engine.close(peer, force=True)``) (I4).
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from .errors import (PEER_FAILURE_STATUSES, DeadlineExceeded, PeerFailedError,
                     TransferError, status_name, ucx_error)

if TYPE_CHECKING:
    from .engine import Peer, TransferEngine


class BatchStatus(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


class Batch:
    """Handle of one submitted batch. ``op`` is write, read, quiesce, notify or send."""

    def __init__(self, engine: "TransferEngine", peer: "Peer", op: str, nbytes: int,
                 npages: int, handle: Any):
        self.engine = engine
        self.peer = peer
        self.op = op
        self.nbytes = nbytes
        self.npages = npages
        self.posted_at = time.monotonic()
        self.finished_at: float | None = None
        self._handle = handle
        self._final: BatchStatus | None = None
        self._error: TransferError | None = None

    def __repr__(self) -> str:
        return (f"Batch(op={self.op}, peer={self.peer.name!r}, pages={self.npages}, "
                f"bytes={self.nbytes}, status={self._final or 'pending'})")

    @property
    def error(self) -> TransferError | None:
        return self._error

    def done(self) -> bool:
        return self.status() is not BatchStatus.PENDING

    def status(self) -> BatchStatus:
        """Progress the engine once (non-blocking) and report the batch's status."""
        if self._final is None:
            self.engine.progress(0)
        return self.peek()

    def peek(self) -> BatchStatus:
        """The batch's status as of the engine's last progress (does not drive it)."""
        if self._final is None:
            self._evaluate()
        return self._final or BatchStatus.PENDING

    def wait(self, timeout_s: float | None = None, *, deadline: float | None = None) -> "Batch":
        """Block until done or until the deadline (default: the engine's
        ``config.default_timeout_s``). Returns self on completion; raises otherwise."""
        if deadline is None:
            deadline = time.monotonic() + (self.engine.config.default_timeout_s
                                           if timeout_s is None else timeout_s)
        step = self.engine.config.liveness_interval_s
        while True:
            if self._final is None:
                self._evaluate()
            if self._final is not None:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._settle(BatchStatus.TIMED_OUT, DeadlineExceeded(
                    f"{self.op} batch of {self.npages} pages", time.monotonic() - self.posted_at,
                    peer=self.peer.name))
                break
            self.engine.progress(min(remaining, step))
        if self._error is not None:
            raise self._error
        return self

    def _evaluate(self) -> None:
        h = self._handle
        if h.status != 0:
            status = int(h.status)
            if status in PEER_FAILURE_STATUSES:
                err: TransferError = PeerFailedError(
                    self.peer.name, f"{self.op} failed with {status_name(status)}", status)
                self.engine._mark_peer_failed(self.peer, err.reason)
            else:
                err = ucx_error(status, f"{self.op} batch", peer=self.peer.name)
            self._settle(BatchStatus.FAILED, err)
        elif h.outstanding == 0:
            self._settle(BatchStatus.COMPLETED, None)
        elif not self.engine._peer_alive(self.peer):
            self._settle(BatchStatus.FAILED, PeerFailedError(
                self.peer.name, self.peer.failure or "peer is gone"))

    def _settle(self, status: BatchStatus, error: TransferError | None) -> None:
        if self._final is not None:
            return
        self._final = status
        self._error = error
        self.finished_at = time.monotonic()
        self.engine._batch_settled(self)
