"""The handshake side channel: the scheduler process of an engine serves its workers'
transfer-engine addresses over TCP, and a peer's worker fetches them in a thread (the
only thing that thread does: the transfer engine stays on the worker's own thread).

The addresses are what a stranger needs to write into an engine's KV blocks (README,
"Threat model"), so the side channel serves them only to a peer that proves it holds the
engines' secret, and a worker takes them only from a server that proves the same. Both
engines hold the cluster secret (:mod:`kvferry.cluster.trust`); from it HKDF derives two
keys of the side channel's own (labels below), used nowhere else. One exchange per
connection, every read under the connection's deadline:

1. server -> client: ``HELLO || Ns`` (a fresh 16-byte server nonce);
2. client -> server: ``Nc || HMAC-SHA256(k_proof, "client" || Ns || Nc)`` (a fresh client
   nonce and its proof: the server's fresh ``Ns`` makes a recorded proof worthless);
3. server -> client: ``ANSWER || AES-GCM(k_answer, blob, associated="answer" || Ns || Nc)``
   when the proof verifies, else ``REFUSED`` (counted, logged once per peer address).

The client refuses an answer that does not decrypt: a server without the secret cannot
make one, and an answer recorded from another connection was sealed for another ``Nc``.
A client without the secret gets ``REFUSED`` and nothing else; even a server that sent it
the answer would send ciphertext.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvferry.cluster.trust import (
    NONCE_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    Trust,
    TrustError,
    Unauthenticated,
    derive,
    generate_secret,
    secret_from,
)

log = logging.getLogger("kvferry.vllm")
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("<Q")  # a control message's sequence number, before its payload

HELLO = b"kvferry-hs1"  # the protocol and its version: an older server sends no such frame
CHALLENGE_BYTES = 16  # Ns and Nc
PROOF_BYTES = 32  # HMAC-SHA256
ANSWER = b"A"
REFUSED = b"R"
MAX_HELLO_BYTES = 64
MAX_PROOF_BYTES = 64
MAX_ANSWER_BYTES = 16 << 20  # every worker's address and layout, with room to spare
MAX_IN_FLIGHT = 64  # connections a server handles at once; more are refused at once
MAX_IN_FLIGHT_PER_PEER = 8  # of those, from one address (idle strangers lock out no one)
PROOF_TIMEOUT_S = 2.0  # a client's proof (48 bytes, sent at once) must come within this
ACCEPT_BACKOFF_S = 0.1  # after accept() failed (descriptors exhausted, a network error)
_PROOF_LABEL = b"kvferry vllm side channel proof"
_ANSWER_LABEL = b"kvferry vllm side channel answer"
_TICKET_LABEL = b"kvferry vllm load ticket"
_MESSAGE_LABEL = b"kvferry vllm control message"
MESSAGE_TAG_BYTES = 16

NO_SECRET = (
    "kvferry connector: no handshake secret. Give kv_connector_extra_config's "
    f"secret_file (a path), or {SECRET_FILE_ENV} (a path) or {SECRET_ENV} (the secret) in "
    "vLLM's environment, the same on the prefill and the decode engines (`kvferry secret > "
    "FILE` makes one): the side channel serves the workers' transfer addresses only to a "
    "peer that proves it holds that secret"
)


class HandshakeRefused(ConnectionError):
    """A side-channel handshake that did not prove the secret, on either end. The message
    names the peer and the reason, never the secret."""


class HandshakeKey:
    """The connector's keys, derived from the engines' secret: the side channel's two, the
    one that seals load tickets (:mod:`.params`) and the one that tags control messages.
    ``repr`` shows the cluster fingerprint (whether two engines hold the same secret,
    nothing more)."""

    def __init__(self, secret: bytes) -> None:
        self.fingerprint = Trust(secret).fingerprint  # and the secret's length checked
        self._proof_key = derive(secret, _PROOF_LABEL)
        self._answer = AESGCM(derive(secret, _ANSWER_LABEL))
        self.ticket_key = derive(secret, _TICKET_LABEL)
        self._message_key = derive(secret, _MESSAGE_LABEL)

    def __repr__(self) -> str:
        return f"HandshakeKey(fingerprint={self.fingerprint})"

    @classmethod
    def generate(cls) -> HandshakeKey:
        return cls(generate_secret().encode())

    def prove(self, server_nonce: bytes, client_nonce: bytes) -> bytes:
        """The client's proof for one connection's two nonces."""
        return hmac.digest(self._proof_key, b"client" + server_nonce + client_nonce, "sha256")

    def proof_ok(self, server_nonce: bytes, client_nonce: bytes, proof: bytes) -> bool:
        return hmac.compare_digest(self.prove(server_nonce, client_nonce), proof)

    def _message_tag(self, to_incarnation: int, sender: bytes, body: bytes) -> bytes:
        mac = hmac.new(self._message_key, digestmod="sha256")
        mac.update(to_incarnation.to_bytes(8, "little"))
        mac.update(len(sender).to_bytes(4, "little") + sender)
        mac.update(body)
        return mac.digest()[:MESSAGE_TAG_BYTES]

    def seal_message(self, to_incarnation: int, sender: bytes, seq: int, payload: bytes) -> bytes:
        """A control message (PLAN, NOTICE, ABORT, ...) from the engine at transfer address
        ``sender`` to the engine incarnation ``to_incarnation``: the sender's sequence
        number ``seq`` (u64), the payload, and a tag over both (so a recorded message
        delivered again is seen as such: :class:`kvferry.cluster.receive.SeqWindow`)."""
        body = _SEQ.pack(seq) + payload
        return body + self._message_tag(to_incarnation, sender, body)

    def open_message(self, my_incarnation: int, sender: bytes, sealed: bytes) -> tuple[int, bytes]:
        """The sequence number and payload of a message sealed for this engine incarnation
        by the engine at ``sender`` (the envelope's address, which the tag covers: no one
        without the secret can speak as another engine, or at all); Unauthenticated
        otherwise."""
        if len(sealed) < _SEQ.size + MESSAGE_TAG_BYTES:
            raise Unauthenticated(f"a message of {len(sealed)} bytes carries no tag")
        body, tag = sealed[:-MESSAGE_TAG_BYTES], sealed[-MESSAGE_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._message_tag(my_incarnation, sender, body)):
            raise Unauthenticated(
                "its tag does not verify (a sender without this secret, another engine's "
                "address claimed, or a message sealed for another engine or incarnation)"
            )
        (seq,) = _SEQ.unpack_from(body)
        return seq, body[_SEQ.size :]

    def seal(self, payload: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        """The answer for one connection: a fresh AES-GCM nonce, then the ciphertext."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._answer.encrypt(nonce, payload, _associated(server_nonce, client_nonce))

    def open(self, sealed: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        """The answer's payload; Unauthenticated unless it was sealed with this key for
        these two nonces."""
        if len(sealed) < NONCE_BYTES + 16:
            raise Unauthenticated(f"answer of {len(sealed)} bytes: too short")
        try:
            return self._answer.decrypt(
                sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _associated(server_nonce, client_nonce)
            )
        except InvalidTag:
            raise Unauthenticated("the answer does not decrypt") from None


def _associated(server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What an answer is bound to: this connection's nonces (so no other connection's
    answer opens)."""
    return b"answer" + server_nonce + client_nonce


def load_key(
    secret_file: str | None, env: Mapping[str, str] | None = None
) -> tuple[HandshakeKey, str]:
    """The side channel's key and where its secret came from (a path or a variable's name,
    for the log). ``secret_file`` wins over ``KVFERRY_SECRET_FILE``, which wins over
    ``KVFERRY_SECRET``; TrustError without any, or with an unusable one."""
    found = secret_from(secret_file, os.environ if env is None else env)
    if found is None:
        raise TrustError(NO_SECRET)
    data, source, warning = found
    if warning:
        log.warning("kvferry connector: %s", warning)
    try:
        return HandshakeKey(data), source
    except TrustError as exc:
        raise TrustError(f"kvferry connector: handshake secret from {source}: {exc}") from None


# ---------------------------------------------------------------------- framing
def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float, timeout_s: float, peer: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"side channel {peer}: no complete frame within {timeout_s} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 16))
        except TimeoutError:
            raise TimeoutError(
                f"side channel {peer}: no complete frame within {timeout_s} s"
            ) from None
        if not chunk:
            raise ConnectionError(
                f"side channel {peer} closed mid-handshake ({len(buf)} of {n} bytes read)"
            )
        buf += chunk
    return bytes(buf)


def _recv_frame(
    sock: socket.socket, deadline: float, timeout_s: float, limit: int, peer: str
) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, timeout_s, peer))
    if n > limit:
        raise HandshakeRefused(
            f"side channel {peer}: a frame of {n} bytes, over the {limit} expected"
        )
    return _recv_exact(sock, n, deadline, timeout_s, peer)


# ---------------------------------------------------------------------- the server
class SideChannel:
    """Serves one msgpack blob to every client that proves the secret, each connection in
    a thread of its own under a deadline (a silent client holds up no other)."""

    def __init__(
        self,
        host: str,
        port: int,
        blob: dict[str, Any],
        key: HandshakeKey,
        timeout_s: float = 5.0,
    ) -> None:
        self.payload = msgpack.packb(blob, use_bin_type=True)
        self.key = key
        self.timeout_s = timeout_s
        self.served = 0
        self.refusals: dict[str, int] = {}  # peer address -> handshakes refused
        self._cv = threading.Condition()
        self._in_flight = 0
        self._per_peer: dict[str, int] = {}  # peer address -> its connections in flight
        self.accept_errors = 0
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="kvferry-side-channel", daemon=True)
        self.thread.start()
        log.info(
            "kvferry handshake side channel on %s:%d (secret fingerprint %s)",
            self.host,
            self.port,
            key.fingerprint,
        )

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:  # closed (stop), or a failure that may pass (EMFILE)
                if self._stop:
                    return
                self._accept_failed(exc)
                continue
            peer = str(addr[0])
            with self._cv:
                busy = self._in_flight >= MAX_IN_FLIGHT
                crowded = self._per_peer.get(peer, 0) >= MAX_IN_FLIGHT_PER_PEER
                if not (busy or crowded):
                    self._take(peer, +1)
            if busy or crowded:
                conn.close()
                limit = (
                    f"{MAX_IN_FLIGHT} handshakes"
                    if busy
                    else (f"{MAX_IN_FLIGHT_PER_PEER} handshakes from {peer}")
                )
                self._refused(peer, f"over {limit} in flight")
                continue
            try:
                threading.Thread(
                    target=self._handle,
                    args=(conn, peer),
                    name="kvferry-side-channel-conn",
                    daemon=True,
                ).start()
            except RuntimeError as exc:  # no thread to be had: this client is refused
                conn.close()
                with self._cv:
                    self._take(peer, -1)
                self._refused(peer, f"no thread for its handshake: {exc}")

    def _take(self, peer: str, n: int) -> None:
        """Count a connection of ``peer`` in (+1) or out (-1); under ``_cv``."""
        self._in_flight += n
        left = self._per_peer.get(peer, 0) + n
        if left:
            self._per_peer[peer] = left
        else:
            self._per_peer.pop(peer, None)
        self._cv.notify_all()

    def _accept_failed(self, exc: OSError) -> None:
        self.accept_errors += 1
        if self.accept_errors == 1 or self.accept_errors % 1000 == 0:
            log.error(
                "kvferry side channel %s:%d: accept failed (%d so far): %s; retrying",
                self.host,
                self.port,
                self.accept_errors,
                exc,
            )
        time.sleep(ACCEPT_BACKOFF_S)

    def _handle(self, conn: socket.socket, peer: str) -> None:
        where = f"{peer} (a client of {self.host}:{self.port})"
        try:
            with conn:
                conn.settimeout(self.timeout_s)  # each read then takes what is left of it
                deadline = time.monotonic() + self.timeout_s
                server_nonce = os.urandom(CHALLENGE_BYTES)
                _send(conn, HELLO + server_nonce)
                proof_by = min(deadline, time.monotonic() + PROOF_TIMEOUT_S)
                proof_s = min(self.timeout_s, PROOF_TIMEOUT_S)
                frame = _recv_frame(conn, proof_by, proof_s, MAX_PROOF_BYTES, where)
                if len(frame) != CHALLENGE_BYTES + PROOF_BYTES:
                    want = CHALLENGE_BYTES + PROOF_BYTES
                    self._refused(peer, f"a proof frame of {len(frame)} bytes, not {want}")
                    _send(conn, REFUSED)
                    return
                client_nonce, proof = frame[:CHALLENGE_BYTES], frame[CHALLENGE_BYTES:]
                if not self.key.proof_ok(server_nonce, client_nonce, proof):
                    self._refused(peer, "its proof does not verify (no secret, or another one)")
                    _send(conn, REFUSED)
                    return
                _send(conn, ANSWER + self.key.seal(self.payload, server_nonce, client_nonce))
                with self._cv:
                    self.served += 1
        except (OSError, HandshakeRefused) as exc:
            self._refused(peer, f"{type(exc).__name__}: {exc}")
        finally:
            with self._cv:
                self._take(peer, -1)

    def _refused(self, peer: str, reason: str) -> None:
        with self._cv:
            first = peer not in self.refusals
            self.refusals[peer] = self.refusals.get(peer, 0) + 1
        if first:
            log.warning(
                "kvferry side channel %s:%d refused a handshake from %s: %s (further refusals "
                "from %s are counted, not logged)",
                self.host,
                self.port,
                peer,
                reason,
                peer,
            )

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every connection accepted so far is done within ``timeout_s``."""
        with self._cv:
            return self._cv.wait_for(lambda: self._in_flight == 0, timeout_s)

    def close(self) -> None:
        self._stop = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept on Linux
        except OSError:
            pass
        self.sock.close()


