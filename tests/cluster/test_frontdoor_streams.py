"""A streamed answer never holds the front door past the request's deadline, and an
error after the stream began reaches the client as an SSE error event. Over a real socket,
with a stand-in router that hands the front door a request whose events the test queues.

- A client that keeps its socket open and reads nothing (its buffers full, every write
  waiting on it): past the deadline and a grace the request ends (client) and the
  connection closes. Broken mode: with no bound the handler is still held when the test
  looks, and the test catches it.
- A token the text cannot be made of, after the first chunk went: the body ends with an
  SSE error event naming the request, never an HTTP status line inside the 200's body."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from aiohttp import web

from kvferry.cluster import frontdoor
from kvferry.cluster.frontdoor import FrontDoor
from kvferry.cluster.router import RoutedRequest
from kvferry.engine.lifecycle import Request
from kvferry.engine.lifecycle import RequestState as S
from kvferry.engine.protocol.words import Answer


class _Router:
    """What the front door asks of a router, for one request the test drives."""

    request_timeout_s = 0.3

    def __init__(self) -> None:
        self.routed: RoutedRequest | None = None
        self.submitted = asyncio.Event()
        self.aborts: list[tuple[str, str]] = []
        self.aborted = asyncio.Event()

    async def submit(self, prompt: str, max_tokens: int) -> RoutedRequest:
        req = Request("req-test-000001", [1, 2, 3], max_tokens)
        req.transition(S.ADMITTED)
        req.transition(S.PREFILLING)
        self.routed = RoutedRequest(req, 2, [1], time.monotonic())
        self.submitted.set()
        return self.routed

    def abort_request(self, routed: RoutedRequest, source, reason: str) -> None:
        self.aborts.append((str(source), reason))
        self.aborted.set()
        routed.req.transition(S.FAILED, reason)
        routed.outcome, routed.error = Answer.FAILED, reason


async def _serve(router: _Router) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(FrontDoor(router).app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def _post_stream(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "p", "max_tokens": 5, "stream": True}).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    return s


async def _routed(router: _Router) -> RoutedRequest:
    await asyncio.wait_for(router.submitted.wait(), 10)
    assert router.routed is not None
    return router.routed


@pytest.mark.parametrize("bounded", [True, False], ids=["contract", "broken-unbounded"])
def test_a_client_that_stops_reading_does_not_hold_the_stream(monkeypatch, bounded):
    monkeypatch.setattr(frontdoor, "STREAM_GRACE_S", 0.2 if bounded else 1e6)

    async def run() -> list:
        router = _Router()
        runner, port = await _serve(router)
        client = _post_stream(port, rcvbuf=4096)
        try:
            routed = await _routed(router)
            chunk = [97] * (1 << 20)
            for _ in range(16):  # 16 MB of answer; the client reads none of it
                routed.req.output_tokens.extend(chunk)
                routed.events.put_nowait(("tokens", chunk))
            try:  # 0.5 s is the bound; ten times that to see it
                await asyncio.wait_for(router.aborted.wait(), 5)
            except TimeoutError:
                pass
            return list(router.aborts)  # as they stood, before the client closes
        finally:
            client.close()
            await runner.cleanup()

    aborts = asyncio.run(run())
    if not bounded:
        assert aborts == []  # still held: what the bound prevents
        return
    assert len(aborts) == 1 and "stopped reading" in aborts[0][1]


def test_an_error_after_the_stream_began_is_an_sse_error_event():
    async def run() -> bytes:
        router = _Router()
        runner, port = await _serve(router)
        client = _post_stream(port)
        client.settimeout(5)
        try:
            routed = await _routed(router)
            routed.events.put_nowait(("tokens", list(b"hi")))
            routed.events.put_nowait(("tokens", [300]))  # no text can be made of it
            data = b""
            loop = asyncio.get_running_loop()
            while b"0\r\n\r\n" not in data:
                chunk = await loop.run_in_executor(None, client.recv, 65536)
                if not chunk:
                    break
                data += chunk
            return data
        finally:
            client.close()
            await runner.cleanup()

    data = asyncio.run(run())
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1" not in body  # no second response inside the stream
    events = [json.loads(x[6:]) for x in body.split(b"\n") if x.startswith(b"data: {")]
    assert events[0]["text"] == "hi"
    assert events[-1]["error"] == Answer.FAILED and "req-test-000001" in events[-1]["message"]
    assert "300" in events[-1]["message"]
