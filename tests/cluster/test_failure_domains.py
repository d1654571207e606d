"""Failure domains without a cluster: a restarted rank's new card, the old incarnation's
word refused, the proof a remote writer is gone, the router's admission of a rejoined rank,
the job plan, rank-scoped faults, and a launcher's exit record.

Each invariant test also runs a broken mode it must catch:
- an owner that takes an ack from a restarted writer as proof for the old request's pages,
  or its notice as the old request's writes done;
- a runtime that takes a remote writer as gone without its launcher's exit record;
- a router that admits a restarted rank while a quarantine of its old incarnation stands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_cluster_units import _Engine
from test_failure_units import STATS, _router
from test_protocol_units import TimedRuntime, _assign_and_notice_fields, _card, _owner

from kvferry.cluster import messages as m
from kvferry.cluster import runtime as runtime_mod
from kvferry.cluster.decode import DecodeRank
from kvferry.cluster.domains import DomainPlanError, job_command, plan_jobs
from kvferry.cluster.faults import FaultPlan
from kvferry.cluster.rendezvous import ExitRecord, exit_record, publish, publish_exit
from kvferry.cluster.router import Ledger, Rejoin, Router, Unavailable
from kvferry.cluster.runtime import DRAIN_S, RankRuntime
from kvferry.cluster.topology import Topology
from kvferry.engine.protocol import owner as core
from kvferry.engine.protocol.owner import OwnerState
from kvferry.engine.protocol.proof import Proof
from kvferry.transfer import TransferError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class _HorizonEngine(_Engine):
    """The fake engine, with what adoption and the proof ask of a real one."""

    def __init__(self, horizon_s: float | None = 4.0) -> None:
        super().__init__()
        self.closed: list = []
        self.horizon_s = horizon_s

    def close(self, peer, force: bool = False) -> None:
        self.closed.append(peer)

    def failure_horizon(self):
        return type("Horizon", (), {"seconds": self.horizon_s})()


def _cards(remote_host: str = "h") -> dict:
    cards = {0: dataclasses.replace(_card(0, "decode"), incarnation=7)}
    cards[1] = dataclasses.replace(_card(1, "prefill"), incarnation=7, host=remote_host)
    return cards


# ---------------------------------------------------------------- the owner
@pytest.mark.parametrize("checked", [True, False], ids=["contract", "broken-any-incarnation"])
def test_an_ack_from_a_restarted_writer_proves_nothing_for_the_old_pages(checked, monkeypatch):
    """Writer 1 was assigned in incarnation 1, and the request is aborted with its pages
    quarantined. Rank 1 then restarts: its new incarnation, asked nothing (no retry goes
    to it), acks the abort anyway (as a fresh rank acks an abort it knows nothing of).
    That ack is refused and counted: the old incarnation may have had writes in flight.
    Broken mode: an owner that checks only the rank releases the pages on it."""
    if not checked:
        monkeypatch.setattr(DecodeRank, "_same_incarnation", lambda self, req, msg, what: True)
    owner, rt = _owner()
    rt.cards.update({0: _card(0, "router"), 1: _card(1, "prefill"), 2: _card(2, "decode")})
    rt.deliver(m.ASSIGN, src=0, rid="r9", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    assert owner.reqs["r9"].writer_incs == {1: 1}
    rt.deliver(m.ABORT, src=0, rid="r9", owner=2, writers=[1], source="client", reason="gone")
    assert owner.reqs["r9"].state is OwnerState.QUARANTINED
    old = rt.cards[1]
    rt.cards[1] = dataclasses.replace(old, incarnation=5, pid=99)
    owner._on_card_replaced(old, rt.cards[1])
    rt.sent.clear()
    for timer in [t for t in rt.timers if t.delay < owner.abort_deadline_s and not t.cancelled]:
        timer.fn()  # the retries: nothing for the new incarnation to ack
    assert "ABORT" not in rt.kinds()
    rt.handlers[m.ABORT_ACK.name](m.ABORT_ACK.make(src=1, inc=5, seq=77, rid="r9"))
    if not checked:
        assert "RELEASED" in rt.kinds()  # the test catches the release on a stranger's ack
        return
    assert "RELEASED" not in rt.kinds()
    assert owner.allocator.counts()["quarantined"] == 3
    assert owner.dropped_other_incarnation == 1
    assert owner.fenced_writers() == ["1:1"]  # the router holds rank 1 out on this


@pytest.mark.parametrize("checked", [True, False], ids=["contract", "broken-any-incarnation"])
def test_a_notice_from_a_restarted_writer_starts_no_decode(checked, monkeypatch):
    """Writer 1 was assigned in incarnation 1; a notice for the request arrives carrying
    incarnation 5, ahead of the card that says rank 1 restarted. The new process wrote
    none of these pages and the old one may still be writing them, so the notice is
    refused and counted, the request keeps waiting, and once the new card is seen it fails
    with the restart as its reason. Broken mode: an owner that checks only the rank
    takes the notice and decodes over pages whose writes are not proven done."""
    if not checked:
        monkeypatch.setattr(DecodeRank, "_same_incarnation", lambda self, req, msg, what: True)
    owner, rt = _owner(integrity=False)
    rt.cards.update({0: _card(0, "router"), 1: _card(1, "prefill"), 2: _card(2, "decode")})
    fields = _assign_and_notice_fields(owner, rt, "r4", checksums=False)
    rt.handlers[m.NOTICE.name](m.NOTICE.make(src=1, inc=5, seq=4242, **fields))
    rt.pump()
    if not checked:
        assert owner.busy() and owner.step()  # the test catches decode on unproven pages
        return
    assert not owner.busy() and not owner.step()
    assert owner.reqs["r4"].state is OwnerState.AWAITING and owner.reqs["r4"].notices == {}
    assert owner.dropped_other_incarnation == 1
    _restart_writer_1_and_see_the_request_fail(owner, rt, "r4")


def _restart_writer_1_and_see_the_request_fail(owner, rt, rid: str) -> None:
    """Rank 1's new card (incarnation 5) reaches the owner: ``rid``, assigned to the old
    incarnation, is quarantined and fails with the restart as its reason."""
    old = rt.cards[1]
    rt.cards[1] = dataclasses.replace(old, incarnation=5, pid=99)
    rt.sent.clear()
    owner._on_card_replaced(old, rt.cards[1])
    assert owner.reqs[rid].state is OwnerState.QUARANTINED
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed" and "writer rank 1 restarted" in done["error"]


def test_a_writer_restarted_before_its_notice_fails_the_request():
    owner, rt = _owner()
    rt.cards.update({0: _card(0, "router"), 1: _card(1, "prefill"), 2: _card(2, "decode")})
    rt.deliver(m.ASSIGN, src=0, rid="r3", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    _restart_writer_1_and_see_the_request_fail(owner, rt, "r3")


# ---------------------------------------------------------------- the runtime
def test_a_restarted_peer_card_is_adopted_and_its_old_incarnation_refused(store):
    engine = _HorizonEngine()
    cards = _cards()
    for card in cards.values():
        publish(store, card)
    rt = RankRuntime(0, engine, cards, store=store)
    seen: list = []
    replaced: list = []
    rt.on_card_replaced = lambda old, new: replaced.append((old.incarnation, new.incarnation))
    rt.set_handlers({m.STATS.name: lambda msg: seen.append(msg.inc)}, role="router")
    assert rt.refresh_cards() == []  # nothing new published
    publish(store, dataclasses.replace(cards[1], incarnation=9, pid=4242))
    assert rt.refresh_cards() == [1]
    assert replaced == [(7, 9)] and rt.cards[1].incarnation == 9
    assert rt.card_of(1, 7) is not None and rt.card_of(1, 7).pid == 1
    assert rt.counters.cards_replaced == 1
    stats = dict(
        free=0, owned=0, quarantined=0, capacity_tokens=0, context_length=0,
        bytes_written=0, batches=0, integrity_failures=0, severed=0, allocations=0,
        dropped_duplicate=0, dropped_stale=0, dropped_malformed=0,
    )  # fmt: skip
    for inc, seq in ((7, 1), (9, 1)):
        msg = m.STATS.make(src=1, inc=inc, seq=seq, **stats)
        rt._on_payload(b"", rt.seal_to_self(m.encode(msg)))
    assert seen == [9] and rt.counters.dropped_stale == 1
    with pytest.raises(TransferError, match="allocated by incarnation 0x7"):
        rt.write(1, None, np.zeros((1, 3), dtype=np.int64), rid="r1", incarnation=7)
    assert rt.refresh_cards() == []  # the epoch has not moved since


@pytest.mark.parametrize("record", [True, False], ids=["contract", "broken-trusts-silence"])
def test_a_remote_writer_is_gone_only_on_its_exit_record_and_past_the_horizon(
    record, store, monkeypatch
):
    """A writer on another host: no /proc to read. Its pages wait for its launcher's exit
    record, then for the tcp horizon and the drain. Broken mode: a runtime that takes a
    silent remote writer as gone releases without any word from its host."""
    if not record:
        monkeypatch.setattr(RankRuntime, "_exit_published", lambda self, rank, inc: True)
    clock = [1000.0]
    monkeypatch.setattr(runtime_mod.time, "monotonic", lambda: clock[0])
    cards = _cards(remote_host="other")
    rt = RankRuntime(0, _HorizonEngine(horizon_s=4.0), cards, store=store)
    clock[0] += 100
    assert rt.write_path_closed(1) is None
    clock[0] += 100
    if not record:
        assert rt.write_path_closed(1) is Proof.EXIT_RECORD  # the unproven release, caught
        return
    assert rt.write_path_closed(1) is None  # still no word from its host
    publish_exit(
        store,
        ExitRecord(rank=1, incarnation=7, pid=1, host="other", status=-9, at=time.time()),
    )
    assert rt.write_path_closed(1) is None  # the record is seen now: the horizon starts
    clock[0] += 4.0 + DRAIN_S - 0.01
    assert rt.write_path_closed(1) is None  # the writer's kernel may still retransmit
    clock[0] += 0.02
    assert rt.write_path_closed(1) is Proof.EXIT_RECORD


class _CountingStore:
    """A store that counts the round trips asked of it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def _exited_one_by_one(self, rank: int) -> bool:
    """The watch before the exit log: each remote rank's own record, read every tick."""
    card = self.cards[rank]
    if card.host == self.cards[self.rank].host:
        return runtime_mod.process_gone(card.pid)
    return self._exit_published(rank, card.incarnation)


