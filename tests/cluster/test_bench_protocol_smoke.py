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


def test_the_window_counts_the_steady_state_and_leaves_out_the_drain():
    """The last completions of a closed loop let nothing in after them: in the raw case
    their bytes were copied before they finished, so counting them would credit the raw
    case with time it did not spend (about 5 % at 4 in flight)."""
    from kvferry.cluster.harness.benchprotocol import Window

    window = Window(warm=2, last=5)
    for done in range(1, 9):  # completions 1-2: warm-up, 3-5: measured, 6-8: the drain
        window.finished(done, latency=float(done))
    seconds, latencies = window.result()
    assert latencies == [3.0, 4.0, 5.0]
    assert 0 < seconds == window.closed - window.opened
