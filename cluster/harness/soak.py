"""Soak: thousands of requests with random client aborts and injected control-plane faults
(dropped, duplicated, delayed and reordered protocol messages; writes held in flight)
through a real local cluster (replay model). Checks: every request is answered (text or
error) before the client's deadline, no answer holds another request's marker or is a
wrong replay, and every rank's pool returns to all-free. Prints the workload's table and,
last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from kvferry.engine.protocol.proof import is_justified

from . import workload
from .faultsuite import start

TAG = "~soak-hold~"
FAULTS = [
    "drop:ABORT_ACK:0.3",
    "drop:ABORT:0.2",
    "dup:NOTICE",
    "dup:ABORT",
    "delay:ABORT_ACK:0.02",
    "reorder:ABORT_ACK",
    f"at:mid-transfer:pause:{TAG}:0.5",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--log-dir")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster_args = [a for f in FAULTS for a in ("--fault", f)]
    cluster = start(args.nproc, cluster_args, log_dir)
    try:
        wargs = workload.build_parser().parse_args(
            [
                "--url",
                cluster.url,
                "--requests",
                str(args.requests),
                "--users",
                "40",
                "--concurrency",
                str(args.concurrency),
                "--context-length",
                "2048",
                "--min-prompt",
                "24",
                "--max-prompt",
                "160",
                "--oversize-every",
                "25",
                "--cancel-every",
                "5",
                "--cancel-after",
                "0.05",
                "--timeout",
                "60",
                "--tag",
                TAG,
                "--tag-every",
                "7",
                "--quiesce-timeout",
                "30",
            ]
        )
        result = asyncio.run(workload.run(wargs))
        releases = cluster.releases()
    finally:
        cluster.stop()
    result["release_justifications"] = releases
    result["unjustified_releases"] = sum(n for k, n in releases.items() if not is_justified(k))
    clean = (
        result["foreign_markers"] == 0
        and result["wrong_answers"] == 0
        and result["leaked_pages"] == 0
        and result["unjustified_releases"] == 0
        and sum(releases.values()) > 0
    )
    unanswered = sum(
        1 for j in result["_jobs"] if j.outcome == "failed" and (j.error or "").startswith("client")
    )
    result["unanswered"] = unanswered
    workload.print_report(result)
    print(f"cluster log: {log_dir}", file=sys.stderr)
    return 0 if clean and unanswered == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