@pytest.mark.parametrize("logged", [True, False], ids=["contract", "broken-per-rank"])
def test_watching_many_remote_ranks_costs_one_store_round_trip_a_tick(logged, store, monkeypatch):
    """A router watching 64 ranks on other hosts asks the store the same few questions a
    tick however many ranks there are (the card epoch and the exit log's length), and
    still sees a rank's exit at the next tick, and no other rank as exited. Broken mode:
    reading every rank's own exit record each tick costs a round trip per rank."""
    if not logged:
        monkeypatch.setattr(RankRuntime, "process_exited", _exited_one_by_one)
    cards = {0: dataclasses.replace(_card(0, "router"), incarnation=7)}
    for r in range(1, 65):
        cards[r] = dataclasses.replace(_card(r, "decode"), incarnation=7, host=f"h{r}")
    counting = _CountingStore(store)
    rt = RankRuntime(0, _HorizonEngine(), cards, store=counting)

    def tick() -> tuple[list[int], int]:
        before = counting.calls
        rt.refresh_cards()
        rt.poll_exits()
        exited = [r for r in range(1, 65) if rt.process_exited(r)]
        return exited, counting.calls - before

    assert tick()[0] == []
    exited, calls = tick()
    if not logged:
        assert calls >= 64  # the test catches a round trip per rank
        return
    assert exited == [] and calls <= 2, calls
    publish_exit(store, ExitRecord(rank=17, incarnation=7, pid=17, host="h17", status=-9, at=0.0))
    exited, calls = tick()
    assert exited == [17] and calls <= 4, calls
    assert tick() == ([17], 2)
    # a record of an old incarnation marks nothing: rank 18's current card is another one
    publish_exit(store, ExitRecord(rank=18, incarnation=6, pid=1, host="h18", status=0, at=0.0))
    assert tick()[0] == [17]


