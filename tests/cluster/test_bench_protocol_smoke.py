"""The protocol benchmark runs end to end with the ranks' current API (a tiny size): it
drives the real prefill and decode ranks, so an interface change that breaks it fails
here rather than when an operator runs scripts/bench-protocol.sh. No figure is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_protocol_benchmark_runs_and_prints_its_three_lines():
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry.cluster.harness.benchprotocol",
            "--requests",
            "4",
            "--pages",
            "4",
            "--cycles",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["case"] for line in lines] == ["raw", "protocol", "ratio"]
    assert lines[2]["protocol_over_raw"] > 0
