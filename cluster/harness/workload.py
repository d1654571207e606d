"""A workload of concurrent users against a running cluster, checked for leaks.

Each user has a unique marker, repeated through every prompt so that every page of its KV
holds a whole marker (the period of the pattern is at most ``page_size - len(marker) + 1``
characters). With the replay model, an answer must equal its prompt replayed
(``answer[i] == prompt[i % len(prompt)]``); any other request's marker in an answer is a
foreign page that decode attended to. Some requests are sized over the context length
(they must get 400), some are cancelled by their client mid-flight (the server aborts them).

Prints a progress bar on stderr, then a table, then one JSON line (the last line).
A front door behind an API key gets it with every request (``--api-key-file``, else
``KVFERRY_API_KEY``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from kvferry.cluster.trust import api_key_from

MARKER_RE = re.compile(r"@[0-9a-f]{5}@")


@dataclass
class Job:
    user: int
    marker: str
    prompt: str
    max_tokens: int
    kind: str  # normal, oversize, cancel
    status: int | None = None
    text: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    outcome: str = "pending"  # ok, rejected, aborted, failed, unavailable, wrong
    foreign: list[str] = field(default_factory=list)


def make_prompt(marker: str, length: int) -> str:
    """``length`` ASCII characters of ``marker`` + a 3-digit counter, period 10."""
    parts, size, i = [], 0, 0
    while size < length:
        parts.append(f"{marker}{i % 1000:03d}")
        size += len(parts[-1])
        i += 1
    return "".join(parts)[:length]


def expected_replay(prompt: str, max_tokens: int) -> str:
    return "".join(prompt[i % len(prompt)] for i in range(max_tokens))


def build_jobs(
    requests: int,
    users: int,
    context_length: int,
    min_len: int,
    max_len: int,
    oversize_every: int,
    cancel_every: int,
    seed: int,
    tag: str = "",
    tag_every: int = 0,
) -> list[Job]:
    rng = random.Random(seed)
    markers: dict[int, str] = {}
    while len(markers) < users:
        markers[len(markers)] = "@" + secrets.token_hex(3)[:5] + "@"
    jobs = []
    for i in range(requests):
        user = i % users
        if oversize_every and i % oversize_every == oversize_every - 1:
            length, kind = context_length + rng.randint(1, 64), "oversize"
            max_tokens = 8
        else:
            length = rng.randint(min_len, max_len)
            kind = "cancel" if cancel_every and i % cancel_every == cancel_every - 2 else "normal"
            max_tokens = (
                length if kind == "normal" else min(4 * length, max(1, context_length - length))
            )
        prompt = make_prompt(markers[user], length)
        if tag and tag_every and i % tag_every == tag_every - 3 and kind == "normal":
            prompt, kind = tag + prompt[len(tag) :], "cancel"  # a faulted request, then cancelled
        jobs.append(Job(user, markers[user], prompt, max_tokens, kind))
    return jobs


async def run_job(
    session: aiohttp.ClientSession, url: str, job: Job, cancel_after_s: float, timeout_s: float
) -> None:
    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True}
    t0 = time.monotonic()

    async def go() -> None:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            job.status = resp.status
            if resp.content_type != "text/event-stream":
                payload = await resp.json(content_type=None)
                job.error = payload.get("message") or payload.get("reason") or str(payload)
                return
            chunks, error = [], None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "text" in event:
                    if job.ttft_ms is None:
                        job.ttft_ms = 1e3 * (time.monotonic() - t0)
                    chunks.append(event["text"])
                if "error" in event:
                    error = event.get("message", event["error"])
            job.text = "".join(chunks)
            job.error = error

    if job.kind == "cancel":
        try:
            await asyncio.wait_for(go(), cancel_after_s * (0.2 + 1.6 * random.random()))
        except TimeoutError:
            job.outcome = "aborted"
            return
    else:
        try:
            await go()
        except (TimeoutError, aiohttp.ClientError) as exc:
            job.outcome, job.error = "failed", f"client: {type(exc).__name__}: {exc}"
            return
    job.outcome = classify(job)


def classify(job: Job) -> str:
    if job.status == 400:
        return "rejected"
    if job.status == 503:
        return "unavailable"
    if job.status != 200 or job.error is not None or job.text is None:
        return "failed"
    if job.text != expected_replay(job.prompt, len(job.text)) or len(job.text) != job.max_tokens:
        return "wrong" if job.kind != "cancel" else "aborted"
    return "ok"


def find_foreign(jobs: list[Job]) -> None:
    for job in jobs:
        texts = [job.text or "", job.error or ""]
        job.foreign = sorted({m for t in texts for m in MARKER_RE.findall(t) if m != job.marker})


def progress(done: int, total: int, width: int = 40) -> None:
    """A bar redrawn in place on a terminal; a line every tenth of the way otherwise."""
    tty = sys.stderr.isatty()
    step = max(1, total // 10)
    if not tty and done % step and done != total:
        return
    filled = int(width * done / total) if total else width
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests"
    sys.stderr.write(("\r" + bar) if tty else (bar + "\n"))
    if tty and done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvferry_transfer_bytes{"):
            out["bytes"] = out.get("bytes", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvferry_transfer_seconds_sum "):
            out["transfer_s"] = float(line.rsplit(" ", 1)[1])
    return out


async def wait_for_quiesce(session: aiohttp.ClientSession, url: str, timeout_s: float) -> int:
    """Pages still held on any rank once the cluster had ``timeout_s`` to release them."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(f"{url}/status") as resp:
            status = await resp.json()
        held = sum(status["held_pages"].values())
        ranks = status.get("ranks", {})
        used = sum(r.get("owned", 0) + r.get("quarantined", 0) for r in ranks.values())
        if (held == 0 and used == 0) or time.monotonic() > deadline:
            return max(held, used)
        await asyncio.sleep(0.6)  # ranks report pool figures every 0.5 s


