"""The long-context check: the incident's regime through real local clusters.

The incident behind kvferry hit prompts over 681,280 tokens against a 1,048,576-token
context. This check starts a cluster (replay model, shrunk to one layer, one KV head,
head dim 24 in fp16, so a million-token pool is 96 MiB: the model is small, the prompts are
not) for each case below, sends prompts with a unique marker up to the context length and
one just over the pool, and checks each one: answered with exactly its own replay (200),
or, only where it cannot fit, refused with 400 and the numbers; every pool all-free after.

    context 1,048,576, page 16: 681,281 and 1,048,000 tokens, and one past the pool
    context 2,097,152, page 16: the same, and one past its pool
    context 80,000,    page 1:  70,000 tokens (SGLang's default page size), and one past

One JSON line per prompt: its timings (the writer's prefill compute, the owner's wait from
its plan to the last notice, time to first token, total), then a summary line. Beside
each served prompt, the same run's raw engine write of its KV bytes (the transfer engine
between two processes, in page runs, no protocol, no checks: ``raw_transfer_ms``) and the
goal figure ``ttft_over_machine`` = ttft / max(prefill, raw transfer): what the protocol,
its checks and the handover cost on top of what the machine must do anyway. Time to first
token counts from the request's arrival at the router (its tokenizing and any wait for
pages included); the first token is the prefill's, sent on once the owner verified the
pages, and ``landed_to_first_token_ms`` is the time from the last notice's arrival at the
owner (every byte landed) to that token at the front door (the summary gives its p50).
And a decode step at that context (``step_ms``: the answer's time after its first token, per
token) beside the model's attention alone over a context as long (``attention_ms``, timed
in this process on a pool of the same shape, on as many torch threads as each rank of a
local cluster runs: ``attention_threads``), with ``step_over_attention``; and the same
attention on every core (``attention_ms_every_core``), which no rank of a local cluster
gets.

``--shape`` picks the model's KV shape: ``shrunk`` (above: 48 bytes a token), ``serve``
(the serve defaults: 1 layer, 2 KV heads, head dim 32, fp32: 512 bytes a token) or
``realistic`` (8 layers, 8 KV heads, head dim 128, bf16: 32 KiB a token). ``--prompts``
with ``--context-length`` serves those prompt lengths instead of the cases below.

``--decode-tp N`` decodes every prompt with a decode group of N members. ``--kv-layout
P:D`` lays the prefill ranks' pages out as P and the decode ranks' as D (HND or NHD).

    python -m kvferry.cluster.harness.longcontext [--only NAME] [--shape S]
        [--prompts N,N --context-length C] [--decode-tp N] [--kv-layout P:D] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .localcluster import RANK_THREADS, start
from .workload import expected_replay, make_prompt

MAX_TOKENS = 16


@dataclass(frozen=True)
class Shape:
    """A model's KV shape, as serve options."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def args(self) -> list[str]:
        return [
            *("--layers", str(self.layers)),
            *("--kv-heads", str(self.kv_heads), "--q-heads", str(self.kv_heads)),
            *("--head-dim", str(self.head_dim), "--dtype", self.dtype),
        ]


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
SHAPES = {
    "shrunk": Shape(1, 1, 24, "fp16"),
    "serve": Shape(1, 2, 32, "fp32"),
    "realistic": Shape(8, 8, 128, "bf16"),
}


@dataclass(frozen=True)
class Case:
    name: str
    context_length: int
    page_size: int
    prompts: tuple[int, ...]  # prompt lengths that must be served

    @property
    def over_pool(self) -> int:
        """A prompt one token past what the pool (as large as the context) can hold."""
        return self.context_length - MAX_TOKENS + 1


CASES = (
    Case("1m", 1 << 20, 16, (681_281, 1_048_000)),
    Case("2m", 1 << 21, 16, (681_281, 1_048_000)),
    Case("page1", 80_000, 1, (70_000,)),
)


def _layouts(text: str) -> tuple[str, str]:
    parts = text.upper().split(":")
    if len(parts) != 2 or not set(parts) <= {"HND", "NHD"}:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give the prefill and the decode layouts as PREFILL:DECODE, each HND "
            "or NHD (for instance NHD:HND)"
        )
    return parts[0], parts[1]


