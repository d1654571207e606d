"""The rendezvous store on an etcd cluster (``--store etcd://HOST:PORT,...``): the port of
:mod:`.store` over etcd's v3 API, every key under the cluster's prefix.

Why etcd's JSON gateway over plain HTTP and not a gRPC client such as aetcd: kvferry calls
its store from plain synchronous loops (a rank's, the router's between two awaits) and
from a launcher right after ``fork``. aetcd is asyncio-only, so every rank would need an
event loop in a thread of its own and a bridge to it, and it brings grpcio, which is large
and needs care across ``fork``. etcd (3.4 on) serves the same v3 API as JSON on its client
port (``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``, ``/v3/kv/deleterange``,
``/v3/watch``, ``/v3/auth/authenticate``), behind the same TLS and the same authentication,
so a small synchronous client over ``http.client`` does all kvferry asks with no new
dependency, a deadline on every call, and a fail-over across members: a member that
refuses, times out or has no leader is left for the next one.

TLS (``--store-ca``, ``--store-cert``/``--store-key``) and etcd users (``--store-user``,
``--store-password-file``; the token is renewed when etcd says it expired) are etcd's own.
``add`` is a compare-and-swap transaction that also leaves its token under a mark key, so
an add whose answer was lost and is tried again on another member is not counted twice.
The router's liveness check reads the records only when the watch on the cluster's prefix
saw a change (:class:`EtcdWatch`), and at least every ``SAFETY_READ_S``.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from .store import (
    RETRY_S,
    StoreAccess,
    StoreAddressError,
    StoreError,
    StoreSpec,
    StoreUnreachable,
    _join,
)

log = logging.getLogger("kvferry.cluster")

REQUEST_TIMEOUT_S = 2.5  # one call to one member (an election takes about one second)
WATCH_IDLE_S = 60.0  # a watch stream silent this long is opened again (and read once)
SAFETY_READ_S = 5.0  # the router reads the records at least this often, watch or not
TXN_OPS = 100  # etcd refuses a transaction of more than 128 operations by default
ADD_ATTEMPTS = 64
LAST_ADD = b"\x00last-add"  # under a counter's key: the token and result of its last add

# gRPC codes of a member that cannot answer now, when another may
UNAVAILABLE_CODES = frozenset({1, 4, 14})  # CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE
UNAUTHENTICATED = 16  # the token expired or is unknown: authenticate again


class EtcdError(StoreError):
    """etcd refused a call (permission denied, a bad password): its code and message."""

    def __init__(self, endpoint: str, path: str, code: int | None, message: str) -> None:
        super().__init__(f"etcd at {endpoint} refused {path}: {message} (code {code})")
        self.endpoint, self.path, self.code, self.message = endpoint, path, code, message


class _Unavailable(Exception):
    """This member did not answer; the next one may."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"  # every key
    end[-1] += 1
    return bytes(end)


def tls_context(access: StoreAccess) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=access.ca_file)
        if access.cert_file:
            ctx.load_cert_chain(access.cert_file, access.key_file)
    except OSError as exc:
        raise StoreAddressError(
            f"etcd TLS: cannot load --store-ca {access.ca_file} / --store-cert "
            f"{access.cert_file} / --store-key {access.key_file}: {exc}"
        ) from None
    return ctx


