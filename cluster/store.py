"""The rendezvous store of a cluster run as failure domains, and the port kvferry reaches
it through.

The store is either an etcd cluster (``--store etcd://HOST:PORT,...``, :mod:`.etcd_store`),
which survives the loss of a minority of its members and brings its own TLS and
authentication, or one small process holding a torch.distributed TCPStore (``--store
HOST:PORT``), started before any rank and outliving every rank's job:

    python -m kvferry.cluster.store --port 29400 [--host 10.0.0.1]

That process listens on ``--host`` and nowhere else (loopback by default, for a cluster on
one host; node 0's cluster address for several): torch's TCPStore server listens on every
interface whatever host it is given, so the listening socket is bound here and handed to
it. What the ranks write to either store is sealed with the cluster's secret
(:mod:`.rendezvous`), but a client that reaches a TCPStore can still delete or overwrite
keys: only the network keeps strangers away from it.

Ranks publish their cards there (:mod:`.rendezvous`), their launchers publish exit records,
and a restarted rank's new card replaces its old one. It holds no request state: if it is
lost, serving goes on, but no rank can start or rejoin until it is back. Every client goes
through a :class:`GuardedStore`, which knows since when its store stopped answering (the
router's ``/health`` names it), logs a loss once and then every ``LOG_EVERY_S``, tries the
store again at most every ``RETRY_S`` meanwhile, and logs its return. A TCPStore keeps its
keys in its process: one that is restarted comes back empty, and the ranks must be
restarted with it; an etcd cluster keeps them through the loss of any minority.
"""

from __future__ import annotations

import argparse
import enum
import logging
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

log = logging.getLogger("kvferry.cluster")

CONNECT_TIMEOUT_S = 60.0  # a rank waits this long for its store at start-up
OP_TIMEOUT_S = 5.0  # one TCPStore call, once connected (a hung store holds no loop longer)
PROBE_TIMEOUT_S = 1.0  # a plain connect to a lost TCPStore before torch's own client tries
RETRY_S = 1.0  # a lost store is tried again at most this often; calls meanwhile fail at once
LOG_EVERY_S = 30.0  # a lost store is logged when lost, then this often, then when back


class StoreAddressError(ValueError):
    """A --store value (or its TLS and authentication options) that names no store."""


class StoreError(RuntimeError):
    """The store refused or failed an operation (an etcd error: its code and message)."""


class StoreUnreachable(StoreError):
    """No endpoint of the store answered (each endpoint's error in the message)."""