# ---------------------------------------------------------------- the router
def _router_with_rejoin():
    """Router 0, prefill ranks 1 and 2, decode rank 3; the store's card epoch at 3."""
    router, rt = _router(prefill=2)
    rt.cards_epoch = 3
    return router, rt


def _admit_on_word_alone(self) -> None:
    for rank, rejoin in list(self.rejoining.items()):
        if rejoin.heard:
            del self.rejoining[rank]
            self.unhealthy.pop(rank, None)


@pytest.mark.parametrize("gated", [True, False], ids=["contract", "broken-admits-at-once"])
def test_a_restarted_rank_is_admitted_only_once_no_rank_waits_on_its_old_incarnation(
    gated, monkeypatch
):
    if not gated:
        monkeypatch.setattr(Router, "_admit_rejoined", _admit_on_word_alone)

    async def run():
        router, rt = _router_with_rejoin()
        old = rt.cards[1]
        rt.cards[1] = dataclasses.replace(old, incarnation=5, pid=99)
        router._on_card_replaced(old, rt.cards[1])
        assert 1 in router.rejoining and router.unhealthy[1].startswith("rejoining")
        rt.deliver(m.STATS, src=1, **STATS)  # the new incarnation reports
        rt.deliver(m.STATS, src=2, **STATS, cards_epoch=3)
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=3, fenced=["1:1"])  # still waits
        router._admit_rejoined()
        if not gated:
            assert 1 not in router.unhealthy  # the test catches the early admission
            return router, None
        assert 1 in router.rejoining
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=2)  # has not seen the new card
        router._admit_rejoined()
        assert 1 in router.rejoining
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=3, fenced=[])
        router._admit_rejoined()
        assert 1 not in router.rejoining and 1 not in router.unhealthy
        writers = [w for i in range(6) for w in (await router.submit(f"r{i}", 4)).writers]
        return router, writers

    router, writers = asyncio.run(run())
    if gated:
        assert router.rejoined == 1 and 1 in writers and 2 in writers


