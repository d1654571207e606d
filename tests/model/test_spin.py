"""spin's verdicts on the abort-acknowledgement model (DESIGN.md, I4).

The protocol must verify (safety and liveness); each mutant must yield a
counterexample, which shows the checks can fail.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import spin_runner  # noqa: E402

pytestmark = pytest.mark.skipif(spin_runner.tools_missing() is not None,
                                reason=spin_runner.tools_missing() or "")


def _checks(model: str | None = None, prop: str | None = None) -> list:
    return [c for c in spin_runner.CHECKS
            if (model is None or (c.model == "protocol") == (model == "protocol"))
            and (prop is None or c.prop == prop)]


@pytest.mark.parametrize("check", _checks("protocol", "safety"), ids=lambda c: c.config)
def test_protocol_is_safe(check):
    verdict = spin_runner.run_check(check)
    assert verdict.errors == 0, verdict.output[-3000:]
    assert not verdict.trail
    assert verdict.states > 1000          # a real search, not a trivial one


def test_every_page_is_eventually_freed():
    (check,) = _checks("protocol", "liveness")
    verdict = spin_runner.run_check(check)
    assert "acceptance   cycles \t+ (fairness enabled)" in verdict.output
    assert "ltl every_page_freed" in verdict.output or "never claim" in verdict.output
    assert verdict.errors == 0, verdict.output[-3000:]


@pytest.mark.parametrize("check", [c for c in spin_runner.CHECKS if c.expect_errors],
                         ids=lambda c: c.model)
def test_mutant_yields_counterexample(check):
    verdict = spin_runner.run_check(check)
    assert verdict.errors > 0, verdict.output[-3000:]
    assert verdict.trail
    assert "assertion violated" in verdict.output
