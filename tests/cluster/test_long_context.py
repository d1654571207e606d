"""The long-context check in CI (see kvferry.cluster.harness.longcontext): the incident's prompt
lengths, served or refused with 400, every pool all-free after. Each case prints its
timings as JSON lines (pytest -s shows them)."""

from __future__ import annotations

import json

import pytest

from kvferry.cluster.harness.longcontext import CASES, check_case

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_long_prompts_are_served_or_refused_and_leave_nothing_held(case, tmp_path):
    """The smallest case also times the raw engine write of each served prompt's bytes
    beside it, the goal figure over it, and a decode step beside attention alone."""
    raw = case.name == "page1"
    results = check_case(case, tmp_path, raw=raw)
    failed = [r for r in results if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    served = [r for r in results if r.get("expected") == "served"]
    assert [r["prompt_tokens"] for r in served] == list(case.prompts)
    assert all(r["status"] == 200 for r in served)
    if raw:
        assert all(r["raw_transfer_ms"] > 0 and r["ttft_over_machine"] > 0 for r in served)
        assert all(r["step_ms"] > 0 and r["attention_ms"] > 0 for r in served)
    refused = [r for r in results if r.get("expected") == "refused"]
    assert len(refused) == 1 and refused[0]["status"] == 400