def _names_the_last_only(self, rank: int) -> set[str]:
    """BROKEN: a rank restarted twice before it was admitted waits on its last old
    incarnation only."""
    return {f"{rank}:{self.old_incarnations[-1]:x}"}


@pytest.mark.parametrize("gated", [True, False], ids=["every-old-one", "broken-last-only"])
def test_a_rank_restarted_twice_waits_for_every_old_incarnations_quarantines(gated, monkeypatch):
    """Incarnation 1 is replaced by 5, which dies while it waits to be admitted and is
    replaced by 6: decode rank 3 still lists a quarantine of incarnation 1, so 6 waits.
    Broken mode: the gate asks after incarnation 5 only, and 6 is admitted."""
    if not gated:
        monkeypatch.setattr(Rejoin, "names", _names_the_last_only)

    async def run():
        router, rt = _router_with_rejoin()
        i1 = rt.cards[1]
        i5 = rt.cards[1] = dataclasses.replace(i1, incarnation=5, pid=99)
        router._on_card_replaced(i1, i5)
        rt.cards_epoch = 4
        i6 = rt.cards[1] = dataclasses.replace(i1, incarnation=6, pid=100)
        router._on_card_replaced(i5, i6)
        assert "0x1, 0x5" in router.unhealthy[1]
        rt.deliver(m.STATS, src=1, **STATS)
        rt.deliver(m.STATS, src=2, **STATS, cards_epoch=4)
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=4, fenced=["1:1"])
        router._admit_rejoined()
        held = 1 in router.rejoining
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=4, fenced=[])
        router._admit_rejoined()
        return held, 1 in router.rejoining

    held, still = asyncio.run(run())
    assert held is gated and not still


