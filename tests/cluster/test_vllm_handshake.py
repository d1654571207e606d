"""The vLLM connector's handshake side channel (kvferry.cluster.vllm.sidechannel): the
workers' transfer addresses go only to a client that proves the engines' secret, and a
client takes them only from a server that proves it. No vLLM needed.

Each test runs a broken mode it must catch:
- a side channel as it was before (no proof asked, the blob in the clear): a client
  without the secret reads the workers' addresses;
- a client that does not check the answer: a stranger's addresses are adopted;
- an answer not bound to the connection's nonces: a recorded answer replays;
- (no vLLM) the blocker of ``vllm`` imports is shown to catch the plugin's.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from kvferry.cluster import trust as trusts
from kvferry.cluster.trust import Trust, TrustError, generate_secret
from kvferry.cluster.vllm import sidechannel as sc
from kvferry.cluster.vllm.settings import Settings
from kvferry.cluster.vllm.sidechannel import (
    ANSWER,
    CHALLENGE_BYTES,
    HELLO,
    REFUSED,
    Fetcher,
    HandshakeKey,
    HandshakeRefused,
    SideChannel,
    fetch,
)

ADDRESS = b"ucx-worker-address:10.0.0.7:SECRET-0123456789"
BLOB = {"engine_id": "prefill", "tp_size": 1, "workers": {0: {"address": ADDRESS, "pid": 42}}}
FORGED = {"engine_id": "prefill", "tp_size": 1, "workers": {0: {"address": b"stranger"}}}


@pytest.fixture
def secret() -> bytes:
    return generate_secret().encode()


@pytest.fixture
def key(secret) -> HandshakeKey:
    return HandshakeKey(secret)


@pytest.fixture
def served(key):
    side = SideChannel("127.0.0.1", 0, BLOB, key, timeout_s=5.0)
    yield side
    side.close()


def _frames(raw: bytes) -> list[bytes]:
    out = []
    while len(raw) >= 4:
        n = int.from_bytes(raw[:4], "big")
        out.append(raw[4 : 4 + n])
        raw = raw[4 + n :]
    return out


def _client(
    port: int, key: HandshakeKey | None, replay: tuple[bytes, bytes] | None = None
) -> tuple[bytes, bytes]:
    """One connection as any client, with ``key``'s proof, a recorded ``(Nc, proof)``, or
    random bytes for one: everything the server sent, and the server nonce."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        raw = b""
        while len(raw) < 4 + len(HELLO) + CHALLENGE_BYTES:
            raw += s.recv(4096)
        server_nonce = _frames(raw)[0][len(HELLO) :]
        nc = os.urandom(CHALLENGE_BYTES)
        if replay is not None:
            frame = replay[0] + replay[1]
        elif key is not None:
            frame = nc + key.prove(server_nonce, nc)
        else:
            frame = nc + os.urandom(32)
        s.sendall(len(frame).to_bytes(4, "big") + frame)
        while chunk := s.recv(1 << 16):
            raw += chunk
    return raw, server_nonce


