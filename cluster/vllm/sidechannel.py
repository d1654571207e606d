"""The handshake side channel: the scheduler process of an engine serves its workers'
transfer-engine addresses over TCP, and a peer's worker fetches them in a thread (the
only thing that thread does: the transfer engine stays on the worker's own thread)."""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from typing import Any

import msgpack

log = logging.getLogger("kvferry.vllm")
_LEN = struct.Struct("!I")


class SideChannel:
    """Serves one msgpack blob to every client that connects."""

    def __init__(self, host: str, port: int, blob: dict[str, Any]) -> None:
        self.payload = msgpack.packb(blob, use_bin_type=True)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="kvferry-side-channel", daemon=True)
        self.thread.start()
        log.info("kvferry handshake side channel on %s:%d", self.host, self.port)

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(_LEN.pack(len(self.payload)) + self.payload)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def fetch(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        data = b""
        while len(data) < _LEN.size or len(data) < _LEN.size + _LEN.unpack(data[:4])[0]:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"side channel {host}:{port} closed mid-handshake")
            data += chunk
    out = msgpack.unpackb(data[_LEN.size :], raw=False, strict_map_key=False)
    if not isinstance(out, dict):
        raise ValueError(f"side channel {host}:{port}: malformed handshake")
    return out


class Fetcher:
    """Fetches handshakes in background threads; results are taken on the worker thread."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.results: queue.Queue[tuple[tuple[str, int], dict[str, Any] | None, str]] = (
            queue.Queue()
        )
        self.asked: set[tuple[str, int]] = set()

    def ask(self, key: tuple[str, int]) -> None:
        if key in self.asked:
            return
        self.asked.add(key)

        def run() -> None:
            try:
                self.results.put((key, fetch(key[0], key[1], self.timeout_s), ""))
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