def check_case(
    case: Case,
    log_dir: Path,
    shape: Shape = SHAPES["shrunk"],
    raw: bool = False,
    decode_tp: int = 1,
    layouts: tuple[str, str] = ("HND", "HND"),
) -> list[dict]:
    """Serve every prompt of ``case`` on a fresh cluster; one result per prompt. ``raw``:
    also time the raw engine write of each served prompt's KV bytes. ``decode_tp``: the
    prompt is decoded by a decode group of that many members (each holding its share of
    the heads: pools of ``decode_tp`` x the context in tokens, as many bytes as one pool of
    every head; the prefill rank computes and holds the prompt once for all of them).
    ``layouts``: the (prefill, decode) ranks' page layouts."""
    args = [
        *shape.args(),
        "--context-length",
        str(case.context_length),
        "--pool-tokens",
        str(case.context_length * decode_tp),
        "--page-size",
        str(case.page_size),
        "--request-timeout",
        "600",
        "--prefill-kv-layout",
        layouts[0],
        "--kv-layout",
        layouts[1],
    ]
    if decode_tp > 1:
        args += ["--prefill", "1", "--decode-tp", str(decode_tp)]
    (log_dir / case.name).mkdir(parents=True, exist_ok=True)
    cluster = start(2 + decode_tp, args, log_dir / case.name, startup_s=180.0)
    results = []
    try:
        lengths = [*case.prompts, case.over_pool]
        for i, length in enumerate(lengths):
            marker = f"@{case.name}-{i}@"
            prompt = make_prompt(marker, length)
            t0 = time.monotonic()
            reply = cluster.complete(prompt, MAX_TOKENS, timeout=900)
            wall_ms = 1e3 * (time.monotonic() - t0)
            must_serve = length in case.prompts
            text = reply.body.get("text")
            ok = (
                reply.status == 200 and text == expected_replay(prompt, MAX_TOKENS)
                if must_serve
                else reply.status == 400
                and reply.body.get("requested_tokens") == length + MAX_TOKENS
            )
            timing = reply.body.get("timing", {})
            kv_bytes = length * shape.bytes_per_token
            results.append(
                {
                    "bench": "long_context",
                    "case": case.name,
                    "shape": shape.__dict__,
                    "decode_tp": decode_tp,
                    "kv_layout": ":".join(layouts),
                    "context_length": case.context_length,
                    "page_size": case.page_size,
                    "prompt_tokens": length,
                    "kv_bytes": kv_bytes,
                    "status": reply.status,
                    "expected": "served" if must_serve else "refused",
                    "ok": ok,
                    "prefill_ms": _round(timing.get("prefill_ms")),
                    "transfer_ms": _round(timing.get("transfer_ms")),
                    "ttft_ms": _round(timing.get("ttft_ms")),
                    "landed_to_first_token_ms": _round(timing.get("landed_to_first_token_ms"), 2),
                    "total_ms": round(wall_ms, 1),
                    "message": None if ok else str(reply.body)[:300],
                }
            )
            if must_serve and raw:
                results[-1].update(_against_machine(results[-1], case, shape))
                results[-1].update(_step_against_attention(timing, case, shape, length))
            print(json.dumps(results[-1]), flush=True)
        held = cluster.quiesce(timeout_s=60, every_rank=True)
        health = cluster.call("GET", "/health", timeout=10).status
        results.append(
            {
                "bench": "long_context",
                "case": case.name,
                "held_pages_after": held,
                "health": health,
                "ok": held == 0 and health == 200,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    finally:
        cluster.stop()
    return results


def _against_machine(result: dict, case: Case, shape: Shape) -> dict:
    """The raw engine write of the prompt's KV bytes, in page runs, timed here and now,
    and the goal figure: ttft over the larger of the prefill and that write."""
    from kvferry.transfer.tools.bench_transfer import raw_write_seconds

    page_bytes = case.page_size * shape.bytes_per_token
    pages = -(-result["kv_bytes"] // page_bytes)
    raw_ms = 1e3 * raw_write_seconds(pages * page_bytes, page_bytes)
    floor = max(result["prefill_ms"] or 0.0, raw_ms)
    ttft = result["ttft_ms"]
    return {
        "raw_transfer_ms": round(raw_ms, 1),
        "raw_gbps": round(pages * page_bytes / raw_ms / 1e6, 2),
        "ttft_over_machine": round(ttft / floor, 2) if ttft and floor else None,
    }


def _step_against_attention(timing: dict, case: Case, shape: Shape, prompt_len: int) -> dict:
    """A decode step of the served request (the answer's time after its first token, per
    token) beside the model's attention alone over a context as long, on a pool of the
    same shape in this process (every layer, through the same dispatch the rank uses):
    what the step costs beyond reading the pages."""
    import torch

    from kvferry.engine.pool import parse_dtype
    from kvferry.engine.replay import ReplayConfig, ReplayModel

    ttft, total = timing.get("ttft_ms"), timing.get("total_ms")
    step_ms = (total - ttft) / (MAX_TOKENS - 1) if ttft is not None and total else None
    context = prompt_len + MAX_TOKENS - 1  # the last step's context
    model = ReplayModel(
        ReplayConfig(
            layers=shape.layers,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            max_positions=case.context_length,
        )
    )
    pages = -(-context // case.page_size)
    config = model.pool_config(case.page_size, pages + 1, parse_dtype(shape.dtype))
    kv = torch.full(config.shape, 0.5, dtype=config.dtype)  # every page touched, as served
    table = torch.randperm(pages + 1)[None, :pages].to(torch.int32)  # pages as a pool hands them
    lens = torch.tensor([context], dtype=torch.int32)
    targets = torch.tensor([prompt_len - 1])

    def best_ms(threads: int) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.read_positions(kv, table, lens, targets)
                best = min(best, time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        return 1e3 * best

    # as the rank runs it: on its threads (a local cluster's ranks share the host's cores)
    attention_ms = best_ms(RANK_THREADS)
    every_core = torch.get_num_threads()
    return {
        "step_ms": _round(step_ms),
        "attention_ms": round(attention_ms, 1),
        "attention_threads": RANK_THREADS,
        "step_over_attention": round(step_ms / attention_ms, 2) if step_ms else None,
        "attention_ms_every_core": round(best_ms(every_core), 1),
        "every_core_threads": every_core,
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="long-context",
        description="Serve the incident's prompt lengths through local "
        "clusters; JSON lines, exit 1 if any check fails.",
    )
    parser.add_argument(
        "--only",
        choices=[c.name for c in CASES],
        action="append",
        help="run only this case (repeatable; default all)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the clusters' logs go (default a temporary folder)",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="shrunk",
        help="the model's KV shape (default shrunk: 48 bytes a token; serve: the serve "
        "defaults, 512; realistic: 8 layers, 8 KV heads, head dim 128, bf16, 32 KiB)",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="comma-separated prompt lengths to serve instead of the cases (with --context-length)",
    )
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="decode the prompts with a decode group of this many members (default 1)",
    )
    parser.add_argument(
        "--kv-layout",
        default="HND:HND",
        type=_layouts,
        help="the prefill and the decode ranks' page layouts, PREFILL:DECODE, each HND "
        "(heads-major) or NHD (token-major) (default %(default)s)",
    )
    parser.add_argument(
        "--no-raw",
        action="store_true",
        help="skip the raw engine write beside each prompt (and the goal figure)",
    )
    args = parser.parse_args(argv)
    if bool(args.prompts) != bool(args.context_length):
        parser.error("--prompts and --context-length go together")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-long-"))
    shape = SHAPES[args.shape]
    cases: tuple[Case, ...] = CASES
    if args.prompts:
        prompts = tuple(int(n) for n in args.prompts.split(","))
        cases = (Case("custom", args.context_length, args.page_size, prompts),)
    results = []
    for case in cases:
        if not args.only or case.name in args.only:
            results += check_case(
                case,
                log_dir,
                shape,
                raw=not args.no_raw,
                decode_tp=args.decode_tp,
                layouts=args.kv_layout,
            )
    failed = [r for r in results if not r["ok"]]
    handovers = [
        r["landed_to_first_token_ms"] for r in results if r.get("landed_to_first_token_ms")
    ]
    print(
        json.dumps(
            {
                "bench": "long_context",
                "summary": True,
                "checks": len(results),
                "failed": len(failed),
                "landed_to_first_token_ms_p50": (
                    round(statistics.median(handovers), 2) if handovers else None
                ),
                "logs": str(log_dir),
            }
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
