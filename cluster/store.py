"""The rendezvous store of a cluster run as failure domains: one small process holding a
torch.distributed TCPStore, started before any rank and outliving every rank's job.

    python -m kvferry.cluster.store --port 29400 [--host 10.0.0.1]

It listens on ``--host`` and nowhere else (loopback by default, for a cluster on one host;
node 0's cluster address for several): torch's TCPStore server listens on every interface
whatever host it is given, so the listening socket is bound here and handed to it.
What the ranks write there is sealed with the cluster's secret (:mod:`.rendezvous`), but a
client that reaches the store can still delete or overwrite keys: only the network keeps
strangers away from it.

Ranks publish their cards there (:mod:`.rendezvous`), their launchers publish exit records,
and a restarted rank's new card replaces its old one. It holds no request state: if it is
lost, serving goes on, but no rank can start or rejoin until it is back. torch's TCPStore
is already a dependency and needs nothing else installed; an operator with etcd could host
the same keys there.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from datetime import timedelta

# public in torch.distributed, re-exported there only when distributed is built in
from torch.distributed import TCPStore  # type: ignore[attr-defined]

log = logging.getLogger("kvferry.cluster")

CONNECT_TIMEOUT_S = 60.0


class StoreAddressError(ValueError):
    """A --store value that is not HOST:PORT."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreAddressError(f"--store must be HOST:PORT, got {text!r}")
    return host, int(port)


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> TCPStore:
    """A client of the cluster's store at ``HOST:PORT``; waits up to ``timeout_s`` for it."""
    host, port = parse_address(address)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def listen(host: str, port: int) -> tuple[TCPStore, socket.socket]:
    """The store's server, listening on ``host``:``port`` only (port 0: a free one, read
    ``.port``). The socket is returned with it and must live as long as the store."""
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
        description="Host the rendezvous store a cluster's failure domains meet through.",
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
