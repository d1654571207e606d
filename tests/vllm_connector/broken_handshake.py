"""A deliberately broken connector for the wrong-secret case's broken mode: its side
channel is what it was before the handshake was authenticated (the blob served to any
client, in the clear; any answer taken), and control messages carry no tag. Loaded by
module path in both engines; the key of each connector instance is switched, and the
decode, a stranger's, checks no ticket (stranger.py); nothing else in the process."""

from typing import Any

from stranger import take_tickets_unchecked

from kvferry.cluster.vllm.connector import KvferryConnector as _Base
from kvferry.cluster.vllm.sidechannel import HandshakeKey


class _OpenKey(HandshakeKey):
    def proof_ok(self, server_nonce: bytes, client_nonce: bytes, proof: bytes) -> bool:
        return True

    def seal(self, payload: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return payload

    def open(self, sealed: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return sealed

    def seal_message(self, to_incarnation: int, sender: bytes, seq: int, payload: bytes) -> bytes:
        return seq.to_bytes(8, "little") + payload

    def open_message(self, my_incarnation: int, sender: bytes, sealed: bytes) -> tuple[int, bytes]:
        return int.from_bytes(sealed[:8], "little"), sealed[8:]


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings.key.__class__ = _OpenKey  # the Fetcher's and the SideChannel's key
        take_tickets_unchecked(self)
