"""The HTTP front door on the router (aiohttp).

aiohttp gives us an asyncio HTTP server with streaming responses and handler cancellation
on client disconnect, which is exactly the signal an abort needs; the router's engine runs
on the same event loop.

    POST /v1/completions  {"prompt": str, "max_tokens": int, "stream": bool}
        200  {"id", "text", "usage", "timing"}  only for a request that completed
        400  admission rejected, with the numbers (I1); or a malformed request: a body that
             is not UTF-8 JSON (a charset other than UTF-8, invalid bytes, nesting too
             deep), a prompt that is not valid Unicode (a lone surrogate), a wrong field
        413  a body over the limit (16 MiB), with the limit and the body's declared size
        404  an unknown path; 405 a wrong method (with ``allowed`` and the Allow header)
        503  no capacity or no healthy rank right now, or the cluster is stopping
        504  the request's deadline passed (aborted)
        500  the request failed (integrity, transfer, rank failure), with its id
        stream=true: server-sent events, one per token chunk, then an end event carrying the
        outcome; a failure after the first token ends the stream with an error event and
        no [DONE] (I6). Text is decoded incrementally: a character split between two
        chunks is sent whole with the later one, so the streamed text equals the whole.
        Any exception this server did not expect answers 500 with the request id (when
        there is one) and is logged; it never leaves a request live.
    GET /health    200 when every rank is healthy, has reported what its pool holds (the
                   router admits nothing before) and the store answers, else 503, with
                   the details (``store``: ``unreachable since 3.1 s: <error>``;
                   ``awaiting_reports``: the ranks not heard from since this router started)
    GET /metrics   Prometheus text format
    GET /capacity  every rank's measured pool capacity and the context length (I3)
    GET /status    live requests, pages held per rank, quarantined requests

With an API key (``--api-key``, ``--api-key-file`` or ``KVFERRY_API_KEY``) every route but
/health answers 401 unless the request carries ``Authorization: Bearer <key>`` (OpenAI's
convention), compared in constant time; ``--open-metrics`` leaves /metrics, /status and
/capacity open to scrapers that carry no key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from aiohttp import web

from kvferry.engine.admission import AdmissionRejected
from kvferry.engine.protocol.words import AbortSource, Answer
from kvferry.engine.tokenizer import StreamDecoder

from .router import RoutedRequest, Router, Unavailable
from .trust import digest_of

log = logging.getLogger("kvferry.cluster")

MAX_BODY = 16 << 20
# A stream lasts at most the request's deadline and this: past it only a client that
# stopped reading holds it
STREAM_GRACE_S = 5.0
UTF8_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})  # ASCII is UTF-8


class BadRequest(ValueError):
    """A request the front door refuses with 400, and why."""


def _error(status: int, kind: str, message: str, **extra) -> web.Response:
    return web.json_response({"error": kind, "message": message, **extra}, status=status)


def _too_large(request: web.Request) -> web.Response:
    """413 as JSON like every other error here (aiohttp's own is plain text), with the
    limit and the size the body declared (none when it came chunked)."""
    size = request.content_length
    body = f"a body of {size} bytes" if size is not None else "a chunked body"
    return _error(
        413,
        "too_large",
        f"{body} is over the front door's limit of {MAX_BODY} bytes",
        limit_bytes=MAX_BODY,
        body_bytes=size,
    )


def decode_body(raw: bytes, charset: str | None) -> object:
    """The JSON value of a request body; BadRequest for anything but UTF-8 JSON."""
    if charset is not None and charset.strip().lower() not in UTF8_CHARSETS:
        raise BadRequest(
            f"unsupported charset {charset[:40]!r} in Content-Type: send "
            f"UTF-8 JSON (charset=utf-8 or none)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not valid UTF-8: byte {exc.start} of {len(raw)}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRequest("body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints over Python's digit limit
        raise BadRequest(f"body is not valid JSON: {str(exc)[:200]}") from None


def parse_completion(body: object) -> tuple[str, int, bool]:
    """``(prompt, max_tokens, stream)`` of a completion request; BadRequest otherwise."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    max_tokens = body.get("max_tokens", 16)
    stream = body.get("stream", False)
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest(f"'prompt' must be a non-empty string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"'prompt' is not valid Unicode text: {exc.reason} at character "
            f"{exc.start} (U+{ord(prompt[exc.start]):04X})"
        ) from None
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {str(max_tokens)[:40]}")
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    return prompt, max_tokens, stream


HTTP_ERROR_KINDS = {404: "not_found", 405: "method_not_allowed"}


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (an unknown path, a wrong method) as JSON like every other
    error here, their headers (``Allow``) kept."""
    extra = {}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        extra["allowed"] = sorted(exc.allowed_methods)
    response = _error(
        exc.status,
        HTTP_ERROR_KINDS.get(exc.status, "http_error"),
        f"{request.method} {request.path}: {exc.reason}",
        **extra,
    )
    for name in ("Allow", "WWW-Authenticate"):
        if name in exc.headers:
            response.headers[name] = exc.headers[name]
    return response


@web.middleware
async def _no_unexpected_errors(request: web.Request, handler) -> web.StreamResponse:
    """Whatever goes wrong inside a handler, the client gets JSON and a status that says
    so (never the server's bare 500 page), and the log gets the traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        rid = request.get("request_id")
        log.exception(
            "front door: %s %s failed%s",
            request.method,
            request.path,
            f" (request {rid})" if rid else "",
        )
        return _error(
            500,
            "internal",
            f"{type(exc).__name__}: {str(exc)[:500]}" + (f" (request {rid})" if rid else ""),
            request_id=rid,
        )


ALWAYS_OPEN = frozenset({"/health"})
OPERATOR_ROUTES = frozenset({"/metrics", "/status", "/capacity"})  # open with --open-metrics


def api_key_check(api_key: str, open_paths: frozenset[str]):
    """Middleware: a request to a path outside ``open_paths`` without ``Authorization:
    Bearer <api_key>`` is answered 401. The keys are compared as SHA-256 digests with
    hmac.compare_digest, so the time taken says nothing of the key or its length."""
    expected = digest_of(api_key)

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in open_paths:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                digest_of(given.strip()), expected
            ):
                why = "missing" if not given else "wrong"
                return web.json_response(
                    {
                        "error": "unauthorized",
                        "message": f"{why} API key: send the header 'Authorization: Bearer "
                        "<key>' with the key this front door was started with",
                    },
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="kvferry"'},
                )
        return await handler(request)

    return check


class FrontDoor:
    def __init__(
        self, router: Router, api_key: str | None = None, open_metrics: bool = False
    ) -> None:
        self.router = router
        middlewares = [_no_unexpected_errors]
        if api_key:
            open_paths = ALWAYS_OPEN | (OPERATOR_ROUTES if open_metrics else frozenset())
            middlewares.insert(0, api_key_check(api_key, open_paths))
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=middlewares)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/capacity", self.capacity),
                web.get("/status", self.status),
            ]
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            charset = request.charset
        except Exception:  # a Content-Type header aiohttp cannot parse
            return _error(400, "bad_request", "Content-Type header does not parse")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large(request)
        try:
            prompt, max_tokens, stream = parse_completion(decode_body(raw, charset))
        except BadRequest as exc:
            return _error(400, "bad_request", str(exc))
        try:
            routed = await self.router.submit(prompt, max_tokens)
        except AdmissionRejected as exc:
            return web.json_response({**exc.to_dict(), "message": str(exc)}, status=400)
        except Unavailable as exc:
            return _error(503, "unavailable", str(exc), request_id=exc.request_id)
        request["request_id"] = routed.rid
        try:
            if stream:
                return await self._stream(request, routed)
            return await self._whole(routed)
        except asyncio.CancelledError:
            self.router.abort_request(routed, AbortSource.CLIENT, "client disconnected")
            raise
        except Exception as exc:
            self.router.abort_request(
                routed, AbortSource.INTERNAL, f"front door: {type(exc).__name__}: {exc}"
            )
            raise

    async def _whole(self, routed: RoutedRequest) -> web.Response:
        while True:
            event = await routed.events.get()
            if event[0] == "done":
                break
        return self._final_response(routed)

    def _final_response(self, routed: RoutedRequest) -> web.Response:
        rid = routed.rid
        if routed.outcome is Answer.OK:
            return web.json_response(
                {
                    "id": rid,
                    "text": routed.text,
                    "usage": {
                        "prompt_tokens": routed.req.prompt_len,
                        "completion_tokens": len(routed.req.output_tokens),
                    },
                    "timing": {
                        "ttft_ms": _ms(routed.first_token_at, routed.submitted_at),
                        "total_ms": _ms(time.monotonic(), routed.submitted_at),
                        "prefill_ms": routed.prefill_ms,
                        "transfer_ms": routed.transfer_ms,
                        "landed_to_first_token_ms": routed.landed_to_first_token_ms,
                    },
                }
            )
        status = (
            {AbortSource.DEADLINE: 504, AbortSource.SHUTDOWN: 503}.get(routed.abort_source, 500)
            if routed.abort_source
            else 500
        )
        return _error(
            status,
            routed.outcome or Answer.FAILED,
            f"request {rid}: {routed.error}",
            request_id=rid,
        )

    async def _stream(self, request: web.Request, routed: RoutedRequest) -> web.StreamResponse:
        first = await routed.events.get()
        if first[0] == "done" and routed.outcome is not Answer.OK:
            return self._final_response(routed)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        # The whole answer within the request's deadline and a grace: the router answers
        # every request by its deadline, so past it only a client that stopped reading
        # holds the stream (its socket full, each write waiting on it).
        limit = self.router.request_timeout_s + STREAM_GRACE_S
        try:
            async with asyncio.timeout(limit):
                await self._stream_events(resp, routed, first)
        except TimeoutError:
            log.warning(
                "request %s: the client read nothing of its stream for %.1f s; closing it",
                routed.rid,
                limit,
            )
            self._drop_stream(
                routed, AbortSource.CLIENT, f"client stopped reading for {limit:.1f} s"
            )
            if request.transport is not None:  # its writes wait on it: no goodbye fits
                request.transport.close()
            return resp
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # after the headers went: an SSE error event, not a 500
            reason = f"{type(exc).__name__}: {str(exc)[:500]}"
            log.exception("request %s: its stream failed: %s", routed.rid, reason)
            self._drop_stream(routed, AbortSource.INTERNAL, f"the stream failed: {reason}")
            try:
                async with asyncio.timeout(STREAM_GRACE_S):
                    await _sse(
                        resp,
                        {
                            "id": routed.rid,
                            "error": Answer.FAILED,
                            "message": f"request {routed.rid}: {reason}",
                        },
                    )
                    await resp.write_eof()
            except Exception:
                pass
            return resp
        await resp.write_eof()
        return resp

    def _drop_stream(self, routed: RoutedRequest, source: AbortSource, reason: str) -> None:
        """A stream that cannot go on: its request ends, if it has not."""
        if routed.req.live:
            self.router.abort_request(routed, source, reason)

    async def _stream_events(
        self, resp: web.StreamResponse, routed: RoutedRequest, first: tuple
    ) -> None:
        text = StreamDecoder()
        event = first
        while True:
            if event[0] == "tokens":
                piece = text.feed(event[1])
                if piece:
                    await _sse(resp, {"id": routed.rid, "text": piece})
            else:
                if routed.outcome is Answer.OK:
                    rest = text.finish()
                    if rest:
                        await _sse(resp, {"id": routed.rid, "text": rest})
                    await _sse(
                        resp,
                        {
                            "id": routed.rid,
                            "finish_reason": "length",
                            "usage": {"completion_tokens": len(routed.req.output_tokens)},
                        },
                    )
                    await resp.write(b"data: [DONE]\n\n")
                else:
                    await _sse(
                        resp,
                        {
                            "id": routed.rid,
                            "error": routed.outcome,
                            "message": f"request {routed.rid}: {routed.error}",
                        },
                    )
                break
            event = await routed.events.get()

    async def health(self, request: web.Request) -> web.Response:
        self.router.check_heartbeats()
        store = self.router.store_problem()  # a lost store: no rank can start or rejoin
        awaiting = self.router.waiting_for_reports()  # admission waits for them
        body = {
            "ok": not self.router.unhealthy and store is None and not awaiting,
            "unhealthy": self.router.unhealthy,
            "awaiting_reports": awaiting,
            "store": store or "ok",
            "context_length": self.router.context_length,
        }
        return web.json_response(body, status=200 if body["ok"] else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        own = self.router.own_counts().get("dropped", {})  # the router's own, as rank 0's
        for reason, count in own.items():
            self.router.metrics.dropped_messages.labels("0", reason).set(count)
        data, content_type = self.router.metrics.render()
        return web.Response(body=data, headers={"Content-Type": content_type})

    async def capacity(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"context_length": self.router.context_length, "ranks": self.router.capacity_table()}
        )

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.status())


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _ms(t: float | None, t0: float) -> float | None:
    return None if t is None else round(1e3 * (t - t0), 3)