def read_password(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as exc:
        raise StoreAddressError(f"cannot read --store-password-file {path}: {exc}") from None


def _put(key: bytes, value: bytes) -> dict:
    return {"request_put": {"key": _b64(key), "value": _b64(value)}}


def _range(key: bytes, count_only: bool = False) -> dict:
    return {"request_range": {"key": _b64(key), **({"count_only": True} if count_only else {})}}


def _kvs(response: dict) -> list[dict]:
    return response.get("response_range", {}).get("kvs") or []


def _value(kv: dict) -> bytes:
    return _unb64(kv.get("value", ""))


class EtcdStore:
    """The port on etcd: TCPStore's calls as etcd ranges, puts and transactions, under
    ``<prefix>/``. Calls go to the member that last answered; one that fails is left
    for the next, and StoreUnreachable names each member's error when none answers.
    Thread-safe (one call at a time; the watch has a connection of its own)."""

    def __init__(self, spec: StoreSpec, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.base = (spec.prefix.strip("/") + "/").encode()
        self.endpoints = [_join(h, p) for h, p in spec.endpoints]
        self._ssl = tls_context(spec.access) if spec.access.tls else None
        self._password = (
            read_password(spec.access.password_file) if spec.access.password_file else None
        )
        self._lock = threading.RLock()
        self._conns: dict[int, http.client.HTTPConnection] = {}
        self._token: str | None = None
        self.current = 0  # the member that last answered

    @classmethod
    def connect(cls, spec: StoreSpec, timeout_s: float) -> EtcdStore:
        """A client once a member answers (authenticated, when a user is given); waits up
        to ``timeout_s`` for one. An etcd refusal (a bad password) is raised at once."""
        store = cls(spec)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                store.check([""])
                return store
            except StoreUnreachable as exc:
                if time.monotonic() > deadline:
                    raise StoreUnreachable(
                        f"{spec}: no member answered within {timeout_s:.0f} s: {exc}"
                    ) from None
                time.sleep(0.5)

    # ------------------------------------------------------------------ transport
    def connection(self, i: int, timeout_s: float) -> http.client.HTTPConnection:
        host, port = self.spec.endpoints[i]
        if self._ssl is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=timeout_s)

    def _drop(self, i: int) -> None:
        conn = self._conns.pop(i, None)
        if conn is not None:
            conn.close()

    def _exchange(self, i: int, path: str, body: dict, auth: bool) -> tuple[int, dict]:
        conn = self._conns.get(i)
        if conn is None:
            conn = self._conns[i] = self.connection(i, self.timeout_s)
        headers = {"Content-Type": "application/json"}
        if auth and self._token:
            headers["Authorization"] = self._token
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw or b"{}")
        except ValueError:
            return resp.status, {"message": raw[:200].decode(errors="replace")}

    def _on(self, i: int, path: str, body: dict, auth: bool = True) -> dict:
        """One call to member ``i``: a kept-alive connection the member closed is tried
        again once, fresh; an expired token is renewed once."""
        for attempt in range(3):
            reused = i in self._conns
            try:
                status, reply = self._exchange(i, path, body, auth)
            except ssl.SSLCertVerificationError as exc:
                self._drop(i)
                raise EtcdError(self.endpoints[i], path, None, f"TLS: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(i)
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue
                raise _Unavailable(str(exc) or type(exc).__name__) from None
            if status == 200:
                return reply
            code, message = reply.get("code"), str(reply.get("message") or reply.get("error"))
            if code == UNAUTHENTICATED and auth and self.spec.access.user and attempt < 2:
                self._authenticate(i)
                continue
            if code in UNAVAILABLE_CODES or (code is None and status >= 500):
                raise _Unavailable(f"{message} (code {code})")
            if "CommonName" in message:
                message += (
                    "; etcd's gateway refuses a client certificate with a CommonName: give "
                    "kvferry one without (the user is --store-user)"
                )
            raise EtcdError(self.endpoints[i], path, code, message.strip())
        raise _Unavailable(f"{path}: no answer after 3 tries")

    def _authenticate(self, i: int) -> None:
        reply = self._on(
            i,
            "/v3/auth/authenticate",
            {"name": self.spec.access.user, "password": self._password},
            auth=False,
        )
        self._token = reply.get("token")

    def request(self, path: str, body: dict) -> dict:
        """``body`` posted to ``path`` on the member that last answered, else the next."""
        with self._lock:
            errors = []
            n = len(self.endpoints)
            for step in range(n):
                i = (self.current + step) % n
                try:
                    if self.spec.access.user and self._token is None:
                        self._authenticate(i)
                    reply = self._on(i, path, body)
                except _Unavailable as exc:
                    errors.append(f"{self.endpoints[i]}: {exc}")
                    continue
                self.current = i
                return reply
            raise StoreUnreachable(f"etcd: no member answered {path}: " + "; ".join(errors))

    def token(self) -> str | None:
        """The token a watch stream carries (authenticating first, when a user is given)."""
        with self._lock:
            if self.spec.access.user and self._token is None:
                self.request("/v3/kv/range", {"key": _b64(self.base), "count_only": True})
            return self._token

    def forget_token(self) -> None:
        with self._lock:
            self._token = None

    def _txn(self, ops: list[dict], **rest: Any) -> dict:
        return self.request("/v3/kv/txn", {"success": ops, **rest})

    # ------------------------------------------------------------------ the port
    def key(self, key: str) -> bytes:
        return self.base + key.encode()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.request("/v3/kv/put", {"key": _b64(self.key(key)), "value": _b64(data)})

    def get(self, key: str) -> bytes:
        kvs = self.request("/v3/kv/range", {"key": _b64(self.key(key))}).get("kvs")
        if not kvs:
            raise KeyError(f"{key} is not in the store")
        return _value(kvs[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = []
        for start in range(0, len(keys), TXN_OPS):
            chunk = keys[start : start + TXN_OPS]
            responses = self._txn([_range(self.key(k)) for k in chunk]).get("responses", [])
            if len(responses) != len(chunk):
                raise StoreError(f"etcd answered {len(responses)} of {len(chunk)} reads")
            for k, response in zip(chunk, responses, strict=True):
                kvs = _kvs(response)
                if not kvs:
                    raise KeyError(f"{k} is not in the store")
                out.append(_value(kvs[0]))
        return out

    def check(self, keys: list[str]) -> bool:
        for start in range(0, len(keys), TXN_OPS):
            chunk = keys[start : start + TXN_OPS]
            responses = self._txn([_range(self.key(k), True) for k in chunk]).get("responses")
            if not responses or len(responses) != len(chunk):
                return False
            if not all(int(r.get("response_range", {}).get("count", 0)) for r in responses):
                return False
        return True

    def delete_key(self, key: str) -> bool:
        reply = self.request("/v3/kv/deleterange", {"key": _b64(self.key(key))})
        return int(reply.get("deleted", 0)) > 0

    def add(self, key: str, amount: int) -> int:
        """The counter at ``key`` plus ``amount`` (stored as decimal text, as TCPStore
        does), in a compare-and-swap on its revision; ``add(key, 0)`` reads it."""
        full = self.key(key)
        if amount == 0:
            kvs = self.request("/v3/kv/range", {"key": _b64(full)}).get("kvs")
            return int(_value(kvs[0]) or b"0") if kvs else 0
        mark, token = full + LAST_ADD, secrets.token_hex(8)
        created = {"target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        compare = {**created, "key": _b64(full)}
        value = amount
        for _ in range(ADD_ATTEMPTS):
            reply = self._txn(
                [_put(full, str(value).encode()), _put(mark, f"{token} {value}".encode())],
                compare=[compare],
                failure=[_range(full), _range(mark)],
            )
            if reply.get("succeeded"):
                return value
            now, last = (_kvs(r) for r in reply.get("responses", [{}, {}]))
            if last and _value(last[0]).startswith(f"{token} ".encode()):
                return int(_value(last[0]).split()[1])  # this add landed; its answer was lost
            if not now:  # deleted meanwhile
                compare = {**created, "key": _b64(full)}
                value = amount
                continue
            compare = {
                "key": _b64(full),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": now[0]["mod_revision"],
            }
            value = int(_value(now[0]) or b"0") + amount
        raise StoreError(f"etcd: the add to {key} lost {ADD_ATTEMPTS} races in a row")

    # ------------------------------------------------------------------ the watch
    def watch(
        self, lost: Callable[[BaseException], None], answered: Callable[[], None]
    ) -> EtcdWatch:
        """A watch on every key of this cluster (started here), reporting a watch that no
        member will hold to ``lost`` and one that holds again to ``answered``."""
        return EtcdWatch(self, lost, answered)

    def close(self) -> None:
        with self._lock:
            for i in list(self._conns):
                self._drop(i)


class EtcdWatch:
    """The router's change feed on etcd: a watch stream on the cluster's prefix in a
    thread of its own. :meth:`due` says when the records may have changed (an event
    came, the stream was opened again, it is down, or ``SAFETY_READ_S`` passed), so the
    router reads them then and not every tick. The stream asks for a member with a leader
    (``hasleader``), so a member cut off from the others ends it instead of going quiet."""

    def __init__(
        self,
        store: EtcdStore,
        lost: Callable[[BaseException], None],
        answered: Callable[[], None],
    ) -> None:
        self.store, self.lost, self.answered = store, lost, answered
        self.changed = threading.Event()
        self.changed.set()  # read once at the start
        self.up = False
        self.events = 0
        self._last_read = 0.0
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._run, name="kvferry-etcd-watch", daemon=True)
        self._thread.start()

    def due(self) -> bool:
        """True when the records should be read now (and the feed starts over)."""
        now = time.monotonic()
        if self.changed.is_set() or not self.up or now - self._last_read >= SAFETY_READ_S:
            self.changed.clear()
            self._last_read = now
            return True
        return False

    def close(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        n = len(self.store.endpoints)
        i = self.store.current
        failures: list[str] = []
        while not self._stop.is_set():
            try:
                self._stream(i)
                failures = []
            except (_Unavailable, StoreError) as exc:
                if self.up:  # it held until now: a round of members starts here
                    failures = []
                self.up = False
                self.changed.set()
                failures.append(f"{self.store.endpoints[i]}: {exc}")
                i = (i + 1) % n
                if len(failures) >= n and not self._stop.is_set():
                    self.lost(
                        StoreUnreachable("etcd watch: no member held it: " + "; ".join(failures))
                    )
                    failures = []
                    self._stop.wait(RETRY_S)

    def _stream(self, i: int) -> None:
        """Follow one watch stream on member ``i`` until it ends. Returns when it was idle
        for ``WATCH_IDLE_S`` (it is then opened again); raises when the member failed."""
        base = self.store.base
        body = {"create_request": {"key": _b64(base), "range_end": _b64(prefix_end(base))}}
        conn = self._conn = self.store.connection(i, self.store.timeout_s)
        following = False
        try:
            headers = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
            token = self.store.token()
            if token:
                headers["Authorization"] = token
            conn.request("POST", "/v3/watch", json.dumps(body), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise _Unavailable(f"watch refused: HTTP {resp.status} {resp.read()[:200]!r}")
            if conn.sock is not None:
                conn.sock.settimeout(WATCH_IDLE_S)
            following = True
            while not self._stop.is_set():
                line = resp.readline()
                if not line:
                    raise _Unavailable("the watch stream ended")
                msg = json.loads(line)
                if "error" in msg:
                    error = msg["error"]
                    if error.get("code") == UNAUTHENTICATED:
                        self.store.forget_token()
                    raise _Unavailable(f"{error.get('message')} (code {error.get('code')})")
                result = msg.get("result", {})
                if result.get("created"):
                    self.up = True
                    self.changed.set()  # what changed while no stream was open
                    self.answered()
                if result.get("canceled"):
                    raise _Unavailable(result.get("cancel_reason") or "the watch was canceled")
                if result.get("events"):
                    self.events += len(result["events"])
                    self.changed.set()
        except TimeoutError as exc:
            if not following:
                raise _Unavailable(f"timed out: {exc}") from None
            return  # idle: opened again (the router reads once, having missed nothing)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _Unavailable(str(exc) or type(exc).__name__) from None
        finally:
            self._conn = None
            conn.close()
