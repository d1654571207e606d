"""aiohttp's own errors reach the client as JSON, the shape of every other error of the
front door: an unknown path is 404 ``not_found``, a wrong method 405
``method_not_allowed`` with the methods allowed (and the Allow header kept). Broken mode:
the middleware lets aiohttp's plain-text answers through, and the test catches it."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvferry.cluster import frontdoor
from kvferry.cluster.frontdoor import FrontDoor


class _Router:
    request_timeout_s = 1.0


def _plain(request: web.Request, exc: web.HTTPException) -> web.Response:
    """BROKEN MODE: aiohttp's own answer, as the front door gave before."""
    raise exc


@pytest.mark.parametrize("as_json", [True, False], ids=["contract", "broken-plain-text"])
def test_an_unknown_path_and_a_wrong_method_are_answered_in_json(monkeypatch, as_json):
    if not as_json:
        monkeypatch.setattr(frontdoor, "_http_error", _plain)

    async def run() -> list[tuple[int, str, str, str | None]]:
        out = []
        async with TestClient(TestServer(FrontDoor(_Router()).app)) as client:  # type: ignore[arg-type]
            for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions")):
                resp = await client.request(method, path)
                out.append(
                    (resp.status, resp.content_type, await resp.text(), resp.headers.get("Allow"))
                )
        return out

    missing, wrong_method = asyncio.run(run())
    assert missing[0] == 404 and wrong_method[0] == 405
    assert wrong_method[3] is not None and "POST" in wrong_method[3]
    if not as_json:
        assert missing[1] == wrong_method[1] == "text/plain"  # caught
        return
    assert json.loads(missing[2]) == {
        "error": "not_found",
        "message": "GET /v1/nothing: Not Found",
    }
    body = json.loads(wrong_method[2])
    assert body["error"] == "method_not_allowed" and "POST" in body["allowed"]
    assert body["message"] == "GET /v1/completions: Method Not Allowed"