class _Stranger:
    """A server on the side channel's port without the secret: to its one client it sends
    ``hello`` (a fresh challenge by default), reads the proof, then sends
    ``reply(server_nonce, client_nonce)``."""

    def __init__(self, reply: Callable[[bytes, bytes], bytes], hello: bytes | None = None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hello = hello or HELLO + os.urandom(CHALLENGE_BYTES)
        self.reply = reply
        self.thread = threading.Thread(target=self._one, daemon=True)
        self.thread.start()

    def _one(self) -> None:
        self.sock.settimeout(10)
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(10)
            try:
                conn.sendall(len(self.hello).to_bytes(4, "big") + self.hello)
                got = b""
                while len(got) < 4 or len(got) < 4 + int.from_bytes(got[:4], "big"):
                    got += conn.recv(4096)
                data = self.reply(self.hello[len(HELLO) :], got[4 : 4 + CHALLENGE_BYTES])
                conn.sendall(len(data).to_bytes(4, "big") + data)
            except OSError:  # the client hung up first: what a client that refuses does
                pass

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()


def _the_side_channel_as_it_was(monkeypatch) -> None:
    """Broken mode: no proof asked, and the blob served as it is."""
    monkeypatch.setattr(HandshakeKey, "proof_ok", lambda self, ns, nc, proof: True)
    monkeypatch.setattr(HandshakeKey, "seal", lambda self, payload, ns, nc: payload)


# ---------------------------------------------------------------- the exchange
def test_the_right_secret_gets_the_blob(served, key, secret):
    assert fetch("127.0.0.1", served.port, 5.0, key) == BLOB
    assert fetch("127.0.0.1", served.port, 5.0, HandshakeKey(secret)) == BLOB  # another process
    assert served.wait_idle(5) and served.served == 2 and served.refusals == {}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-open"])
def test_a_client_with_another_secret_is_refused_and_learns_no_address(
    checked, served, secret, monkeypatch, caplog
):
    if not checked:
        _the_side_channel_as_it_was(monkeypatch)
    other = HandshakeKey.generate()
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        raws = [_client(served.port, other)[0], _client(served.port, None)[0]]
        assert served.wait_idle(5)
    if not checked:
        assert all(ADDRESS in raw for raw in raws)  # the test sees what a stranger takes
        return
    for raw in raws:
        assert ADDRESS not in raw and b"SECRET" not in raw
        assert _frames(raw)[1:] == [REFUSED]  # a challenge, then the refusal: nothing else
    with pytest.raises(HandshakeRefused, match="refused this engine's proof") as info:
        fetch("127.0.0.1", served.port, 5.0, other)
    assert f"127.0.0.1:{served.port}" in str(info.value) and other.fingerprint in str(info.value)
    assert served.wait_idle(5)
    assert served.served == 0 and served.refusals == {"127.0.0.1": 3}
    logged = [r for r in caplog.records if "refused a handshake" in r.getMessage()]
    assert len(logged) == 1  # once per peer address
    assert fetch("127.0.0.1", served.port, 5.0, HandshakeKey(secret)) == BLOB


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_a_stranger_server_is_refused_by_the_client(checked, key, monkeypatch):
    if not checked:  # the client takes the answer as it comes
        monkeypatch.setattr(HandshakeKey, "open", lambda self, sealed, ns, nc: sealed)
    plain = msgpack.packb(FORGED, use_bin_type=True)
    replies = [
        lambda ns, nc: ANSWER + plain,  # an answer in the clear
        lambda ns, nc: ANSWER + HandshakeKey.generate().seal(plain, ns, nc),  # another secret
    ]
    for reply in replies[: 1 if not checked else 2]:
        stranger = _Stranger(reply)
        try:
            if not checked:
                got = fetch("127.0.0.1", stranger.port, 5.0, key)
                assert got["workers"][0]["address"] == b"stranger"  # the test sees it adopted
                continue
            with pytest.raises(HandshakeRefused, match="not sealed with this engine's secret"):
                fetch("127.0.0.1", stranger.port, 5.0, key)
        finally:
            stranger.close()


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "broken-unbound"])
def test_a_replayed_answer_is_refused(bound, served, key, monkeypatch):
    if not bound:  # an answer bound to nothing of its connection
        monkeypatch.setattr(sc, "_associated", lambda ns, nc: b"answer")
    raw, server_nonce = _client(served.port, key)  # recorded on the wire
    recorded = _frames(raw)[1]
    assert recorded[:1] == ANSWER and ADDRESS not in raw
    stranger = _Stranger(lambda ns, nc: recorded, hello=HELLO + server_nonce)
    try:
        if not bound:
            assert fetch("127.0.0.1", stranger.port, 5.0, key) == BLOB  # the test sees it
            return
        with pytest.raises(HandshakeRefused, match="replayed answer"):
            fetch("127.0.0.1", stranger.port, 5.0, key)
    finally:
        stranger.close()


