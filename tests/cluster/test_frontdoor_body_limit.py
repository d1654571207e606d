"""A body over the front door's limit is answered 413 in JSON, the shape of every other
error of the front door, naming the limit and the size the body declared; a body at the
limit is served. Through aiohttp's test client, with the limit made small. Broken mode:
aiohttp's own 413 (plain text) reaches the client, and the test catches it."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvferry.cluster import frontdoor
from kvferry.cluster.frontdoor import FrontDoor
from kvferry.cluster.router import Unavailable

LIMIT = 1024


class _Router:
    """A router that answers every request it is handed with 503 (no rank here)."""

    request_timeout_s = 1.0

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def submit(self, prompt: str, max_tokens: int):
        self.prompts.append(prompt)
        raise Unavailable("req-test-000001", "no rank in this test")


def _body(size: int) -> bytes:
    """A completion request of exactly ``size`` bytes."""
    empty = json.dumps({"prompt": "", "max_tokens": 1}).encode()
    return json.dumps({"prompt": "p" * (size - len(empty)), "max_tokens": 1}).encode()


async def _chunked(size: int):
    body = _body(size)
    for i in range(0, len(body), 256):
        yield body[i : i + 256]


def _aiohttp_413(request: web.Request) -> web.Response:
    """BROKEN MODE: aiohttp's plain-text 413, as the front door answered before."""
    raise web.HTTPRequestEntityTooLarge(frontdoor.MAX_BODY)


def _reraise(request: web.Request, exc: web.HTTPException) -> web.Response:
    raise exc


@pytest.mark.parametrize("json_413", [True, False], ids=["contract", "broken-plain-text"])
def test_a_body_over_the_limit_is_answered_413_in_json(monkeypatch, json_413):
    monkeypatch.setattr(frontdoor, "MAX_BODY", LIMIT)
    if not json_413:
        monkeypatch.setattr(frontdoor, "_too_large", _aiohttp_413)
        monkeypatch.setattr(frontdoor, "_http_error", _reraise)
    router = _Router()

    async def run() -> list[tuple[int, str, str]]:
        out = []
        async with TestClient(TestServer(FrontDoor(router).app)) as client:
            for data in (_body(LIMIT + 500), _chunked(LIMIT + 500), _body(LIMIT)):
                resp = await client.post(
                    "/v1/completions", data=data, headers={"Content-Type": "application/json"}
                )
                out.append((resp.status, resp.content_type, await resp.text()))
        return out

    declared, chunked, at_limit = asyncio.run(run())
    assert declared[0] == chunked[0] == 413
    if not json_413:
        assert declared[1] == "text/plain"  # the test sees the plain-text answer
        return
    assert [declared[1], chunked[1]] == ["application/json"] * 2
    d, c = json.loads(declared[2]), json.loads(chunked[2])
    assert d == {
        "error": "too_large",
        "message": f"a body of {LIMIT + 500} bytes is over the front door's limit of {LIMIT} bytes",
        "limit_bytes": LIMIT,
        "body_bytes": LIMIT + 500,
    }
    assert c["error"] == "too_large" and c["limit_bytes"] == LIMIT and c["body_bytes"] is None
    assert c["message"] == f"a chunked body is over the front door's limit of {LIMIT} bytes"
    # at the limit the body is read and the request goes to the router (503 from it)
    assert at_limit[0] == 503 and json.loads(at_limit[2])["error"] == "unavailable"
    assert len(_body(LIMIT)) == LIMIT and len(router.prompts) == 1