class RendezvousStore(Protocol):
    """What kvferry asks of its rendezvous store: exactly these calls, TCPStore's names and
    meanings. ``get`` and ``multi_get`` are asked only for keys ``check`` has seen (torch's
    TCPStore waits for a missing key; etcd's port raises KeyError); ``add(key, 0)`` reads
    a counter (0 when absent); values are bytes (a str is stored as UTF-8)."""

    def set(self, key: str, value: bytes | str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class StoreKind(enum.Enum):
    TCP = "tcp"  # torch's TCPStore in `python -m kvferry.cluster.store`
    ETCD = "etcd"  # an etcd cluster (v3 API, 3.4 or later)


@dataclass(frozen=True)
class StoreAccess:
    """etcd's TLS and authentication: files, never the secrets themselves, so that nothing
    secret shows in ``ps``. TLS is used when a CA or a client certificate is given."""

    ca_file: str | None = None  # the CA that signed the members' certificates
    cert_file: str | None = None  # this client's certificate (etcd --client-cert-auth)
    key_file: str | None = None  # and its key
    user: str | None = None  # etcd user (etcd auth enabled)
    password_file: str | None = None  # that user's password, first line of the file

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def given(self) -> list[str]:
        """The options given, as spelt on the command line."""
        return [opt for name, opt in ACCESS_OPTIONS.items() if getattr(self, name)]


ACCESS_OPTIONS = {
    "ca_file": "--store-ca",
    "cert_file": "--store-cert",
    "key_file": "--store-key",
    "user": "--store-user",
    "password_file": "--store-password-file",
}


DEFAULT_ETCD_PREFIX = "kvferry"


@dataclass(frozen=True)
class StoreSpec:
    """A parsed ``--store``: ``HOST:PORT`` (a TCPStore) or
    ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (an etcd cluster; every key of this
    cluster under ``PREFIX/``, default ``kvferry``: one prefix per cluster sharing an etcd)."""

    kind: StoreKind
    endpoints: tuple[tuple[str, int], ...]
    prefix: str = ""
    access: StoreAccess = field(default_factory=StoreAccess)

    def __str__(self) -> str:
        hosts = ",".join(_join(h, p) for h, p in self.endpoints)
        return hosts if self.kind is StoreKind.TCP else f"etcd://{hosts}/{self.prefix}"

    def loopback(self) -> bool:
        return all(h in LOOPBACK for h, _ in self.endpoints)

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> GuardedStore:
        """A client of this store; waits up to ``timeout_s`` for it to answer."""
        if self.kind is StoreKind.ETCD:
            from .etcd_store import EtcdStore

            return GuardedStore(EtcdStore.connect(self, timeout_s), str(self))
        host, port = self.endpoints[0]
        return GuardedStore(TcpStoreClient(host, port, timeout_s), str(self))


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreAddressError(
            f"--store must be HOST:PORT or etcd://HOST:PORT[,HOST:PORT...][/PREFIX], got {text!r}"
        )
    return host.strip("[]"), int(port)


def parse_store(text: str, access: StoreAccess | None = None) -> StoreSpec:
    """``--store`` and its access options; StoreAddressError naming what is wrong."""
    access = access or StoreAccess()
    if not text.startswith("etcd://"):
        if access.given():
            raise StoreAddressError(
                f"--store {text} is a TCPStore, which has no TLS or authentication: "
                f"{', '.join(access.given())} "
                "apply to an etcd store (--store etcd://HOST:PORT,...)"
            )
        return StoreSpec(StoreKind.TCP, (parse_address(text),))
    hosts, _, prefix = text.removeprefix("etcd://").partition("/")
    endpoints = tuple(parse_address(h) for h in hosts.split(",") if h)
    if not endpoints:
        raise StoreAddressError(f"--store {text} names no etcd endpoint (etcd://HOST:PORT,...)")
    prefix = prefix.strip("/") or DEFAULT_ETCD_PREFIX
    if bool(access.cert_file) != bool(access.key_file):
        raise StoreAddressError("--store-cert and --store-key go together")
    if bool(access.user) != bool(access.password_file):
        raise StoreAddressError("--store-user and --store-password-file go together")
    return StoreSpec(StoreKind.ETCD, endpoints, prefix, access)


def access_of(cfg: Any) -> StoreAccess:
    """The ``--store-*`` options of a ServeConfig."""
    return StoreAccess(
        cfg.store_ca, cfg.store_cert, cfg.store_key, cfg.store_user, cfg.store_password_file
    )


def spec_of(cfg: Any) -> StoreSpec:
    """The store a ServeConfig names: ``--store`` and its ``--store-*`` options."""
    return parse_store(cfg.store or "", access_of(cfg))


def refuse_access_without_store(store: str | None, access: StoreAccess) -> None:
    """``--store-*`` options say how to reach an etcd store; with no ``--store`` they would
    go unused (the ranks join through torchrun's rendezvous), so they are refused."""
    if store is None and access.given():
        raise StoreAddressError(
            f"{', '.join(access.given())} given without --store: they apply to an etcd "
            "store (--store etcd://HOST:PORT,...); without --store the ranks join through "
            "torchrun's rendezvous and use no store"
        )


def connect(
    address: str | StoreSpec,
    timeout_s: float = CONNECT_TIMEOUT_S,
    access: StoreAccess | None = None,
) -> GuardedStore:
    """A client of the cluster's store (``HOST:PORT``, ``etcd://...`` or a parsed spec);
    waits up to ``timeout_s`` for it. StoreUnreachable if it does not answer by then."""
    spec = address if isinstance(address, StoreSpec) else parse_store(address, access)
    return spec.connect(timeout_s)


# A TCPStore's identity, a random token set by its first client: every client remembers
# it, and a store that answers with another (or none) was restarted and lost its records.
IDENTITY_KEY = "kvferry/store-identity"


class TcpStoreClient:
    """The port on torch's TCPStore: its failures raised as StoreUnreachable, and after one
    a new client the next time the store is tried (torch's client never reconnects). A
    plain connect comes first: torch's own retries for its whole timeout, logging a C++
    backtrace at each try. A store that comes back empty (restarted: every card and
    record lost) stays unreachable to its old clients: the cluster must be restarted."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        # public in torch.distributed, re-exported there only when distributed is built in
        from torch.distributed import DistError

        self.host, self.port, self.errors = host, port, DistError
        self.where = f"TCPStore at {_join(host, port)}"
        self._client: TCPStore | None = None
        try:
            self._client = self._open(timeout_s)
            self.identity = self._identity(self._client)
        except DistError as exc:
            raise StoreUnreachable(f"{self.where}: {exc}") from None

    @staticmethod
    def _identity(client: TCPStore) -> bytes:
        return bytes(client.compare_set(IDENTITY_KEY, "", secrets.token_hex(8)))

    def _open(self, timeout_s: float) -> TCPStore:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        client = TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        client.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
        return client

    def _call(self, op: str, *args: Any) -> Any:
        if self._client is None:
            try:
                socket.create_connection((self.host, self.port), PROBE_TIMEOUT_S).close()
            except OSError as exc:
                raise StoreUnreachable(f"{self.where}: {exc}") from None
            try:
                client = self._open(PROBE_TIMEOUT_S)
                restarted = self._identity(client) != self.identity
            except self.errors as exc:
                raise StoreUnreachable(f"{self.where}: {exc}") from None
            if restarted:
                raise StoreUnreachable(
                    f"{self.where} was restarted and lost every card and exit record: "
                    "restart the cluster (an etcd store keeps them: --store etcd://...)"
                )
            self._client = client
        try:
            return getattr(self._client, op)(*args)
        except self.errors as exc:
            self._client = None
            raise StoreUnreachable(f"{self.where}: {exc}") from None

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in self._call("multi_get", keys)]


class GuardedStore:
    """A store port that keeps account of its store's answers: since when it stopped
    answering and why (:meth:`problem`, which the router's ``/health`` shows), the loss
    logged once, then every ``LOG_EVERY_S``, and the return logged. While the store is
    lost it is tried at most every ``RETRY_S``; calls in between raise StoreUnreachable at
    once, so a loop that asks the store every tick neither stalls nor floods the log. The
    ``feed`` of a store that watches (etcd) tells the router when to read the records."""

    def __init__(
        self, impl: RendezvousStore, name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.impl, self.name, self.clock = impl, name, clock
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.error = ""
        self._next_try = 0.0
        self._next_log = 0.0
        self._feed: Any = None

    def problem(self) -> str | None:
        """None while the store answers, else ``unreachable since 3.1 s: <error>``."""
        with self._lock:
            if self.down_since is None:
                return None
            return f"unreachable since {self.clock() - self.down_since:.1f} s: {self.error}"

    def lost(self, exc: BaseException) -> None:
        """Record a failed call (or a watch that found no member)."""
        with self._lock:
            now = self.clock()
            self.error = str(exc)
            self._next_try = now + RETRY_S
            if self.down_since is None:
                self.down_since, self._next_log = now, now + LOG_EVERY_S
                log.error(
                    "rendezvous store %s unreachable: %s; serving goes on, but no rank can "
                    "start or rejoin until it is back (logged again every %.0f s)",
                    self.name,
                    exc,
                    LOG_EVERY_S,
                )
            elif now >= self._next_log:
                self._next_log = now + LOG_EVERY_S
                log.warning(
                    "rendezvous store %s still unreachable after %.0f s: %s",
                    self.name,
                    now - self.down_since,
                    exc,
                )

    def answered(self) -> None:
        """Record a call the store answered."""
        with self._lock:
            if self.down_since is not None:
                log.warning(
                    "rendezvous store %s is back after %.1f s",
                    self.name,
                    self.clock() - self.down_since,
                )
                self.down_since = None

    def _call(self, op: str, *args: Any) -> Any:
        if self.down_since is not None and self.clock() < self._next_try:
            raise StoreUnreachable(self.error)
        try:
            result = getattr(self.impl, op)(*args)
        except StoreError as exc:
            self.lost(exc)
            raise
        self.answered()
        return result

    @property
    def feed(self) -> Any:
        """The store's change feed (an etcd watch, started on first use), or None: then
        the records are read every tick."""
        if self._feed is None and hasattr(self.impl, "watch"):
            self._feed = self.impl.watch(self.lost, self.answered)
        return self._feed

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)


def listen(host: str, port: int) -> tuple[TCPStore, socket.socket]:
    """The store's server, listening on ``host``:``port`` only (port 0: a free one, read
    ``.port``). The socket is returned with it and must live as long as the store."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
        store = TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    return store, sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvferry store",
        description="Host the rendezvous store a cluster's failure domains meet through: torch's "
        "TCPStore, in this process (a cluster on etcd needs none: see --store etcd://).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s store %(levelname)s: %(message)s")
    try:
        store, sock = listen(args.host, args.port)
    except Exception as exc:  # the port taken, the address not ours
        print(
            f"kvferry store: error: cannot listen on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 3
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.set())
    log.info("rendezvous store listening on %s:%d (there only)", args.host, store.port)
    stop.wait()
    sock.close()
    log.info("rendezvous store stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
