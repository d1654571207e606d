"""A connector worker's transfer engine as its protocol uses it: one endpoint per peer
address, and control messages that never raise.

Every message carries a tag under the engines' secret, bound to the sender's transfer
address and the destination's incarnation, over the message and this engine's next
sequence number (:meth:`.sidechannel.HandshakeKey.seal_message`): the address names one
engine incarnation, so the receiver refuses a number of it seen before (a replay).
A message that cannot be posted (the peer closed, its process gone, its shared-memory
segment unlinked while we connected) is logged with its request id and answered None:
the protocol's row goes on, and what the lost message would have proven is proven
otherwise (a retry, the writer's exit) or never; it is never assumed.
"""

from __future__ import annotations

import itertools
import logging

from kvferry.transfer import Batch, Peer, PeerFailedError, TransferEngine, TransferError

from .sidechannel import HandshakeKey

log = logging.getLogger("kvferry.vllm")


class Link:
    """The worker's endpoints to other engines' workers, by transfer address."""

    def __init__(self, engine: TransferEngine, key: HandshakeKey) -> None:
        self.engine = engine
        self.key = key  # every message is tagged for its destination (HandshakeKey)
        self.peers: dict[bytes, Peer] = {}
        self._seq = itertools.count(1)  # every message this engine sends, from 1

    def peer(self, address: bytes) -> Peer:
        """The live endpoint to ``address``, connected now if there is none. Raises
        :class:`TransferError` when it cannot connect (the caller fails its request)."""
        peer = self.peers.get(address)
        if peer is None or not self.engine.peer_alive(peer):
            peer = self.peers[address] = self.engine.connect(address)
            if not self.engine.peer_alive(peer):  # its process was gone already
                raise PeerFailedError(peer.name, peer.failure or "not connected")
        return peer

    def send(self, peer: Peer | None, payload: bytes, rid: str) -> Batch | None:
        """An active message (no flush); None when there is no peer or it failed."""
        return self._message(peer, payload, rid, flushed=False)

    def notify(self, peer: Peer | None, payload: bytes, rid: str) -> Batch | None:
        """Flush every earlier write to ``peer``, then the message; None as :meth:`send`."""
        return self._message(peer, payload, rid, flushed=True)

    def send_to(self, address: bytes, payload: bytes, rid: str) -> Batch | None:
        """Connect to ``address`` if need be, then :meth:`send`."""
        try:
            peer = self.peer(address)
        except TransferError as exc:
            log.warning("request %s: no endpoint for a message: %s", rid, exc)
            return None
        return self.send(peer, payload, rid)

    def sever(self, peer: Peer) -> None:
        """Close ``peer``'s endpoint (forced) and forget it: the next message to its
        address connects again."""
        if self.peers.get(peer.address) is peer:
            del self.peers[peer.address]
        try:
            self.engine.close(peer, force=True)
        except TransferError as exc:
            log.warning("closing the endpoint to %s: %s", peer.name, exc)

    def _message(self, peer: Peer | None, payload: bytes, rid: str, flushed: bool) -> Batch | None:
        if peer is None:
            return None
        sealed = self.key.seal_message(
            peer.info.incarnation, self.engine.address, next(self._seq), payload
        )
        try:
            if flushed:
                return self.engine.notify(peer, sealed)
            return self.engine.send(peer, sealed)
        except TransferError as exc:
            what = "notice" if flushed else "message"
            log.warning("request %s: %s to %s not sent: %s", rid, what, peer.name, exc)
            return None
