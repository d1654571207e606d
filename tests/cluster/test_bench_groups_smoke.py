"""The decode-group benchmark runs end to end (a tiny size): it starts real clusters of
the llama model with and without a decode group, so an interface change that breaks it
fails here rather than when an operator runs scripts/bench-decode-groups.sh. No figure is
asserted; that the answers were checked and nothing stayed held is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_decode_group_benchmark_runs_and_prints_a_ratio(tmp_path):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    small = ["--rounds", "1", "--requests", "1", "--prompt", "64", "--tokens", "6"]
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.cluster.harness.benchgroups", *small, "--layers", "1",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["case"] for line in lines] == ["single", "group-2", "ratio"]
    assert all(line["answers_checked"] and line["pages_held_after"] == 0 for line in lines[:2])
    assert lines[2]["group_over_single"] > 0
