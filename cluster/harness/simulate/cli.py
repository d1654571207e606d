"""``python -m kvferry.cluster.harness.simulate``: run scenarios, print JSON lines, then a
table; or ``--validate`` against the real local cluster."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from . import metrics, scenarios
from .network import LATENCIES
from .world import run


def _list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = list(choices) if text == "all" else text.split(",")
        bad = [i for i in items if i not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad}: choose from {', '.join(choices)} or all")
        return items

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvferry simulate",
        description=(
            "Discrete-event simulation of the abort protocol with the ranks' own code "
            "(the protocol core's tables, the real page allocator) at 10x10, 100x100 and "
            "1000x1000 ranks: one JSON line per scenario, then a table."
        ),
    )
    p.add_argument("--scale", type=_list(tuple(scenarios.SCALES)), default=list(scenarios.SCALES))
    p.add_argument("--scenario", type=_list(scenarios.NAMES), default=list(scenarios.NAMES))
    p.add_argument(
        "--mode",
        type=_list(scenarios.MODES),
        default=list(scenarios.MODES),
        help="safe, unsafe (owner_table(unsafe=True): free at abort), release-on-sever, all",
    )
    p.add_argument("--requests", type=int, help="requests a run (default: by scale)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tp", type=int, default=2, help="prefill ranks (writers) a request")
    p.add_argument("--network", choices=sorted(LATENCIES), default="local")
    p.add_argument("--loss", type=float, default=0.0, help="share of messages lost")
    p.add_argument("--dup", type=float, default=0.0, help="share of messages duplicated")
    p.add_argument("--reorder", type=float, default=0.0, help="share of messages held back")
    p.add_argument("--no-table", action="store_true")
    p.add_argument(
        "--no-service-model",
        action="store_true",
        help="ranks take no time: every event runs the instant it arrives, computes and "
        "decode steps occupy no rank (the model before the service model, for comparison)",
    )
    p.add_argument(
        "--partition-deadlines",
        type=float,
        help="partition: its length in abort deadlines (default 2)",
    )
    p.add_argument(
        "--failure-horizon",
        type=float,
        help="seconds the transport retransmits through a partition before it gives up "
        "(default: the engine's tcp horizon); past the abort deadline, as a long tcp "
        "keep-alive, a write stuck in a partition can still land after the deadline",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the service model's figures on this machine (one JSON line)",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="the 1x1 and 2x2 cases against the real local cluster (bench-abort)",
    )
    p.add_argument("--validate-requests", type=int, default=100)
    p.add_argument("--log-dir", help="the real clusters' logs (--validate)")
    args = p.parse_args(argv)
    if args.calibrate:
        from .calibrate import main as calibrate

        calibrate()
        return 0
    if args.validate:
        from .validate import main as validate

        validate(args.validate_requests, args.log_dir)
        return 0
    rows: list[dict[str, Any]] = []
    for scale in args.scale:
        for name in args.scenario:
            for mode in args.mode:
                sc = scenarios.build(
                    name,
                    scale,
                    requests=args.requests,
                    mode=mode,
                    seed=args.seed,
                    network=args.network,
                    loss=args.loss,
                    dup=args.dup,
                    reorder=args.reorder,
                    tp=args.tp,
                    service=not args.no_service_model,
                    partition_deadlines=args.partition_deadlines,
                    failure_horizon_s=args.failure_horizon,
                )
                row = run(sc)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if not args.no_table:
        print(metrics.table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
