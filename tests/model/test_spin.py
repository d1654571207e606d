"""spin's verdicts on the abort-acknowledgement model (engine/protocol/README.md, I4).

The protocol must verify (safety, and liveness under weak fairness), with one
writer set for every owner, with a writer set that differs per owner (the
split) and on the pipelined path (parts); each mutant must yield a
counterexample, which shows the checks can fail;
and the two limits the README states (a crashed remote writer, a write landing
after its process is gone) must show up as counterexamples too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import spin_runner

pytestmark = pytest.mark.skipif(
    spin_runner.tools_missing() is not None, reason=spin_runner.tools_missing() or ""
)


def _checks(model: str | None = None, prop: str | None = None) -> list:
    return [
        c
        for c in spin_runner.CHECKS
        if (model is None or (c.model == "protocol") == (model == "protocol"))
        and (prop is None or c.prop == prop)
    ]


@pytest.mark.parametrize("check", _checks("protocol", "safety"), ids=lambda c: c.config)
def test_protocol_is_safe(check):
    verdict = spin_runner.run_check(check)
    assert verdict.errors == 0, verdict.output[-3000:]
    assert not verdict.trail
    assert verdict.states > 1000  # a real search, not a trivial one


@pytest.mark.parametrize("check", _checks("protocol", "liveness"), ids=lambda c: c.config)
def test_every_page_is_eventually_freed(check):
    """Under weak fairness: a stalled writer eventually resumes or crashes. A check
    without fairness verifies that no infinite run at all keeps a page quarantined."""
    verdict = spin_runner.run_check(check)
    fairness = "enabled" if check.fair else "disabled"
    assert f"acceptance   cycles \t+ (fairness {fairness})" in verdict.output
    assert "ltl every_page_freed" in verdict.output or "never claim" in verdict.output
    assert verdict.errors == 0, verdict.output[-3000:]


def test_remote_crash_keeps_the_page_quarantined():
    """A crashed writer on another host can never be proven gone: the page stays
    quarantined (safe, counted as used), so "every page is eventually freed" fails."""
    (check,) = [c for c in spin_runner.CHECKS if c.model == "remote_crash_quarantines"]
    verdict = spin_runner.run_check(check)
    assert verdict.errors > 0, verdict.output[-3000:]
    assert "acceptance cycle" in verdict.output


_MUTANTS = [
    c for c in spin_runner.CHECKS if c.expect_errors and c.model != "remote_crash_quarantines"
]


COUNTEREXAMPLE = {"safety": "assertion violated", "liveness": "acceptance cycle"}


@pytest.mark.parametrize("check", _MUTANTS, ids=lambda c: f"{c.model}-{c.prop}")
def test_mutant_yields_counterexample(check):
    """A safety mutant violates an assertion; a liveness mutant has an acceptance cycle.
    The split's mutants that wait for fewer writers than write into owner 0's pages
    let the other writer's write land there: in request 1's page or under the reader."""
    verdict = spin_runner.run_check(check)
    assert verdict.errors > 0, verdict.output[-3000:]
    assert verdict.trail
    assert COUNTEREXAMPLE[check.prop] in verdict.output
    assert re.search(check.witness, verdict.output), verdict.output[-3000:]


def test_release_on_sever_leaks_into_the_next_request():
    """The bug found on the real system: releasing at the deadline once severed lets
    the severed writer's write land in the page the next request now holds (I4)."""
    (check,) = [c for c in spin_runner.CHECKS if c.model == "release_on_sever"]
    verdict = spin_runner.run_check(check)
    assert "assertion violated (powner[0]==0)" in verdict.output, verdict.output[-3000:]


def test_ack_one_owner_quarantines_but_never_leaks():
    """A writer that acks only one of its owners costs the other owner its page (the
    liveness counterexample), never a leak: that owner keeps waiting for the ack."""
    (check,) = [c for c in spin_runner.CHECKS if c.model == "ack_one_owner" and c.prop == "safety"]
    verdict = spin_runner.run_check(check)
    assert verdict.errors == 0, verdict.output[-3000:]
    assert verdict.states > 1000