async def run(args: argparse.Namespace) -> dict:
    jobs = build_jobs(
        args.requests,
        args.users,
        args.context_length,
        args.min_prompt,
        args.max_prompt,
        args.oversize_every,
        args.cancel_every,
        args.seed,
        args.tag,
        args.tag_every,
    )
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    key = api_key_from(None, args.api_key_file, os.environ)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        before = await fetch_metrics(session, args.url)
        sem = asyncio.Semaphore(args.concurrency)
        done = 0
        t0 = time.monotonic()

        async def one(job: Job) -> None:
            nonlocal done
            async with sem:
                await run_job(session, args.url, job, args.cancel_after, args.timeout)
            done += 1
            progress(done, len(jobs))

        progress(0, len(jobs))
        await asyncio.gather(*(one(j) for j in jobs))
        wall = time.monotonic() - t0
        leaked = await wait_for_quiesce(session, args.url, args.quiesce_timeout)
        after = await fetch_metrics(session, args.url)
    find_foreign(jobs)
    ttfts = sorted(j.ttft_ms for j in jobs if j.outcome == "ok" and j.ttft_ms is not None)
    moved = after.get("bytes", 0.0) - before.get("bytes", 0.0)
    counts = {
        k: sum(1 for j in jobs if j.outcome == k)
        for k in ("ok", "rejected", "aborted", "failed", "unavailable", "wrong")
    }
    return {
        "requests": len(jobs),
        "ok": counts["ok"],
        "rejected": counts["rejected"],
        "aborted": counts["aborted"],
        "failed": counts["failed"] + counts["unavailable"],
        "wrong_answers": counts["wrong"],
        "foreign_markers": sum(len(j.foreign) for j in jobs),
        "leaked_pages": leaked,
        "gbps": round(moved / wall / 1e9, 4) if wall > 0 else 0.0,
        "bytes_moved": int(moved),
        "wall_s": round(wall, 3),
        "ttft_p50_ms": round(_pct(ttfts, 50), 2) if ttfts else None,
        "ttft_p99_ms": round(_pct(ttfts, 99), 2) if ttfts else None,
        "_jobs": jobs,
    }


def _pct(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


def print_report(result: dict) -> None:
    jobs: list[Job] = result.pop("_jobs")
    rows = [
        ("requests", result["requests"]),
        ("ok (own replay)", result["ok"]),
        ("rejected (400)", result["rejected"]),
        ("aborted by client", result["aborted"]),
        ("failed / unavailable", result["failed"]),
        ("wrong answers", result["wrong_answers"]),
        ("foreign markers", result["foreign_markers"]),
        ("pages held after quiesce", result["leaked_pages"]),
        ("GB/s moved (over the run)", result["gbps"]),
        ("bytes moved", result["bytes_moved"]),
        ("TTFT p50 ms", result["ttft_p50_ms"]),
        ("TTFT p99 ms", result["ttft_p99_ms"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 16))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 16))
    for job in jobs:
        if job.foreign or job.outcome in ("wrong", "failed"):
            print(
                f"  user {job.user} {job.kind} -> {job.outcome} status={job.status} "
                f"foreign={job.foreign[:3]} error={(job.error or '')[:160]}"
            )
    print(json.dumps(result))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry workload", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--context-length",
        type=int,
        default=4096,
        help="the cluster's context length; oversize prompts exceed it",
    )
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument(
        "--oversize-every", type=int, default=10, help="every Nth request is too long (0: none)"
    )
    p.add_argument(
        "--cancel-every", type=int, default=8, help="every Nth request is cancelled (0: none)"
    )
    p.add_argument("--cancel-after", type=float, default=0.05, help="seconds before a cancel")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tag",
        default="",
        help="prefix every --tag-every'th prompt with this "
        "fault tag (the cluster's --fault hooks match it); those are cancelled",
    )
    p.add_argument("--tag-every", type=int, default=0)
    p.add_argument(
        "--api-key-file",
        default=None,
        help="the front door's API key, when it has one (else KVFERRY_API_KEY)",
    )
    p.add_argument(
        "--quiesce-timeout",
        type=float,
        default=30.0,
        help="seconds for every rank to release its pages after the workload",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(run(args))
    clean = (
        result["foreign_markers"] == 0
        and result["wrong_answers"] == 0
        and result["leaked_pages"] == 0
    )
    print_report(result)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