def test_a_replayed_proof_is_refused(served, key):
    """A client's recorded proof answers the challenge of its own connection only."""
    nc = os.urandom(CHALLENGE_BYTES)
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        hello = sc._recv_frame(s, time.monotonic() + 5, 5.0, 64, "test")
    proof = key.prove(hello[len(HELLO) :], nc)  # proved for that (closed) connection
    raw, _ = _client(served.port, None, replay=(nc, proof))
    assert _frames(raw)[1:] == [REFUSED] and ADDRESS not in raw
    assert served.wait_idle(5) and served.refusals == {"127.0.0.1": 2}


# ---------------------------------------------------------------- deadlines
def test_every_read_has_a_deadline(key):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never speaks
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
            fetch("127.0.0.1", silent.getsockname()[1], 0.3, key)
        assert time.monotonic() - t0 < 3.0
    finally:
        silent.close()
    side = SideChannel("127.0.0.1", 0, BLOB, key, timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", side.port), timeout=5) as s:
            t0 = time.monotonic()
            s.recv(4096)  # the challenge; then this client says nothing
            assert s.recv(4096) == b""  # the server gave up on it and closed
            assert time.monotonic() - t0 < 3.0
        assert side.wait_idle(5) and side.refusals == {"127.0.0.1": 1}
        assert fetch("127.0.0.1", side.port, 5.0, key) == BLOB  # one silent client blocks none
    finally:
        side.close()


def test_an_oversized_frame_is_refused_unread(key):
    huge = _Stranger(lambda ns, nc: b"", hello=b"x" * 1000)
    try:
        with pytest.raises(HandshakeRefused, match="1000 bytes, over the 64"):
            fetch("127.0.0.1", huge.port, 5.0, key)
    finally:
        huge.close()


def test_the_fetcher_reports_a_refusal_once_per_side_channel(served, caplog):
    fetcher = Fetcher(5.0, HandshakeKey.generate())
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        fetcher.ask(("127.0.0.1", served.port))
        fetcher.ask(("127.0.0.1", served.port))
        results = [fetcher.results.get(timeout=10)]
    assert results[0][1] is None and "HandshakeRefused" in results[0][2]
    assert fetcher.refused == 1 and fetcher.take() == []
    assert len([r for r in caplog.records if "handshake refused" in r.getMessage()]) == 1


# ---------------------------------------------------------------- the secret in the settings
def _extra(**extra) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_extra_config=extra)


def test_an_engine_without_a_secret_refuses_to_start(tmp_path, monkeypatch):
    for name in trusts.SECRET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrustError, match="no handshake secret") as info:
        Settings.from_extra(_extra(transports="shm"))
    for named in ("secret_file", "KVFERRY_SECRET_FILE", "KVFERRY_SECRET"):
        assert named in str(info.value)
    with pytest.raises(ValueError, match="secret_file \\(a path\\), not the secret itself"):
        Settings.from_extra(_extra(secret=generate_secret()))
    short = tmp_path / "short"
    short.write_text("hunter2-hunter2\n")
    with pytest.raises(TrustError, match="at least 32") as info:
        Settings.from_extra(_extra(secret_file=str(short)))
    assert str(short) in str(info.value) and "hunter2" not in str(info.value)
    with pytest.raises(TrustError, match="cannot read"):
        Settings.from_extra(_extra(secret_file=str(tmp_path / "missing")))


