"""Fixtures for the transfer tests: a real target process (tests/transfer/transfer_peer.py)
and an engine in the test process connected to it. Every wait is bounded."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest

from kvferry.transfer import Peer, RemoteSegment, SegmentDescriptor, TransferConfig, TransferEngine

PEER_SCRIPT = Path(__file__).with_name("transfer_peer.py")
STARTUP_TIMEOUT_S = 30.0


@dataclass
class Target:
    proc: subprocess.Popen
    hello: dict

    @property
    def address(self) -> bytes:
        return bytes.fromhex(self.hello["address"])

    @property
    def segment(self) -> SegmentDescriptor:
        return SegmentDescriptor.unpack(bytes.fromhex(self.hello["segment"]))


def read_json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"process {proc.pid} printed no line within {timeout_s} s")
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(
                    f"process {proc.pid} exited (rc={proc.poll()}) before "
                    f"printing; stderr: {proc.stderr.read().decode()[-2000:]}"
                )
            buf += chunk
    return json.loads(buf.decode().splitlines()[0])


def start_target(
    transports: str,
    size: int = 16 << 20,
    mode: str = "allocate",
    name: str = "target",
    prefix: list[str] | None = None,
) -> Target:
    cmd = [
        *(prefix or []),
        sys.executable,
        str(PEER_SCRIPT),
        "target",
        "--transports",
        transports,
        "--size",
        str(size),
        "--mode",
        mode,
        "--name",
        name,
        "--lifetime",
        "120",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        return Target(proc, read_json_line(proc, STARTUP_TIMEOUT_S))
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@dataclass
class Link:
    """The test process's engine connected to a target process."""

    eng: TransferEngine
    target: Target
    peer: Peer
    rseg: RemoteSegment
    replies: list

    def request(self, obj: dict, timeout_s: float = 10.0, notify: bool = False) -> dict:
        """Send a command and wait (bounded) for the target's reply."""
        n = len(self.replies)
        data = msgpack.packb(obj)
        (self.eng.notify if notify else self.eng.send)(self.peer, data).wait(timeout_s)
        return self.wait_reply(n, timeout_s, obj.get("op"))

    def wait_reply(self, n: int, timeout_s: float = 10.0, what: str | None = None) -> dict:
        """The target's reply number ``n`` (0-based), waiting for it (bounded)."""
        deadline = time.monotonic() + timeout_s
        while len(self.replies) <= n:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no reply to {what or 'request ' + str(n)} within {timeout_s} s"
                )
            self.eng.progress(0.02)
        return self.replies[n]


def make_link(transports: str, mode: str = "allocate", size: int = 16 << 20, **cfg) -> Link:
    target = start_target(transports, size=size, mode=mode)
    eng = TransferEngine(TransferConfig(transports=transports, name="initiator", **cfg))
    replies: list = []
    eng.set_message_handler(lambda sender, payload: replies.append(msgpack.unpackb(payload)))
    peer = eng.connect(target.address, name="target")
    rseg = eng.open_segment(peer, target.segment, expected_incarnation=peer.incarnation)
    return Link(eng, target, peer, rseg, replies)


def close_link(link: Link) -> None:
    try:
        if link.target.proc.poll() is None and link.eng.peer_alive(link.peer):
            link.eng.send(link.peer, msgpack.packb({"op": "exit"})).wait(5.0)
            link.target.proc.wait(10)
    except Exception:
        pass
    finally:
        stop(link.target.proc)
        link.eng.shutdown()


@pytest.fixture(params=["shm", "tcp"])
def link(request):
    lk = make_link(request.param)
    yield lk
    close_link(lk)


@pytest.fixture
def engine(request):
    """One engine over shared memory in this process, named for the test."""
    eng = TransferEngine(TransferConfig(transports="shm", name=request.node.name[:40]))
    yield eng
    eng.shutdown()
