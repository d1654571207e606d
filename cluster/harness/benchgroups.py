"""What a llama decode group that splits the KV heads costs per answer token, against one
decode rank holding every head, through real local clusters in alternating rounds.

Cases: ``single`` (``--decode-tp 1``: router, a prefill rank, a decode rank) and
``group-N`` (``--decode-tp N``: the decode rank's place taken by a group of N, whose lead
asks every member for its heads' attention at each layer of each step; see
:mod:`kvferry.cluster.group_decode`). Each round starts each case's cluster in turn and
sends the same ``--requests`` prompts one at a time. The prompts are picked beforehand
with the monolithic engine so that each answer runs to ``--tokens`` (the random model
stops at its end token otherwise), and every answer is checked against it.

Per case and round, one JSON line: ``ms_per_token`` (p50 over the requests of the answer's
time after its first token, per token: the decode step), ``ttft_ms`` (p50), and
``answers_checked``. Then per round a ``ratio`` line: ``group_over_single``, the group's
ms per token over the single rank's. On a machine with fewer cores than ranks the group's
members share cores with each other and with the lead, and the figure is an upper bound.

    python -m kvferry.cluster.harness.benchgroups [--decode-tp N] [--rounds R]
        [--requests K] [--prompt P] [--tokens T] [--layers L] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ..config import ServeConfig
from ..models import monolithic_engine
from .localcluster import start
from .workload import make_prompt

KV_HEADS, Q_HEADS, HEAD_DIM = 4, 8, 64
CONTEXT = 4096


def _config(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model="llama",
        layers=args.layers,
        kv_heads=KV_HEADS,
        q_heads=Q_HEADS,
        head_dim=HEAD_DIM,
        context_length=CONTEXT,
        pool_tokens=4 * CONTEXT,
    )


def pick_prompts(cfg: ServeConfig, count: int, length: int, tokens: int) -> list[tuple[str, str]]:
    """``count`` (prompt, answer) pairs whose monolithic answer is ``tokens`` long."""
    engine = monolithic_engine(cfg)
    picked: list[tuple[str, str]] = []
    for i in range(200 * count):
        prompt = make_prompt(f"@{i:05x}@", length)
        (result,) = engine.generate([(f"pick{i}", prompt, tokens)])
        if result.ok and len(result.tokens) == tokens:
            picked.append((prompt, result.text))
            if len(picked) == count:
                return picked
    raise RuntimeError(f"only {len(picked)} of {200 * count} prompts ran to {tokens} tokens")


def _case_args(cfg: ServeConfig, decode_tp: int) -> tuple[int, list[str]]:
    args = [
        "--model", "llama", "--layers", str(cfg.layers), "--kv-heads", str(KV_HEADS),
        "--q-heads", str(Q_HEADS), "--head-dim", str(HEAD_DIM),
        "--context-length", str(CONTEXT), "--pool-tokens", str(cfg.pool_tokens),
        "--prefill", "1", "--decode-tp", str(decode_tp),
    ]  # fmt: skip
    return 2 + decode_tp, args


def run_case(
    name: str, decode_tp: int, cfg: ServeConfig, prompts, tokens: int, log_dir: Path
) -> dict:
    nproc, args = _case_args(cfg, decode_tp)
    (log_dir / name).mkdir(parents=True, exist_ok=True)
    cluster = start(nproc, args, log_dir / name)
    try:
        cluster.complete(prompts[0][0], 4)  # warm: the endpoints, the model's first run
        per_token, ttft, checked = [], [], True
        for prompt, answer in prompts:
            reply = cluster.complete(prompt, tokens, timeout=120)
            if reply.status != 200:
                raise RuntimeError(f"{name}: {reply.status} {reply.body}")
            checked &= reply.body["text"] == answer
            timing, count = reply.body["timing"], reply.body["usage"]["completion_tokens"]
            ttft.append(timing["ttft_ms"])
            per_token.append((timing["total_ms"] - timing["ttft_ms"]) / max(1, count - 1))
        held = cluster.quiesce()
    finally:
        cluster.stop()
    return {
        "bench": "decode-groups",
        "case": name,
        "decode_tp": decode_tp,
        "layers": cfg.layers,
        "requests": len(prompts),
        "ms_per_token": round(statistics.median(per_token), 3),
        "ttft_ms": round(statistics.median(ttft), 2),
        "answers_checked": checked,
        "pages_held_after": held,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-tp", type=int, default=2, help="the group's size (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--requests", type=int, default=4, help="per case and round (default 4)")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens (default 64)")
    parser.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.decode_tp < 2 or args.tokens < 2:
        parser.error("--decode-tp and --tokens must be at least 2")
    cfg = _config(args)
    prompts = pick_prompts(cfg, args.requests, args.prompt, args.tokens)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvferry-groups-"))
    group = f"group-{args.decode_tp}"
    ok = True
    for r in range(1, args.rounds + 1):
        rows = {}
        for name, tp in (("single", 1), (group, args.decode_tp)):
            rows[name] = run_case(name, tp, cfg, prompts, args.tokens, log_dir / f"round{r}")
            ok &= rows[name]["answers_checked"] and rows[name]["pages_held_after"] == 0
            print(json.dumps({"round": r, **rows[name]}), flush=True)
        ratio = rows[group]["ms_per_token"] / rows["single"]["ms_per_token"]
        print(json.dumps({"round": r, "bench": "decode-groups", "case": "ratio",
                          "group_over_single": round(ratio, 3)}), flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