@pytest.mark.parametrize("gated", [True, False], ids=["asks-late-ranks", "broken-skips-them"])
def test_a_rank_late_with_a_quarantine_of_the_old_incarnation_holds_the_rejoin(gated, monkeypatch):
    """Decode rank 3 missed its heartbeats (a stalled loop, alive) after it listed a
    quarantine of rank 1's old incarnation: rank 1's new incarnation waits for it (its
    last STATS). Broken mode: ranks marked unhealthy for any reason are not asked."""
    if not gated:
        waits_on = Router._waits_on
        monkeypatch.setattr(
            Router,
            "_waits_on",
            lambda self, r, rejoin, olds: (
                r not in self.unhealthy and waits_on(self, r, rejoin, olds)
            ),
        )

    async def run():
        router, rt = _router_with_rejoin()
        rt.deliver(m.STATS, src=3, **STATS, cards_epoch=3, fenced=["1:1"])
        router._on_rank_lost(3, "no heartbeat for 3.0 s")
        old = rt.cards[1]
        rt.cards[1] = dataclasses.replace(old, incarnation=5, pid=99)
        router._on_card_replaced(old, rt.cards[1])
        rt.deliver(m.STATS, src=1, **STATS)
        rt.deliver(m.STATS, src=2, **STATS, cards_epoch=3)
        router._admit_rejoined()
        held = 1 in router.rejoining
        router._on_rank_exited(3, "exited (pid 3)")  # its pool, and the quarantine, gone
        router._admit_rejoined()
        return held, 1 in router.rejoining

    held, still = asyncio.run(run())
    assert held is gated and not still


def test_a_dead_rank_fails_its_requests_and_its_ledger_is_dropped():
    async def run():
        router, _rt = _router_with_rejoin()
        routed = await router.submit("hello", 4)
        dead = routed.writers[0]
        router._on_rank_exited(dead, "exited (pid 1)")
        assert routed.outcome is not None and routed.outcome.value == "failed"
        assert "exited" in routed.error and router.ledger.held[dead] == {}
        assert router.unhealthy[dead].startswith("exited")
        again = await router.submit("hello again", 4)
        return dead, again.writers

    dead, writers = asyncio.run(run())
    assert dead not in writers


# ---------------------------------------------------------------- the job plan
def test_the_jobs_are_the_router_each_prefill_group_and_each_decode_rank():
    jobs = plan_jobs(Topology(7, 4, 2, tp=2))
    assert [(j.name, j.first_rank, j.nproc) for j in jobs] == [
        ("router", 0, 1),
        ("prefill0", 1, 2),
        ("prefill1", 3, 2),
        ("decode0", 5, 1),
        ("decode1", 6, 1),
    ]
    assert [j.name for j in plan_jobs(Topology(7, 4, 2, tp=2), first_rank=3, nproc=4)] == [
        "prefill1",
        "decode0",
        "decode1",
    ]
    with pytest.raises(DomainPlanError, match=r"prefill group 0 \(ranks \[1, 2\]\) is split"):
        plan_jobs(Topology(7, 4, 2, tp=2), first_rank=2, nproc=5)
    line = job_command(jobs[1], 7, "10.0.0.1:29400", ["--tp", "2"], max_restarts=3)
    assert "--nproc-per-node=2" in line and "--max-restarts=3" in line
    assert line[line.index("--first-rank") + 1] == "1" and line[-2:] == ["--tp", "2"]


# ---------------------------------------------------------------- faults
def test_a_fault_scoped_to_a_rank_applies_there_only_and_a_drop_count_runs_out():
    assert FaultPlan.parse(["rank=2:drop:PLAN:1:1"], rank=1).enabled is False
    plan = FaultPlan.parse(["rank=2:drop:PLAN:1:1"], rank=2)
    assert plan.on_send("PLAN", 3, b"x") == []
    assert plan.on_send("PLAN", 3, b"y") == [(b"y", 0.0)]
    assert plan.on_send("NOTICE", 3, b"z") == [(b"z", 0.0)]


