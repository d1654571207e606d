"""The one receive filter (kvferry.cluster.receive), which the rank runtime and the
simulator's runtime both apply: what is refused, and the one exception (a severed
writer's ABORT_ACK, the proof its owner waits for)."""

from __future__ import annotations

import pytest

from kvferry.cluster.receive import Refusal, refusal


@pytest.mark.parametrize(
    "kind,inc,current,severed,want",
    [
        ("NOTICE", 7, 7, False, None),
        ("NOTICE", 6, 7, False, Refusal.STALE),  # a restarted sender's old self
        ("NOTICE", 7, None, False, Refusal.STALE),  # a sender this rank never met
        ("NOTICE", 7, 7, True, Refusal.SEVERED),
        ("PLAN", 7, 7, True, Refusal.SEVERED),
        ("ABORT_ACK", 7, 7, True, None),  # a severed writer's late ack still counts
        ("ABORT_ACK", 6, 7, True, Refusal.STALE),  # but not its old incarnation's
    ],
)
def test_what_a_rank_refuses_unread(kind, inc, current, severed, want):
    assert refusal(kind, inc, current, severed) is want


def test_both_runtimes_apply_this_filter():
    """The service's runtime and the simulator's call this function rather than keeping
    a rule of their own (read from the source: a change of either that drops the call
    is caught here)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for rel in ("cluster/runtime.py", "cluster/harness/simulate/ranks.py"):
        text = (root / rel).read_text()
        assert "refusal(" in text and '!= "ABORT_ACK"' not in text, rel
        assert "!= Kind.ABORT_ACK" not in text, rel
