"""Failure rules of the router and the runtime, no processes.

- A rank an owner severed is never routed to again in its incarnation, even when its
  heartbeat comes back (broken mode: the old router, which ignored SEVERED for a rank its
  heartbeat check had marked, and cleared the mark when the beats resumed).
- A lost writer aborts the requests whose pages may not all have arrived, not those
  already decoding (broken mode: every request it touched is aborted).
- A message too big to send fails its request and leaves the peer healthy (broken mode:
  the size error reported as the peer's failure, which took a prefill rank out).
- An exception in a handler ends the request it was handling (broken mode: swallowed).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_cluster_units import _Engine, _runtime
from test_protocol_units import RecordingRuntime, _card

from kvferry.cluster import messages as m
from kvferry.cluster.faults import FaultPlan
from kvferry.cluster.metrics import ClusterMetrics
from kvferry.cluster.router import HEARTBEAT_TIMEOUT_S, Router
from kvferry.cluster.runtime import LocalSendError, RankRuntime
from kvferry.cluster.topology import Topology
from kvferry.engine.lifecycle import RequestState
from kvferry.engine.protocol.words import Kind
from kvferry.transfer import WireError

STATS = dict(
    free=64,
    owned=0,
    quarantined=0,
    capacity_tokens=1024,
    context_length=1024,
    bytes_written=0,
    batches=0,
    integrity_failures=0,
    severed=0,
    allocations=0,
    dropped_duplicate=0,
    dropped_stale=0,
    dropped_malformed=0,
)


def _router(prefill: int = 2):
    cards = {0: _card(0, "router")}
    cards.update({r: _card(r, "prefill") for r in range(1, prefill + 1)})
    cards[prefill + 1] = _card(prefill + 1, "decode")
    rt = RecordingRuntime(rank=0, cards=cards)
    router = Router(
        rt,
        Topology(prefill + 2, prefill, 1),
        cards,
        context_length=1024,
        request_timeout_s=30,
        admission_wait_s=0.05,
        metrics=ClusterMetrics(),
    )
    # As if every rank had reported, without the STATS (a test's first STATS is its
    # own); the reports' rule has its own test (test_protocol_units: a router admits
    # nothing until every live rank has reported)
    router.awaiting_reports.clear()
    return router, rt


def _old_on_severed(self, rank, incarnation, reason):
    """The router before the contract: a rank already marked for a missed heartbeat
    ignored the SEVERED, and nothing remembered it."""
    self._on_rank_lost(rank, reason)


def _old_on_stats(self, msg):
    if msg.src in self.unhealthy and self.unhealthy[msg.src].startswith("no heartbeat"):
        del self.unhealthy[msg.src]


@pytest.mark.parametrize("contract", [True, False], ids=["contract", "broken-rejoins"])
def test_a_severed_rank_is_never_routed_to_again_whatever_its_heartbeat(contract, monkeypatch):
    if not contract:
        monkeypatch.setattr(Router, "_on_severed", _old_on_severed)
        monkeypatch.setattr(Router, "_on_stats", _old_on_stats)

    async def run():
        router, rt = _router(prefill=2)
        router.last_seen[1] = time.monotonic() - 2 * HEARTBEAT_TIMEOUT_S  # rank 1 stalled
        router.check_heartbeats()
        assert 1 in router.unhealthy
        rt.deliver(m.SEVERED, src=3, peer_rank=1, incarnation=1, reason="no ABORT_ACK")
        rt.deliver(m.STATS, src=1, **STATS)  # it resumed
        writers = []
        for i in range(8):
            routed = await router.submit(f"request {i}", 4)
            writers += routed.writers
        return router, writers

    router, writers = asyncio.run(run())
    if not contract:
        assert 1 in writers  # the test catches the rank routed to again
        return
    assert 1 not in writers and writers == [2] * 8
    assert "severed" in router.unhealthy[1] and router.status()["severed"] == [1]


@pytest.mark.parametrize("spared", [True, False], ids=["decoding-spared", "broken-all-aborted"])
def test_a_lost_writer_aborts_only_the_requests_still_waiting_for_its_pages(spared, monkeypatch):
    if not spared:

        def old(self, rank, reason):
            self.unhealthy[rank] = reason
            for r in list(self.requests.values()):
                if r.req.live and rank in (r.owner, *r.writers):
                    self.abort(r.rid, "peer", reason)

        monkeypatch.setattr(Router, "_on_rank_lost", old)

    async def run():
        router, rt = _router(prefill=1)
        decoding = await router.submit("already decoding", 8)
        waiting = await router.submit("still waiting", 8)
        rt.deliver(m.TOKENS, src=2, rid=decoding.rid, offset=0, tokens=[97])
        rt.deliver(m.SEVERED, src=2, peer_rank=1, incarnation=1, reason="no ABORT_ACK")
        return decoding, waiting

    decoding, waiting = asyncio.run(run())
    assert waiting.outcome == "failed" and "severed" in waiting.error
    if not spared:
        assert decoding.outcome == "failed"  # the test catches the needless abort
        return
    assert decoding.req.state is RequestState.DECODING and decoding.outcome is None


@pytest.mark.parametrize("local", [True, False], ids=["local-error", "broken-peer-blamed"])
def test_a_message_too_big_to_send_fails_its_request_not_the_peer(local, monkeypatch):
    engine = _Engine()

    def too_big(peer, payload):
        raise WireError(f"payload of {len(payload)} bytes exceeds max_message_bytes 4194304")

    engine.send = too_big
    rt = _runtime(engine)
    blamed: list[int] = []
    rt.on_send_failure = lambda rank, exc: blamed.append(rank)
    if not local:  # the old runtime: every TransferError on the way is the peer's
        monkeypatch.setattr(
            RankRuntime,
            "_guarded",
            lambda self, rank, kind, op: self._send_failed(rank, kind, WireError("too big")),
        )
        rt.send(1, m.SHUTDOWN)
        assert blamed == [1]  # the test catches the healthy peer marked lost
        return
    with pytest.raises(LocalSendError, match="SHUTDOWN to rank 1 not sent: payload of"):
        rt.send(1, m.SHUTDOWN)
    assert blamed == []


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "broken-swallowed"])
def test_an_exception_in_a_handler_ends_the_request_it_was_handling(ended):
    engine = _Engine()
    rt = _runtime(engine)
    if not ended:
        rt.faults = FaultPlan.parse(["swallow-errors"])
    failed: list[tuple[str, str]] = []
    rt.on_request_error = lambda rid, reason: failed.append((rid, reason))

    def handler(msg):
        raise KeyError("no such page")

    rt.set_handlers({k: handler for k in Kind}, role="test")
    engine.arriving.append(
        rt.seal_to_self(m.encode(m.ABORT_ACK.make(src=1, inc=7, seq=1, rid="req-9")))
    )
    rt.pump(0)
    assert rt.counters.request_errors == 1
    if not ended:
        assert failed == []  # the test catches the request left live
        return
    assert failed and failed[0][0] == "req-9" and "KeyError" in failed[0][1]
    assert "ABORT_ACK from rank 1" in failed[0][1]
