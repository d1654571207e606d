"""The fault suite (kvferry.cluster.faultsuite) through real local clusters: every scenario
green in normal mode; every mid-transfer scenario leaks in unsafe mode, which shows the
suite can fail."""
from __future__ import annotations

import pytest

from kvferry.cluster.faultsuite import run_suite, scenarios

pytestmark = pytest.mark.slow


def test_fault_suite_green_and_unsafe_mode_leaks(tmp_path, capsys):
    report = run_suite(unsafe_too=True, log_dir=tmp_path)
    summary, results = report["summary"], report["results"]
    failures = [(r.scenario, r.problems) for r in results if not r.unsafe and not r.passed]
    assert failures == []
    assert summary["scenarios"] == len(scenarios()) == summary["passed"]
    unsafe = [r for r in results if r.unsafe]
    expected_unsafe = {s.name for s in scenarios() if s.mid_transfer and s.source != "crash"}
    assert {r.scenario for r in unsafe} == expected_unsafe
    assert [r.scenario for r in unsafe if not r.leak] == []
    assert summary["unsafe_leaks_found"] == summary["unsafe_scenarios"] == len(expected_unsafe)
    safe = [r for r in results if not r.unsafe]
    assert all(not r.foreign and r.held_after == 0 and r.answered_in_time for r in safe)


def test_scenario_matrix_covers_every_source_and_point():
    names = {s.name for s in scenarios()}
    for source in ("client", "prefill", "transfer", "decode"):
        for point in ("before-write", "mid-transfer", "after-write"):
            assert f"{source}@{point}" in names
    assert {"client@after-notice", "admission@before-write", "integrity@after-notice",
            "crash@mid-transfer", "stall@mid-transfer"} <= names
    tags = [s.tag for s in scenarios()]
    assert all(a == b or a not in b for a in tags for b in tags), "no tag contains another"
