"""The cluster secret and what it proves: who may speak on the control plane and write the
rendezvous store.

Every rank of one cluster holds the same secret (``--secret-file``, ``KVFERRY_SECRET_FILE``
or ``KVFERRY_SECRET``; never logged, never in a card). From it, HKDF-SHA256 derives one key
per use, each under its own label, so no key serves two purposes:

- **control messages**: every message leaves as ``encoded || HMAC-SHA256(k_dst, encoded)``,
  where ``k_dst`` is the message key bound to the destination's rank and incarnation. The
  encoded message already holds the sender's rank, incarnation and sequence number, so the
  tag covers them with the payload; binding the destination means a message recorded on
  its way to one rank (or one incarnation of it) is refused by every other. The receiver
  checks the tag before it decodes anything; the existing sequence and incarnation checks
  then refuse a replay of a message it already took.
- **rank cards** in the store: the transfer-engine address and the pool's segment
  descriptor (with its memory keys) are encrypted with AES-GCM, the whole card is MAC'd
  with its store key, so a store reader learns nothing usable and a card written without
  the secret is refused.
- **exit records** and **start-up failure records** in the store: MAC'd, so a stranger
  cannot fence a live rank (an exit record is proof that a writer is gone) or stop a
  cluster's start.

One MAC per message: keyed BLAKE3 (its keyed-hash mode, made to be a MAC: no HMAC
construction around it), truncated to a 16-byte tag. The key of each (destination,
incarnation) is derived once and kept as a keyed hasher that each message copies. A small
control message costs about 0.6 µs, as keyed BLAKE2b did (1.9 µs for a copied HMAC-SHA256
object), and a long prompt's 2 MiB PREFILL chunk 0.3 ms against 2.2 ms with BLAKE2b and
1.1 ms with HMAC-SHA256 over this CPU's SHA extensions, on this project's CI machine. Both
the router's tag and the writer's check stand before the prefill can start (as a
million-token NOTICE's stand before its first token). Store records and cards, written rarely,
keep HMAC-SHA256. Tags are compared with ``hmac.compare_digest``.

What this does not protect (README, "Threat model"): the data plane. UCX's tcp and
shared-memory transports apply a put from any peer that has the target's address and
segment; RDMA memory keys are checked by the NIC but are bearer capabilities. The
encryption of cards keeps those out of the store; the network must keep strangers off the
cluster's interfaces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
from collections.abc import Callable, Mapping
from typing import Any

from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "KVFERRY_SECRET"
SECRET_FILE_ENV = "KVFERRY_SECRET_FILE"
SECRET_VARIABLES = (SECRET_ENV, SECRET_FILE_ENV)
MIN_SECRET_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256: store records and cards
MESSAGE_TAG_BYTES = 16  # keyed BLAKE3: control messages
NONCE_BYTES = 12  # AES-GCM
_SALT = b"kvferry cluster secret v1"
_DST = struct.Struct("<qQ")  # destination rank, destination incarnation


class TrustError(ValueError):
    """No usable cluster secret (missing, too short, unreadable). The message never holds
    the secret."""


class Unauthenticated(ValueError):
    """A tag that does not verify, or a sealed field that does not decrypt."""


def derive(secret: bytes, label: bytes, length: int = 32) -> bytes:
    """A key of ``length`` bytes for one purpose (``label``) from the cluster secret (HKDF
    over SHA-256 with kvferry's salt): each use has its own key, so a tag or a seal made
    for one purpose (a control message, the vLLM side channel's proof) is never accepted
    for another. The one derivation every holder of the secret uses."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_SALT, info=label).derive(secret)


def _derive(secret: bytes, label: bytes, length: int = 32) -> bytes:
    """This module's keys (:class:`Trust`), by :func:`derive`."""
    return derive(secret, label, length)


class Trust:
    """The keys of one cluster, derived from its secret. ``repr`` shows a fingerprint (a
    separate derivation: it says whether two ranks hold the same secret, nothing more)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise TrustError(
                f"the cluster secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
                "needed (`kvferry secret > FILE` makes one)"
            )
        self._message_key = _derive(secret, b"kvferry control message")
        self._card_mac_key = _derive(secret, b"kvferry rank card mac")
        self._card_aead = AESGCM(_derive(secret, b"kvferry rank card aead"))
        self._record_key = _derive(secret, b"kvferry store record mac")
        self.fingerprint = _derive(secret, b"kvferry fingerprint", 8).hex()
        self._sealers: dict[tuple[int, int], Any] = {}

    def __repr__(self) -> str:
        return f"Trust(fingerprint={self.fingerprint})"

    @classmethod
    def generate(cls) -> Trust:
        """A fresh random secret's keys (a cluster of one process, or a test)."""
        return cls(generate_secret().encode())

    # -------------------------------------------------------------- control messages
    def _keyed(self, dst: int, dst_incarnation: int) -> Any:
        """The BLAKE3 hasher keyed for one destination incarnation (its key derived from
        the message key, once, then kept), for each message to copy."""
        keyed = self._sealers.get((dst, dst_incarnation))
        if keyed is None:
            key = hmac.digest(
                self._message_key, _DST.pack(dst, dst_incarnation & (2**64 - 1)), "sha256"
            )
            keyed = blake3(key=key)
            if len(self._sealers) > 4096:
                self._sealers.clear()
            self._sealers[(dst, dst_incarnation)] = keyed
        return keyed

    def seal(self, dst: int, dst_incarnation: int, data: bytes) -> bytes:
        """``data`` with its tag for rank ``dst`` in ``dst_incarnation``."""
        h = self._keyed(dst, dst_incarnation).copy()
        h.update(data)
        return data + h.digest(MESSAGE_TAG_BYTES)

    def opener(self, dst: int, dst_incarnation: int) -> Callable[[bytes], bytes | None]:
        """For the receiver ``dst`` in ``dst_incarnation``: a function from a payload to
        its message bytes, or None when the tag is missing or does not verify."""
        keyed, equal = self._keyed(dst, dst_incarnation), hmac.compare_digest

        def open_(payload: bytes) -> bytes | None:
            if len(payload) <= MESSAGE_TAG_BYTES:
                return None
            body = payload[:-MESSAGE_TAG_BYTES]  # the decoder copies a view anyway
            h = keyed.copy()
            h.update(body)
            if not equal(h.digest(MESSAGE_TAG_BYTES), payload[-MESSAGE_TAG_BYTES:]):
                return None
            return body

        return open_

    # -------------------------------------------------------------- store records
    def record_tag(self, key: str, data: bytes) -> bytes:
        """The MAC of a store record (an exit record, a failure) under its store key."""
        return hmac.digest(self._record_key, _framed(key.encode(), data), "sha256")

    def sign_record(self, key: str, data: bytes) -> bytes:
        return data + self.record_tag(key, data)

    def open_record(self, key: str, value: bytes) -> bytes:
        """The record's bytes; Unauthenticated when its tag is missing or wrong."""
        if len(value) < TAG_BYTES:
            raise Unauthenticated(f"{key}: no tag")
        data, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
        if not hmac.compare_digest(self.record_tag(key, data), tag):
            raise Unauthenticated(f"{key}: the tag does not verify")
        return data

    # -------------------------------------------------------------- rank cards
    def card_tag(self, key: str, body: bytes) -> bytes:
        return hmac.digest(self._card_mac_key, _framed(key.encode(), body), "sha256")

    def encrypt(self, plaintext: bytes, associated: bytes) -> bytes:
        """AES-GCM: a fresh random nonce, then the ciphertext and its tag."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._card_aead.encrypt(nonce, plaintext, associated)

    def decrypt(self, sealed: bytes, associated: bytes) -> bytes:
        if len(sealed) < NONCE_BYTES + 16:
            raise Unauthenticated("sealed field too short")
        try:
            return self._card_aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
        except InvalidTag:
            raise Unauthenticated("sealed field does not decrypt") from None


def _framed(key: bytes, data: bytes) -> bytes:
    return struct.pack("<I", len(key)) + key + data


def generate_secret() -> str:
    """A new cluster secret: 32 random bytes as 64 hex digits (one line of text)."""
    return secrets.token_hex(32)


def read_secret_file(path: str) -> tuple[bytes, str | None]:
    """The secret held in ``path`` (surrounding whitespace dropped), and a warning when the
    file is readable by others than its owner."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(1 << 16).strip()
    except OSError as exc:
        raise TrustError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    if not data:
        raise TrustError(f"the cluster secret file {path} is empty")
    warning = None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warning = (
            f"the cluster secret file {path} is readable by others (mode "
            f"{stat.S_IMODE(mode):o}): chmod 600 it"
        )
    return data, warning


def secret_from(file: str | None, env: Mapping[str, str]) -> tuple[bytes, str, str | None] | None:
    """The secret, where it came from (for the log: a path or a variable's name, never the
    value) and a warning; None when none is given. ``file`` (``--secret-file``) wins over
    ``KVFERRY_SECRET_FILE``, which wins over ``KVFERRY_SECRET``."""
    path = file or env.get(SECRET_FILE_ENV) or None
    if path:
        data, warning = read_secret_file(path)
        return data, path, warning
    value = env.get(SECRET_ENV, "").strip()
    if value:
        return value.encode(), SECRET_ENV, None
    return None


NO_SECRET = (
    "no cluster secret: give --secret-file FILE, or KVFERRY_SECRET_FILE (a path) or "
    "KVFERRY_SECRET (the secret) in the environment, the same on every node (`kvferry "
    "secret > FILE` makes one; scripts/serve-local.sh and `kvferry serve --nproc` make one "
    "for a cluster on this host)"
)


def load(file: str | None = None, env: Mapping[str, str] | None = None) -> tuple[Trust, str]:
    """The cluster's trust and where its secret came from; TrustError without one."""
    found = secret_from(file, os.environ if env is None else env)
    if found is None:
        raise TrustError(NO_SECRET)
    data, source, _ = found
    return Trust(data), source


def with_secret(env: dict[str, str]) -> dict[str, str]:
    """``env`` with a freshly generated ``KVFERRY_SECRET`` unless it names a secret already:
    what a launcher of a one-host cluster hands its ranks."""
    if env.get(SECRET_FILE_ENV) or env.get(SECRET_ENV, "").strip():
        return env
    return {**env, SECRET_ENV: generate_secret()}


_process_trust: Trust | None = None


def process_trust() -> Trust:
    """The trust of code that was given none (tests, in-process tools): the environment's
    secret when it names one, else a random one for this process. The launch path never
    uses it: a serving rank without a secret refuses to start (:func:`load`)."""
    global _process_trust
    if _process_trust is None:
        found = secret_from(None, os.environ)
        _process_trust = Trust(found[0]) if found is not None else Trust.generate()
    return _process_trust


def digest_of(text: str) -> bytes:
    """A fixed-length digest of a credential, so that comparing two of them in constant
    time does not depend on their lengths."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


API_KEY_ENV = "KVFERRY_API_KEY"


def api_key_from(key: str | None, file: str | None, env: Mapping[str, str]) -> str | None:
    """The front door's API key: ``--api-key``, else the first line of ``--api-key-file``,
    else ``KVFERRY_API_KEY``; None when none is given (the front door is then open)."""
    if key:
        return key
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read(1 << 16).strip()
        except OSError as exc:
            raise TrustError(f"cannot read the API key file {file}: {exc.strerror}") from None
        if not text:
            raise TrustError(f"the API key file {file} is empty")
        return text
    return env.get(API_KEY_ENV, "").strip() or None
