"""The harness judges a cluster on reports sent after the moment it asks about: a rank's
STATS already on its way (sent before the request that changed its pages or counters)
must not pass for the state after it. Stub front door: each /status call is one step of
the router's view; reports move on every call."""

from __future__ import annotations

from pathlib import Path

from kvferry.cluster.harness.localcluster import LocalCluster


class Stale(LocalCluster):
    """The router's view: the report in flight says nothing is held; the two after it
    (sent once the request was in) say rank 2 holds 5 pages, then still 5."""

    def __init__(self) -> None:
        super().__init__(proc=None, url="http://stub", log=Path("/dev/null"))  # type: ignore[arg-type]
        self.calls = 0

    def status(self) -> dict:
        self.calls += 1
        reports = {"1": 10 + self.calls, "2": 20 + self.calls}
        held = 0 if self.calls <= 2 else 5
        return {
            "reports": reports,
            "unhealthy": {},
            "held_pages": {},  # the router's ledger: nothing assigned through it
            "ranks": {"1": {"owned": 0, "quarantined": 0}, "2": {"owned": held, "quarantined": 0}},
        }


def test_quiesce_waits_for_reports_sent_after_it():
    c = Stale()
    assert c.quiesce(timeout_s=0.5) == 5
    assert c.calls >= 3


def test_broken_mode_quiesce_on_the_report_in_flight_is_caught():
    """Broken: quiesce reads the pool as the last report left it (no fresh reports)."""
    c = Stale()
    c.fresh_reports = lambda timeout_s=5.0: []  # type: ignore[method-assign]
    assert c.quiesce(timeout_s=0.5) == 0  # the stale report's "nothing held"


def test_a_rank_that_stopped_reporting_is_named_by_the_deadline():
    class Silent(Stale):
        def status(self) -> dict:
            st = super().status()
            st["reports"]["2"] = 20
            return st

    assert Silent().fresh_reports(timeout_s=0.3) == [2]