# ---------------------------------------------------------------- the launcher
def test_the_launcher_publishes_a_killed_rank_exit(store, tmp_path):
    """A rank SIGKILLs itself after publishing its card; its launcher reaps it, publishes
    the exit record for that incarnation and leaves with the status torchrun sees."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT.parent)!r})
        from kvferry.cluster.supervise import fork_rank
        from kvferry.cluster.store import connect
        from kvferry.cluster.hostid import this_host
        from kvferry.cluster.rendezvous import RankCard, publish
        fork_rank(5, "127.0.0.1:{store.port}")
        card = RankCard(rank=5, role="prefill", address=b"", incarnation=0xABC, segment=None,
                        num_pages=1, page_size=16, capacity_tokens=16, context_length=16,
                        host=this_host(), pid=os.getpid())
        publish(connect("127.0.0.1:{store.port}"), card)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60, env=dict(os.environ)
    )
    assert proc.returncode == 137, proc.stderr.decode()[-2000:]
    record = exit_record(store, 5, 0xABC)
    assert record is not None and record.status == -9 and record.rank == 5
    assert b"exit published" in proc.stderr


def _gone(pid: int) -> bool:
    """``pid`` no longer runs: reaped, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("dies", [True, False], ids=["contract", "broken-outlives"])
def test_a_rank_dies_with_its_launcher(store, tmp_path, dies):
    """A launcher SIGKILLed (nobody reaps the rank or publishes its exit) takes its rank
    with it, so no rank runs on unsupervised, unfenceable, beside the one a restarted job
    starts. Broken mode: a rank that does not ask to die with its launcher runs on."""
    pid_file = tmp_path / "rank.pid"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT.parent)!r})
        from kvferry.cluster import supervise
        if not {dies!r}:
            supervise.die_with_launcher = lambda launcher: None
        supervise.fork_rank(6, "127.0.0.1:{store.port}")
        with open({str(pid_file)!r} + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(120)
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ))
    rank = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert launcher.poll() is None, "the launcher exited before its rank started"
            assert time.monotonic() < deadline, "the rank never wrote its pid"
            time.sleep(0.05)
        rank = int(pid_file.read_text())
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(rank) is dies
    finally:
        launcher.kill()
        if rank is not None and not _gone(rank):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.parametrize("inherits", [True, False], ids=["contract", "broken-forgets"])
def test_a_restarted_router_counts_the_pages_ranks_hold_for_the_old_one(inherits, monkeypatch):
    """A router that restarts knows nothing of the requests its old incarnation placed;
    their pages on the ranks are taken from each rank's first STATS and count as used until
    the rank reports them gone. Broken mode: a router that starts from an empty ledger hands
    them out again (the rank would then refuse the request, or worse, if its count were
    not its own)."""
    if not inherits:
        monkeypatch.setattr(Ledger, "inherit", lambda self, rank, used, other=None: None)

    async def run():
        router, rt = _router_with_rejoin()
        rt.deliver(m.STATS, src=3, **{**STATS, "owned": 60, "free": 4})
        try:
            await router.submit("x" * 100, 16)  # 8 decode pages; 4 are not held
        except Unavailable as exc:
            refused = exc
        else:
            refused = None
        rt.deliver(m.STATS, src=3, **{**STATS, "owned": 0})  # the old requests ended
        later = await router.submit("x" * 100, 16)
        return refused, later

    refused, later = asyncio.run(run())
    if not inherits:
        assert refused is None  # the test catches the pages handed out twice
        return
    assert refused is not None and "no pool has room for 8 pages" in refused.reason
    assert later.owner == 3


@pytest.mark.parametrize("said", [True, False], ids=["rank-says", "broken-estimated"])
def test_a_restarted_routers_count_holds_while_its_own_reservations_are_not_allocated(said):
    """The decode rank holds 40 of its 64 pages for the old router's requests and says so
    (STATS other_routers). The new router reserves 20 more there; a STATS the rank sends
    before it allocated them still counts the old 40, so a request of 20 pages more waits
    (4 are really free). Broken mode: a rank that does not say; the router's estimate
    (used less its own reservations) drops to 20 for good, and the request is placed on
    pages the old requests hold (the rank would refuse it)."""

    def stats(**fields):
        return {**STATS, "owned": 40, "free": 24, **({"other_routers": 40} if said else {})}

    async def run():
        router, rt = _router(prefill=1)  # router 0, prefill 1, decode 2: 64 pages of 16
        rt.deliver(m.STATS, src=2, **stats())
        await router.submit("x" * 100, 60)  # 10 decode pages
        await router.submit("y" * 100, 60)  # 10 more: 4 left
        rt.deliver(m.STATS, src=2, **stats())  # sent before it handled either ASSIGN
        try:
            return await router.submit("z" * 100, 220), router  # 20 pages
        except Unavailable:
            return None, router

    third, router = asyncio.run(run())
    if not said:
        assert third is not None  # the test catches the pages handed out twice
        return
    assert third is None and router.ledger.inherited[2] == 40


