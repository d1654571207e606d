"""The engine's peers and their liveness: endpoints by address, a peer's process watched
on this host (its pidfd), a failed peer marked and severed, an endpoint closed.

One job: know which peers can still be written to. A peer whose batches failed with a
peer-failure status is queued in ``failed`` by the engine's poll (which touches no
endpoint) and severed here on the next progress or post.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable
from typing import Any

from . import _native as native
from . import ucxinfo
from ._native import ffi, lib
from .errors import ucx_error
from .peer import Peer, PeerState
from .protocol import AddressInfo, decode_address

log = logging.getLogger("kvferry.transfer")

__all__ = ["PeerTable"]


def _check(status: int, what: str, peer: str | None = None) -> None:
    if status != 0:
        raise ucx_error(status, what, peer)


class PeerTable:
    """The peers of one engine, by the address each was connected with."""

    def __init__(
        self,
        worker: Any,
        config: Any,
        counters: Any,
        me: AddressInfo,
        require_open: Callable[[], None],
        progress: Callable[[float], int],
    ) -> None:
        self._worker = worker
        self.config = config
        self.counters = counters
        self._me = me  # this engine's own address, for which peers share its host
        self._require_open = require_open
        self._progress = progress
        self.by_address: dict[bytes, Peer] = {}
        # Peers whose batches failed with a peer-failure status, seen by poll(): marked
        # failed and severed in the progress path (poll itself touches no endpoint).
        self.failed: list[tuple[Peer, str]] = []
        # Remote engines (by address) to which an endpoint was closed or failed while
        # writes posted through it were not flushed: they may still land, so no notice
        # to that engine (on any endpoint) can claim to follow them. Never cleared: a
        # restarted engine has another address.
        self.unflushable: dict[bytes, str] = {}
        self._next_liveness_check = 0.0

    def connect(self, peer_address: bytes, name: str = "") -> Peer:
        """Endpoint to the engine at ``peer_address`` (its :attr:`address`). Connecting
        twice to the same live address returns the same peer."""
        self._require_open()
        existing = self.by_address.get(peer_address)
        if existing is not None and existing.state is PeerState.CONNECTED:
            return existing
        info = decode_address(peer_address)
        name = name or info.name
        ep = ffi.new("kvf_ep_h *")
        _check(lib.kvf_ep_create(self._worker, info.ucx, ep), "connecting", name)
        peer = Peer(name=name, address=peer_address, info=info, ep=ep[0])
        # A peer on this host, this process included (engines side by side in one
        # process): its pidfd watches it and guards the cross-memory copy.
        if info.same_host(self._me):
            try:
                peer.pidfd = os.pidfd_open(info.pid)
            except (OSError, AttributeError):
                peer.pidfd = None
                if not self._pid_exists(info.pid):
                    peer.state, peer.failure = PeerState.FAILED, f"process {info.pid} is gone"
        peer.transports, peer.transports_from = ucxinfo.endpoint_transports(peer.ep)
        self.by_address[peer_address] = peer
        log.info(
            "connected to %s (incarnation %#x) over %s",
            name,
            info.incarnation,
            peer.transports or "?",
        )
        return peer

    @staticmethod
    def _pid_exists(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def alive(self, peer: Peer, force: bool = False) -> bool:
        if peer.state is not PeerState.CONNECTED:
            return False
        if peer.pidfd is None:
            return True
        now = time.monotonic()
        if not force and now - peer.last_liveness_check < self.config.liveness_interval_s:
            return True
        peer.last_liveness_check = now
        readable, _, _ = select.select([peer.pidfd], [], [], 0)
        if readable:
            self.mark_failed(peer, f"process {peer.info.pid} exited")
            return False
        return True

    def mark_failed(self, peer: Peer, reason: str) -> None:
        """Record the failure and sever the endpoint: pending requests complete with
        UCS_ERR_CANCELED and nothing more is posted to this peer."""
        if peer.state is not PeerState.CONNECTED:
            return
        self._note_unflushed(peer, f"failed ({reason})")
        peer.state, peer.failure = PeerState.FAILED, reason
        self.counters.peers_failed += 1
        log.warning("peer %s failed: %s; severing its endpoint", peer.name, reason)
        self.release_rkeys(peer)
        lib.kvf_ep_close(
            self._worker,
            peer.ep,
            native.EP_CLOSE_FLAG_FORCE,
            int(self.config.close_timeout_s * 1000),
        )
        if peer.pidfd is not None:  # a failed peer is replaced at the next connect
            os.close(peer.pidfd)
            peer.pidfd = None

    def _note_unflushed(self, peer: Peer, how: str) -> None:
        """Before ``peer``'s endpoint goes: if writes posted through it are not known
        flushed (a batch of puts or a notice's flush still outstanding, or ended in an
        error), the remote engine becomes unflushable (:attr:`unflushable`)."""
        pending = sum(1 for h in peer.unflushed if h.outstanding != 0 or h.status != 0)
        if not pending or peer.address in self.unflushable:
            return
        self.unflushable[peer.address] = (
            f"{pending} batch(es) of writes to it were not flushed when its endpoint "
            f"{how}; they may still land, and a flush on another endpoint does not wait "
            f"for them"
        )
        self.counters.unflushable_peers += 1
        log.warning(
            "peer %s (incarnation %#x): its endpoint %s with %d batch(es) of writes not "
            "flushed; no notice to it is sent from now on (it would not follow them)",
            peer.name,
            peer.info.incarnation,
            how,
            pending,
        )

    @staticmethod
    def release_rkeys(peer: Peer) -> None:
        for rkey in peer.rkeys:
            lib.kvf_rkey_destroy(rkey)
        peer.rkeys.clear()

    def peer_alive(self, peer: Peer) -> bool:
        """False once the peer failed or was closed (checks its process if local)."""
        if self.failed:
            self.sever_failed()
        return self.alive(peer, force=True)

    def sever_failed(self) -> None:
        """Mark failed (and sever) the peers whose batches :meth:`poll` found failed with
        a peer-failure status."""
        failed, self.failed = self.failed, []
        for peer, reason in failed:
            self.mark_failed(peer, reason)

    def watch(self) -> None:
        """Every ``liveness_interval_s``: the process of each local peer with unsettled
        batches (its pidfd); one that exited is marked failed and severed, so those
        batches fail instead of waiting for their deadline."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + self.config.liveness_interval_s
        for peer in list(self.by_address.values()):
            if peer.unsettled and peer.pidfd is not None:
                self.alive(peer, force=True)

    def close(self, peer: Peer, force: bool = False) -> None:
        """Close the endpoint. ``force=True`` severs it without flushing: this side stops
        waiting for its requests, but it is no proof that nothing more lands (UCX over tcp
        delivers what it had queued, after the close), so writes not flushed by then make
        the remote engine unflushable (:attr:`unflushable`)."""
        if peer.state is PeerState.CLOSED:
            return
        was_connected = peer.state is PeerState.CONNECTED
        peer.state = PeerState.CLOSED
        peer.failure = peer.failure or ("severed" if force else "closed")
        self.release_rkeys(peer)
        if was_connected:
            st = lib.kvf_ep_close(
                self._worker,
                peer.ep,
                native.EP_CLOSE_FLAG_FORCE if force else 0,
                int(self.config.close_timeout_s * 1000),
            )
            if st != 0 and not force:
                lib.kvf_ep_close(
                    self._worker,
                    peer.ep,
                    native.EP_CLOSE_FLAG_FORCE,
                    int(self.config.close_timeout_s * 1000),
                )
            # after the close: a graceful one that flushed leaves nothing pending
            self._note_unflushed(peer, "was force-closed" if force or st != 0 else "was closed")
        if peer.pidfd is not None:
            os.close(peer.pidfd)
            peer.pidfd = None
        if self.by_address.get(peer.address) is peer:
            del self.by_address[peer.address]
        self._progress(0)