# ---------------------------------------------------------------------- the client
def fetch(host: str, port: int, timeout_s: float, key: HandshakeKey) -> dict[str, Any]:
    """The blob of the side channel at ``host:port``, once it proved the secret;
    HandshakeRefused (with the peer and the reason) when either side could not prove it,
    TimeoutError when the whole exchange takes over ``timeout_s``."""
    peer = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        hello = _recv_frame(s, deadline, timeout_s, MAX_HELLO_BYTES, peer)
        if len(hello) != len(HELLO) + CHALLENGE_BYTES or not hello.startswith(HELLO):
            raise HandshakeRefused(
                f"side channel {peer}: its first frame ({len(hello)} bytes) is no kvferry "
                "handshake challenge (a kvferry without the authenticated handshake?); "
                "nothing taken from it"
            )
        server_nonce = hello[len(HELLO) :]
        client_nonce = os.urandom(CHALLENGE_BYTES)
        _send(s, client_nonce + key.prove(server_nonce, client_nonce))
        reply = _recv_frame(s, deadline, timeout_s, MAX_ANSWER_BYTES, peer)
    if reply == REFUSED:
        raise HandshakeRefused(
            f"side channel {peer} refused this engine's proof: the two engines hold "
            f"different secrets (this one's fingerprint is {key.fingerprint})"
        )
    if reply[:1] != ANSWER:
        raise HandshakeRefused(f"side channel {peer}: a reply of {len(reply)} bytes is no answer")
    try:
        payload = key.open(reply[1:], server_nonce, client_nonce)
    except Unauthenticated as exc:
        raise HandshakeRefused(
            f"side channel {peer}: its answer ({len(reply)} bytes) is not sealed with this "
            f"engine's secret for this connection ({exc}): a server without the secret, or a "
            "replayed answer; no address taken"
        ) from None
    out = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(out, dict):
        raise ValueError(f"side channel {peer}: malformed handshake")
    return out