class _DeadWriters(TimedRuntime):
    """An owner's runtime where the writers in ``dead`` are proven gone."""

    def __init__(self, rank: int, dead: set[int]) -> None:
        super().__init__(rank)
        self.dead = dead

    def write_path_closed(self, rank, incarnation=None):
        return Proof.PROCESS_GONE if rank in self.dead else None

    def sever(self, rank, reason) -> None:
        self.sent.append((rank, "(severed)", {"reason": reason}))


def _any_gone_fences(book, gone):
    """Broken mode: fence as soon as one silent writer is gone."""
    if book.state is OwnerState.QUARANTINED and set(book.pending()) & set(gone):
        return core.on_deadline(book)
    return core.OwnerEvent.RETRY


@pytest.mark.parametrize("rule", ["every-silent-writer", "broken-any"], ids=str)
def test_a_quarantine_whose_silent_writers_are_all_gone_does_not_wait_out_the_deadline(
    rule, monkeypatch
):
    """Two writers; the abort finds neither acked. Writer 1's process is gone: still
    quarantined, since writer 3 lives and may still write. Once writer 3 is gone too, the
    next retry fences the request and releases it on the proof, well before the deadline.
    Broken mode: fencing once any silent writer is gone severs writer 3 while it lives,
    before its deadline (the proof check still holds the pages: it wants both gone)."""
    if rule == "broken-any":
        monkeypatch.setattr(core, "on_retry", _any_gone_fences)
    rt = _DeadWriters(rank=2, dead={1})
    rt.cards.update({r: _card(r, "prefill") for r in (1, 3)})
    owner, _ = _owner(rt=rt, abort_deadline_s=5.0)
    rt.deliver(m.ASSIGN, src=0, rid="r4", prompt_len=40, max_tokens=8, writers=[1, 3], last_token=7)
    rt.deliver(m.ABORT, src=0, rid="r4", owner=2, writers=[1, 3], source="peer", reason="gone")
    assert owner.reqs["r4"].state is OwnerState.QUARANTINED

    def fire_retries() -> None:
        for timer in [t for t in rt.timers if t.delay < owner.abort_deadline_s]:
            if not timer.cancelled:
                timer.cancelled = True
                timer.fn()

    fire_retries()
    severed = [to for to, kind, _ in rt.sent if kind == "(severed)"]
    if rule == "broken-any":
        assert 3 in severed  # the test catches writer 3 severed while alive
        return
    assert severed == [] and "RELEASED" not in rt.kinds()
    assert owner.reqs["r4"].state is OwnerState.QUARANTINED
    rt.dead.add(3)
    fire_retries()
    fire_retries()  # the proof check the fence armed
    released = [f for _, k, f in rt.sent if k == "RELEASED"]
    assert [(f["pages"], f["how"]) for f in released] == [(3, "severed")]
    assert owner.allocator.counts()["quarantined"] == 0


def test_a_rank_counts_the_pages_it_holds_for_other_router_incarnations():
    """What STATS says as other_routers: the pages of requests a router incarnation other
    than the current one assigned here (none while that router is the current one)."""
    owner, rt = _owner()
    rt.cards[0] = dataclasses.replace(_card(0, "router"), incarnation=1)
    rt.deliver(m.ASSIGN, src=0, rid="r1", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    held = len(owner.allocator.pages_of("r1"))
    assert held > 0 and owner.stats()["other_routers"] == 0  # the current router's own
    rt.cards[0] = dataclasses.replace(rt.cards[0], incarnation=2)  # the router came back
    assert owner.stats()["other_routers"] == held
