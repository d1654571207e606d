"""The ``kvferry`` command line. Subcommands parse and print; the work lives in the packages.

``kvferry serve`` runs one rank under torchrun, or starts a one-machine cluster under
``torchrun --standalone`` when run outside torchrun. ``kvferry workload`` drives a running
cluster with concurrent users and checks every answer for foreign data: it replaces this
process with ``python -m kvferry.cluster.harness.workload`` (harness, not imported here).
``kvferry cluster-capacity`` asks a live cluster for every rank's measured pool capacity.
``kvferry domains`` runs a cluster (or one host's ranks) as failure domains, one torchrun job
per role group (:mod:`kvferry.cluster.domains`); ``kvferry store`` hosts the rendezvous store
they meet through (:mod:`kvferry.cluster.store`).

``kvferry secret`` prints a new cluster secret (64 hex digits) for ``--secret-file``:
``kvferry secret > cluster.secret`` (the file is made readable by its owner only when
the shell's umask allows; ``chmod 600`` it).

``kvferry check-capacity`` builds a KV pool of ``--pool-tokens`` tokens with the given
shape, measures what was really allocated and compares it with ``--context-length``
(I3): exit 0 and both numbers when it fits, exit 1 and a message when it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _check_capacity(args: argparse.Namespace) -> int:
    from kvferry.engine.capacity import check_capacity
    from kvferry.engine.pool import PoolConfig

    config = PoolConfig.for_tokens(
        args.pool_tokens,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=args.dtype,
        device=args.device,
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
    parser = argparse.ArgumentParser(
        prog="kvferry", description="KV-cache page transfer for disaggregated inference"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser(
        "check-capacity",
        help="build a KV pool, measure its capacity, compare with the context length",
    )
    cap.add_argument(
        "--context-length", type=int, required=True, help="declared context length in tokens"
    )
    cap.add_argument(
        "--pool-tokens", type=int, required=True, help="pool size to allocate, in tokens"
    )
    cap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    cap.add_argument(
        "--layers", type=int, default=1, help="layers per page (default 1: small, fast check)"
    )
    cap.add_argument("--kv-heads", type=int, default=1, help="KV heads (default 1)")
    cap.add_argument("--head-dim", type=int, default=8, help="head dimension (default 8)")
    cap.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="KV dtype (default bf16)"
    )
    cap.add_argument("--device", default="cpu", help="torch device of the pool (default cpu)")
    cap.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    cap.set_defaults(func=_check_capacity)

    serve = sub.add_parser(
        "serve",
        add_help=False,
        help="serve a cluster (under torchrun, or a local one with --nproc)",
    )
    serve.set_defaults(func=_serve)
    work = sub.add_parser(
        "workload",
        add_help=False,
        help="run concurrent users against a cluster and check for leaks",
    )
    work.set_defaults(func=_workload)
    for name, what in (
        ("domains", "run a cluster as failure domains: one torchrun job per role group"),
        ("store", "host the rendezvous store a cluster's failure domains meet through"),
    ):
        sub.add_parser(name, add_help=False, help=what).set_defaults(func=_passthrough)
    sec = sub.add_parser(
        "secret", help="print a new cluster secret, for --secret-file (kvferry secret > FILE)"
    )
    sec.set_defaults(func=_secret)
    live = sub.add_parser(
        "cluster-capacity", help="every rank's measured pool capacity vs the context length"
    )
    live.add_argument("--url", default="http://127.0.0.1:8000", help="the router's URL")
    live.add_argument("--json", action="store_true", help="print the answer as one JSON line")
    live.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    live.add_argument(
        "--api-key-file",
        default=None,
        help="the front door's API key (else KVFERRY_API_KEY), when it has one",
    )
    live.set_defaults(func=_cluster_capacity)
    return parser


def _serve(args: argparse.Namespace) -> int:
    import os

    rest = list(args.rest)
    if "RANK" in os.environ or "-h" in rest or "--help" in rest:
        from kvferry.cluster.launch import main as launch_main

        if "-h" in rest or "--help" in rest:
            print(
                "Outside torchrun, `kvferry serve --nproc N [options]` starts a local cluster "
                "of N ranks with torchrun --standalone.\n"
            )
            rest = [a for a in rest if a not in ("--nproc",)]
        return launch_main(rest)
    nproc = 3
    if "--nproc" in rest:
        i = rest.index("--nproc")
        nproc = int(rest[i + 1])
        del rest[i : i + 2]
    if not any(a == "--secret-file" or a.startswith("--secret-file=") for a in rest):
        from kvferry.cluster.trust import with_secret

        # one host (torchrun --standalone): a fresh secret for this cluster's ranks
        os.environ.update(with_secret(dict(os.environ)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "kvferry.cluster.launch",
        *rest,
    ]
    os.execv(sys.executable, cmd)
    return 0  # not reached


def _workload(args: argparse.Namespace) -> int:
    # The workload generator is harness, which the service never imports: run it as its own
    # program (the same one ``python -m kvferry.cluster.harness.workload`` starts).
    import os

    cmd = [sys.executable, "-m", "kvferry.cluster.harness.workload", *args.rest]
    os.execv(sys.executable, cmd)
    return 0  # not reached


def _passthrough(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"kvferry.cluster.{args.command}")
    return int(module.main(args.rest))


def _secret(args: argparse.Namespace) -> int:
    from kvferry.cluster.trust import generate_secret

    print(generate_secret())
    return 0


def _cluster_capacity(args: argparse.Namespace) -> int:
    import os
    import urllib.request

    from kvferry.cluster.trust import TrustError, api_key_from

    try:
        key = api_key_from(None, args.api_key_file, os.environ)
    except TrustError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{args.url}/capacity", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            body = json.load(resp)
    except OSError as exc:
        print(f"error: cannot reach {args.url}/capacity: {exc}", file=sys.stderr)
        return 2
    rows = body["ranks"]
    short = [r for r in rows if not r["ok"]]
    if args.json:
        print(json.dumps(body))
    else:
        columns = ("rank", "role", "host", "capacity_tokens", "context_length")
        print("{:>4}  {:<8} {:<28} {:>15} {:>14}  ok".format(*columns))
        for r in rows:
            print(
                f"{r['rank']:>4}  {r['role']:<8} {r['host'][:28]:<28} {r['capacity_tokens']:>15} "
                f"{r['context_length']:>14}  {'yes' if r['ok'] else 'NO'}"
            )
    if short:
        print(
            f"error: {len(short)} rank(s) hold fewer tokens than the context length "
            f"{body['context_length']}: ranks {[r['rank'] for r in short]}",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "workload"):
        args = argparse.Namespace(rest=argv[1:], func=_serve if argv[0] == "serve" else _workload)
    elif argv and argv[0] in ("domains", "store"):
        args = argparse.Namespace(rest=argv[1:], command=argv[0], func=_passthrough)
    else:
        args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