def test_the_secret_comes_from_the_file_then_the_environment(tmp_path, monkeypatch):
    secret, other = generate_secret(), generate_secret()
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    monkeypatch.delenv(trusts.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(trusts.SECRET_ENV, other)
    from_file = Settings.from_extra(_extra(secret_file=str(path)))
    from_env = Settings.from_extra(_extra())
    assert from_file.key.fingerprint == Trust(secret.encode()).fingerprint
    assert from_env.key.fingerprint == Trust(other.encode()).fingerprint
    for s in (from_file, from_env):
        assert secret not in repr(s) + repr(s.key) and other not in repr(s) + repr(s.key)


# ---------------------------------------------------------------- no vLLM
_BLOCK_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if (name == "vllm" or name.startswith("vllm.")):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def test_the_side_channel_imports_without_vllm():
    """The side channel and the settings import where vLLM does not (this suite's venv): a
    blocker refuses every ``vllm`` import, and catches the plugin's (so it would catch
    theirs)."""
    code = textwrap.dedent(_BLOCK_VLLM) + textwrap.dedent("""
        import kvferry.cluster.vllm.sidechannel, kvferry.cluster.vllm.settings
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        from kvferry.cluster.vllm import plugin
        try:
            plugin.register()
        except ImportError as exc:
            print("plugin:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plugin: blocked: vllm" in proc.stdout, proc.stdout


@pytest.mark.parametrize("capped", [True, False], ids=["per-peer-cap", "broken-shared-slots"])
def test_idle_strangers_do_not_lock_holders_of_the_secret_out(key, monkeypatch, capped):
    """A stranger holds every slot it can with idle connections: one address gets
    MAX_IN_FLIGHT_PER_PEER of them, and must send its proof within PROOF_TIMEOUT_S; a
    decode with the secret is served all the same. Broken mode: one cap shared by every
    peer; the stranger takes all MAX_IN_FLIGHT and the decode is closed at once."""
    if not capped:
        monkeypatch.setattr(sc, "MAX_IN_FLIGHT_PER_PEER", sc.MAX_IN_FLIGHT)
    side = SideChannel("127.0.0.1", 0, {"workers": [1, 2]}, key, timeout_s=5.0)
    idle = []
    try:
        for _ in range(sc.MAX_IN_FLIGHT):  # from another address than the decode's
            idle.append(socket.create_connection(("127.0.0.1", side.port), None, ("127.0.0.2", 0)))
        deadline = time.monotonic() + 5
        while side._in_flight < min(sc.MAX_IN_FLIGHT, sc.MAX_IN_FLIGHT_PER_PEER):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if not capped:
            with pytest.raises(ConnectionError):  # the test catches the lock-out
                fetch("127.0.0.1", side.port, 2.0, key)
            return
        assert fetch("127.0.0.1", side.port, 2.0, key) == {"workers": [1, 2]}
    finally:
        for s in idle:
            s.close()
        side.close()


SERVER_NEAR_ITS_DESCRIPTOR_LIMIT = textwrap.dedent(
    """
    import os, resource, sys, time
    sys.path.insert(0, {root!r})
    from kvferry.cluster.vllm.sidechannel import HandshakeKey, SideChannel
    side = SideChannel("127.0.0.1", 0, {{"ok": 1}}, HandshakeKey(b"k" * 64), timeout_s=1.0)
    used = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, hard))
    print(side.port, flush=True)
    sys.stdin.read()
    print(side.accept_errors, side.thread.is_alive(), flush=True)
    """
)


def test_an_accept_that_fails_a_while_does_not_stop_the_side_channel():
    """A burst of connections takes a server near its descriptor limit past it (accept()
    fails with EMFILE): it logs, backs off and goes on accepting, and once the burst is
    over a decode is served. (It returned on the first failure, its listening socket
    open: every later decode waited for a HELLO that never came.)"""
    root = str(Path(__file__).resolve().parents[2].parent)  # as test_failure_domains
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_NEAR_ITS_DESCRIPTOR_LIMIT.format(root=root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        time.sleep(0.5)
        for s in burst:
            s.close()
        time.sleep(1.5)  # every connection it took has timed out (1 s)
        assert fetch("127.0.0.1", port, 3.0, HandshakeKey(b"k" * 64)) == {"ok": 1}
        out, _ = proc.communicate("", timeout=10)
        errors, alive = out.split()
        assert int(errors) >= 1 and alive == "True"
    finally:
        proc.kill()