class Fetcher:
    """Fetches handshakes in background threads; results are taken on the worker thread."""

    def __init__(self, timeout_s: float, key: HandshakeKey) -> None:
        self.timeout_s = timeout_s
        self.key = key
        self.refused = 0  # side channels that did not prove the secret, or refused ours
        self.results: queue.Queue[tuple[tuple[str, int], dict[str, Any] | None, str]] = (
            queue.Queue()
        )
        self.asked: set[tuple[str, int]] = set()

    def ask(self, key: tuple[str, int], again: bool = False) -> None:
        """Fetch ``key``'s handshake once (so a refusal is logged once per side channel);
        ``again``: once more, after the last fetch failed."""
        if key in self.asked and not again:
            return
        self.asked.add(key)

        def run() -> None:
            try:
                self.results.put((key, fetch(key[0], key[1], self.timeout_s, self.key), ""))
            except HandshakeRefused as exc:
                self.refused += 1
                log.warning("kvferry handshake refused: %s", exc)
                self.results.put((key, None, f"{type(exc).__name__}: {exc}"))
            except Exception as exc:
                self.results.put((key, None, f"{type(exc).__name__}: {exc}"))

        threading.Thread(target=run, name="kvferry-handshake", daemon=True).start()

    def take(self) -> list[tuple[tuple[str, int], dict[str, Any] | None, str]]:
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out
