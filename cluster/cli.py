"""The ``kvferry`` command line. Subcommands parse and print; the work lives in the packages.

``kvferry check-capacity`` builds a KV pool of ``--pool-tokens`` tokens with the given
shape, measures what was really allocated and compares it with ``--context-length``
(I3): exit 0 and both numbers when it fits, exit 1 and a message when it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _check_capacity(args: argparse.Namespace) -> int:
    from kvferry.engine.capacity import check_capacity
    from kvferry.engine.pool import PoolConfig

    config = PoolConfig.for_tokens(
        args.pool_tokens, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
        page_size=args.page_size, dtype=args.dtype, device=args.device,
    )
    report = check_capacity(config, args.context_length)
    if args.json:
        print(json.dumps(report.to_dict()))
    if report.ok:
        if not args.json:
            print(f"ok: {report.message()}")
        return 0
    print(
        f"error: {report.message()}. Enlarge the pool or lower the context length to at most "
        f"{report.measured_tokens}.",
        file=sys.stderr,
    )
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description="KV-cache page transfer for disaggregated inference")
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("check-capacity", help="build a KV pool, measure its capacity, compare with the context length")
    cap.add_argument("--context-length", type=int, required=True, help="declared context length in tokens")
    cap.add_argument("--pool-tokens", type=int, required=True, help="pool size to allocate, in tokens")
    cap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    cap.add_argument("--layers", type=int, default=1, help="layers per page (default 1: small, fast check)")
    cap.add_argument("--kv-heads", type=int, default=1, help="KV heads (default 1)")
    cap.add_argument("--head-dim", type=int, default=8, help="head dimension (default 8)")
    cap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="KV dtype (default bf16)")
    cap.add_argument("--device", default="cpu", help="torch device of the pool (default cpu)")
    cap.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    cap.set_defaults(func=_check_capacity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
