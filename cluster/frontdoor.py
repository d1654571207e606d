"""The HTTP front door on the router (aiohttp).

aiohttp gives us an asyncio HTTP server with streaming responses and handler cancellation
on client disconnect, which is exactly the signal an abort needs; the router's engine runs
on the same event loop.

    POST /v1/completions  {"prompt": str, "max_tokens": int, "stream": bool}
        200  {"id", "text", "usage", "timing"}  only for a request that completed
        400  admission rejected, with the numbers (I1); or a malformed body
        503  no capacity or no healthy rank right now
        504  the request's deadline passed (aborted)
        500  the request failed (integrity, transfer, rank failure), with its id
        stream=true: server-sent events, one per token chunk, then an end event carrying the
        outcome; a failure after the first token ends the stream with an error event and
        no [DONE] (I6).
    GET /health    200 when every rank is healthy, else 503, with the details
    GET /metrics   Prometheus text format
    GET /capacity  every rank's measured pool capacity and the context length (I3)
    GET /status    live requests, pages held per rank, quarantined requests
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from kvferry.engine.admission import AdmissionRejected
from kvferry.engine.tokenizer import decode as detokenize

from .router import RoutedRequest, Router, Unavailable

log = logging.getLogger("kvferry.cluster")

MAX_BODY = 16 << 20


def _error(status: int, kind: str, message: str, **extra) -> web.Response:
    return web.json_response({"error": kind, "message": message, **extra}, status=status)


def _parse(body: object) -> tuple[str, int, bool]:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    prompt = body.get("prompt")
    max_tokens = body.get("max_tokens", 16)
    stream = body.get("stream", False)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("'prompt' must be a non-empty string")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    if not isinstance(stream, bool):
        raise ValueError("'stream' must be true or false")
    return prompt, max_tokens, stream


class FrontDoor:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.app = web.Application(client_max_size=MAX_BODY)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.get("/capacity", self.capacity),
            web.get("/status", self.status),
        ])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            prompt, max_tokens, stream = _parse(await request.json())
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, "bad_request", str(exc))
        try:
            routed = await self.router.submit(prompt, max_tokens)
        except AdmissionRejected as exc:
            return web.json_response({**exc.to_dict(), "message": str(exc)}, status=400)
        except Unavailable as exc:
            return _error(503, "unavailable", str(exc), request_id=exc.request_id)
        try:
            if stream:
                return await self._stream(request, routed)
            return await self._whole(routed)
        except asyncio.CancelledError:
            self.router.abort(routed.rid, "client", "client disconnected")
            raise

    async def _whole(self, routed: RoutedRequest) -> web.Response:
        while True:
            event = await routed.events.get()
            if event[0] == "done":
                break
        return self._final_response(routed)

    def _final_response(self, routed: RoutedRequest) -> web.Response:
        rid = routed.rid
        if routed.outcome == "ok":
            return web.json_response({
                "id": rid, "text": routed.text,
                "usage": {"prompt_tokens": routed.req.prompt_len,
                          "completion_tokens": len(routed.req.output_tokens)},
                "timing": {"ttft_ms": _ms(routed.first_token_at, routed.submitted_at),
                           "total_ms": _ms(time.monotonic(), routed.submitted_at),
                           "transfer_ms": routed.transfer_ms}})
        status = 504 if routed.error and routed.error.startswith("deadline") else 500
        return _error(status, routed.outcome or "failed", f"request {rid}: {routed.error}",
                      request_id=rid)

    async def _stream(self, request: web.Request, routed: RoutedRequest) -> web.StreamResponse:
        first = await routed.events.get()
        if first[0] == "done" and routed.outcome != "ok":
            return self._final_response(routed)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        event = first
        while True:
            if event[0] == "tokens":
                await _sse(resp, {"id": routed.rid, "text": detokenize(event[1])})
            else:
                if routed.outcome == "ok":
                    await _sse(resp, {"id": routed.rid, "finish_reason": "length",
                                      "usage": {"completion_tokens": len(routed.req.output_tokens)}})
                    await resp.write(b"data: [DONE]\n\n")
                else:
                    await _sse(resp, {"id": routed.rid, "error": routed.outcome,
                                      "message": f"request {routed.rid}: {routed.error}"})
                break
            event = await routed.events.get()
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        self.router.check_heartbeats()
        body = {"ok": not self.router.unhealthy, "unhealthy": self.router.unhealthy,
                "context_length": self.router.context_length}
        return web.json_response(body, status=200 if body["ok"] else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        data, content_type = self.router.metrics.render()
        return web.Response(body=data, headers={"Content-Type": content_type})

    async def capacity(self, request: web.Request) -> web.Response:
        return web.json_response({"context_length": self.router.context_length,
                                  "ranks": self.router.capacity_table()})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.status())


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _ms(t: float | None, t0: float) -> float | None:
    return None if t is None else round(1e3 * (t - t0), 3)
