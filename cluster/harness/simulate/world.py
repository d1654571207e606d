"""One simulated fleet: the clock, the network, the router and every rank, the faults a
scenario injects, and the run from the first arrival to a quiet end."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvferry.cluster.launch import STATS_INTERVAL_S
from kvferry.cluster.topology import Topology
from kvferry.engine.admission import pages_needed
from kvferry.engine.integrity import PageList
from kvferry.engine.protocol.owner import OwnerState
from kvferry.engine.protocol.words import Answer, Release

from . import metrics
from .clock import Clock
from .network import Layout, Network
from .ranks import (
    SimBatch,
    SimCard,
    SimFaults,
    SimPool,
    SimRuntime,
    sim_decode_rank,
    sim_prefill_rank,
)
from .router import SimRouter
from .scenarios import Scenario
from .truth import Truth, Write

SAMPLE_S = 0.1  # quarantine share sampled this often
QUIET_CHECK_S = 0.5
MAX_BATCH_BYTES = 1 << 30  # launch.batch_bound's upper clamp
MIN_BOUND_BYTES = 4 << 20  # and its lower one


def batch_bound(bandwidth_gbps: float, abort_deadline_s: float) -> int:
    """launch.batch_bound with the link's bandwidth for the measured copy bandwidth: a
    tenth of what it moves within the abort deadline, clamped to [4 MiB, 1 GiB]."""
    return int(
        min(MAX_BATCH_BYTES, max(MIN_BOUND_BYTES, bandwidth_gbps * 1e9 * abort_deadline_s / 10))
    )


@contextmanager
def quiet_logs() -> Iterator[None]:
    """The ranks log every abort, sever and unsafe release; a run holds millions."""
    log = logging.getLogger("kvferry")
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        log.setLevel(level)


class World:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        wl = sc.workload
        self.rng = random.Random(sc.seed)
        self.clock = Clock()
        self.topology = Topology(1 + sc.prefill + sc.decode, sc.prefill, sc.decode, sc.tp)
        self.layout = Layout(
            sc.prefill, sc.decode, sc.ranks_per_host, sc.hosts_per_rack, sc.colocate
        )
        self.page_size = wl.page_size
        self.decode_pages = wl.decode_pages
        self.prefill_pages = wl.prefill_pages
        self.crashed: set[int] = set()
        # A crashed writer's launcher publishes its exit (kvferry.cluster.supervise), so an
        # owner on another host proves it gone past the horizon; off: the host is lost too.
        self.exit_records = True
        self.stalled_until: dict[int, float] = {}
        self.silent_since: dict[int, float] = {}
        self.truth = Truth()
        self.metrics = metrics.Metrics()
        self.notes: dict[str, Any] = {}
        self.faults = SimFaults()
        self.profile: dict[str, list[float]] | None = None  # calibration: handler times
        self.net = Network(
            self.clock,
            sc.net,
            self.layout,
            random.Random(sc.seed * 7919 + 1),
            self.crashed.__contains__,
        )
        self.cards = {
            r: SimCard(r, self.topology.role(r).value, self.layout.host[r], 0x1000 + r)
            for r in range(self.topology.world_size)
        }
        self.runtimes = {r: SimRuntime(self, r) for r in self.cards}
        self.router = SimRouter(
            self,
            self.runtimes[0],
            context_length=sc.context_length,
            request_timeout_s=sc.request_timeout_s,
            admission_wait_s=sc.admission_wait_s,
        )
        pool = SimPool(wl.decode_pages, wl.page_size, wl.page_bytes)
        self.owners = {
            r: sim_decode_rank(
                self.runtimes[r],
                pool,
                0,
                sc.times,
                transfer_timeout_s=sc.transfer_timeout_s,
                abort_deadline_s=sc.abort_deadline_s,
                unsafe=sc.unsafe,
                release_on_sever=sc.release_on_sever,
            )
            for r in self.topology.decode_ranks
        }
        ppool = SimPool(wl.prefill_pages, wl.page_size, wl.page_bytes)
        bound = batch_bound(sc.net.bandwidth_gbps, sc.abort_deadline_s)
        self.writers = {
            r: sim_prefill_rank(
                self.runtimes[r],
                ppool,
                sc.tp,
                0,
                sc.times,
                batch_target_s=sc.abort_deadline_s / 10,
                max_batch_bytes=bound,
            )
            for r in self.topology.prefill_ranks
        }
        self._busy: dict[int, float] = {}
        self._inflight: dict[int, dict[int, Write]] = {r: {} for r in self.writers}
        self._stall_armed: dict[int, float] = {}
        self.submitted = 0
        self.rids: list[str] = []
        self._answered: set[str] = set()
        self.last_arrival = 0.0
        self._capacity = wl.decode_pages * sc.decode

    # ------------------------------------------------------------------ hooks
    def count_message(self, kind: str) -> None:
        self.metrics.messages[kind] += 1

    def count(self, name: str) -> None:
        self.metrics.counts[name] += 1

    def on_sever(self, owner: int, writer: int) -> None:
        self.metrics.severed_pairs.add((owner, writer))
        self.metrics.severed_writers.add(writer)

    def on_owner_release(
        self, rank: int, req: Any, pages: int, how: Release, abort_ms: float | None
    ) -> None:
        self.metrics.on_release(how, abort_ms, req.book.justification())

    def on_answer(self, rid: str, outcome: Answer) -> None:
        if rid in self._answered:
            raise AssertionError(f"request {rid} answered twice")
        self._answered.add(rid)
        self.metrics.answers[outcome.value] += 1
        if self.sc.workload.sequential:
            self.clock.after(0.02, self._next_when_idle)

    # ------------------------------------------------------------------ writes
    def post_write(
        self, writer: int, owner: int, rid: str, pages: PageList, generation: int, nbytes: int
    ) -> SimBatch:
        w = Write(writer, owner, rid, pages, generation)
        self.truth.posted(w)
        batch = SimBatch()
        land, settle = self.net.write(writer, owner, nbytes)
        armed = self._stall_armed.get(writer)
        if armed is not None and armed <= self.clock.now:
            del self._stall_armed[writer]
            self.stall(writer, self._stall_s())
        if land is None:
            self.clock.at(settle, self._write_failed, w, batch)
        else:
            self._inflight[writer][id(w)] = w
            self.clock.at(land, self._land, w, batch)
        return batch

    def _write_failed(self, w: Write, batch: SimBatch) -> None:
        self.truth.dropped(w)
        batch.settle(False, "the transport gave up (failure horizon)")

    def _land(self, w: Write, batch: SimBatch) -> None:
        if w.dropped:
            return
        until = self.stalled_until.get(w.writer)
        if until is not None and until > self.clock.now:
            # A stalled writer's posted writes wait for it (its transport needs its
            # progress), then land.
            self.clock.at(until + self.net.hop(w.writer, w.owner), self._land, w, batch)
            return
        self._inflight[w.writer].pop(id(w), None)
        self.truth.landed(w, self.owners[w.owner].allocator, self.clock.now)
        self.clock.after(self.net.hop(w.owner, w.writer), batch.settle, True)

    # ------------------------------------------------------------------ faults
    def crash(self, rank: int) -> None:
        if rank in self.crashed:
            return
        self.crashed.add(rank)
        self.count("crashes")
        for w in list(self._inflight[rank].values()):
            self.truth.dropped(w)
        self._inflight[rank].clear()
        self.silent_since[rank] = self.clock.now
        self.router.silent(rank, self.clock.now)

    def stall(self, rank: int, seconds: float) -> None:
        now = self.clock.now
        self.stalled_until[rank] = now + seconds
        self.count("stalls")
        self.silent_since[rank] = now
        self.router.silent(rank, now)
        self.clock.at(now + seconds, self._resume, rank, now)

    def _resume(self, rank: int, since: float) -> None:
        if self.silent_since.get(rank) == since and rank not in self.crashed:
            del self.silent_since[rank]
            self.router.heard_again(rank)

    def _stall_s(self) -> float:
        f = self.sc.faults
        return f.stall_s or self.sc.transfer_timeout_s + 2 * self.sc.abort_deadline_s

    # ------------------------------------------------------------------ workload
    def _draw_request(self) -> tuple[int, int]:
        wl = self.sc.workload
        return self.rng.randint(*wl.prompt_tokens), self.rng.randint(*wl.max_tokens)

    def arrival_rate(self) -> float:
        """Requests a second that keep ``load`` of the decode pages in use."""
        sc, wl = self.sc, self.sc.workload
        prompt = sum(wl.prompt_tokens) / 2
        new = sum(wl.max_tokens) / 2
        pages = pages_needed(int(prompt), int(new), wl.page_size)
        life = (
            prompt / sc.times.prefill_tokens_per_s
            + pages * wl.page_bytes / (sc.net.bandwidth_gbps * 1e9)
            + new * sc.times.decode_step_s
        )
        return wl.load * self._capacity / (pages * life)

    def _submit(self, rid: str, prompt: int, new: int) -> None:
        self.submitted += 1
        self.last_arrival = self.clock.now
        self.runtimes[0].http(self.router.submit, rid, prompt, new)

    def schedule(self) -> float:
        """Schedule every arrival and fault; returns the span of the arrivals."""
        sc, wl, f = self.sc, self.sc.workload, self.sc.faults
        if wl.sequential:
            self._seq_left = wl.requests
            self.clock.at(0.0, self._next_sequential)
            return wl.requests * 0.2
        rate = self.arrival_rate()
        t = 0.0
        arrivals = []
        for i in range(wl.requests):
            t += self.rng.expovariate(rate)
            prompt, new = self._draw_request()
            rid = f"r{i:07d}"
            self.clock.at(t, self._submit, rid, prompt, new)
            arrivals.append((t, rid, prompt, new))
            if f.client_abort and self.rng.random() < f.client_abort:
                life = prompt / sc.times.prefill_tokens_per_s + new * sc.times.decode_step_s
                self._client_abort_at(t + self.rng.uniform(0, 1.2 * life), rid)
        span = t
        self.notes["arrival_rate_per_s"] = round(rate, 2)
        if f.storm:
            self.clock.at(f.storm_at * span, self._storm)
        if f.partition_racks:
            racks = frozenset(self.layout.prefill_racks()[: f.partition_racks])
            start = f.partition_at * span
            length = f.partition_deadlines * sc.abort_deadline_s
            self.net.partition(racks, start, start + length)
            self.notes["partition"] = {
                "racks": sorted(racks),
                "ranks": len(self.layout.ranks_in(racks)),
                "start_s": round(start, 3),
                "length_s": length,
            }
        if f.crash_per_hour:
            n = max(2, round(f.crash_per_hour * sc.prefill))
            per_hour = f.crash_per_hour * sc.prefill
            accel = n / (per_hour * span / 3600)
            victims = self.rng.sample(sorted(self.writers), min(n, len(self.writers)))
            for r in victims:
                self.clock.at(self.rng.uniform(0.1, 0.8) * span, self.crash, r)
            self.notes["crash"] = {"crashes": len(victims), "time_speedup": round(accel, 1)}
        if f.stalls:
            n = max(1, round(f.stalls * sc.prefill))
            for r in self.rng.sample(sorted(self.writers), n):
                self._stall_armed[r] = self.rng.uniform(0.2, 0.6) * span
            self.notes["stall"] = {"writers": n, "seconds": self._stall_s()}
        return span

    def _client_abort_at(self, when: float, rid: str) -> None:
        """The client goes away at ``when``: an event on the router's loop."""
        self.clock.at(when, self.runtimes[0].http, self.router.client_abort, rid)

    def _storm(self) -> None:
        f = self.sc.faults
        now, n = self.clock.now, 0
        live = [r.rid for r in self.router.requests.values() if r.req.live]
        live += [w.rid for w in self.router.waiting]
        for rid in live:
            if self.rng.random() < f.storm_share:
                n += 1
                self._client_abort_at(now + self.rng.uniform(0, f.storm_window_s), rid)
        self.notes["storm"] = {"at_s": round(now, 3), "aborted": n, "live": len(live)}

    def _next_sequential(self) -> None:
        wl = self.sc.workload
        if self._seq_left <= 0:
            return
        self._seq_left -= 1
        i = wl.requests - self._seq_left - 1
        rid = f"r{i:07d}"
        prompt, new = self._draw_request()
        if wl.pause_before_write_s:
            self.faults.pause_before_write[rid] = wl.pause_before_write_s
        self._submit(rid, prompt, new)
        if wl.cancel_after is not None:
            self._client_abort_at(self.clock.now + self.rng.uniform(*wl.cancel_after), rid)

    def _next_when_idle(self) -> None:
        """bench-abort's _wait_idle: the next request once no rank holds pages."""
        if any(self.router.ledger.used.values()):
            self.clock.after(0.05, self._next_when_idle)
            return
        self._next_sequential()

    # ------------------------------------------------------------------ the run
    def _sample(self) -> None:
        worst, total = 0, 0
        for o in self.owners.values():
            q = o.allocator.counts()["quarantined"]
            total += q
            worst = max(worst, q)
        self.metrics.q_share.append(total / self._capacity)
        self.metrics.q_worst.append(worst / self.decode_pages)
        self.clock.after(SAMPLE_S, self._sample)

    def unanswered(self) -> list[str]:
        return [rid for rid in self.rids if rid not in self._answered]

    def end_state(self) -> dict[str, int]:
        held = stranded = stranded_reqs = 0
        for rank, o in self.owners.items():
            c = o.allocator.counts()
            held += c["owned"] + c["quarantined"]
            for req in o.reqs.values():
                if req.state is OwnerState.FENCED and self._unprovable(rank, req):
                    stranded += len(req.grants)
                    stranded_reqs += 1
        for rank, w in self.writers.items():
            if rank not in self.crashed:
                c = w.allocator.counts()
                held += c["owned"] + c["quarantined"]
        ledger = sum(self.router.ledger.used[r] for r in self.owners)
        return {
            "held_pages": held,
            "stranded_pages": stranded,
            "stranded_requests": stranded_reqs,
            "ledger_held": ledger,
        }

    def _unprovable(self, rank: int, req: Any) -> bool:
        """A fenced request whose proof can never come: a severed writer that has not
        acked crashed on another host and no exit record will say so (``exit_records``
        off: its launcher lost with it, as when a whole host goes)."""
        if self.exit_records:
            return False
        host = self.layout.host
        silent = req.book.fenced - req.book.acked
        return any(w in self.crashed and host[w] != host[rank] for w in silent)

    def _quiet(self) -> bool:
        if self.submitted < self.sc.workload.requests:
            return False
        if len(self._answered) < self.submitted or self.router.waiting:
            return False
        end = self.end_state()
        return end["held_pages"] == end["stranded_pages"]

    def _check_quiet(self, after: float) -> None:
        if self.clock.now >= after and self._quiet():
            self.clock.stop()
            return
        self.clock.after(QUIET_CHECK_S, self._check_quiet, after)

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        sc = self.sc
        with quiet_logs():
            span = self.schedule()
            self.rids = [f"r{i:07d}" for i in range(sc.workload.requests)]
            self.clock.at(0.0, self._sample)
            horizon = span + sc.request_timeout_s + 4 * sc.abort_deadline_s + sc.transfer_timeout_s
            if sc.workload.sequential:
                self.clock.at(0.0, self._check_quiet, 0.0)
                horizon = 3600.0
            else:
                self.clock.at(span, self._check_quiet, span)
            self.clock.run(horizon)
        wall = time.perf_counter() - t0
        return metrics.summary(sc, self, wall, self._service_notes())

    def _service_notes(self) -> dict[str, Any]:
        """How busy the ranks were (the service model's time handling events)."""
        if self.sc.service is None:
            return {"service_model": "off"}
        span = max(self.clock.now, 1e-9)
        workers = [rt.busy_s for r, rt in self.runtimes.items() if r != 0]
        return {
            "service_model": self.sc.service.source,
            "router_busy_share": round(self.runtimes[0].busy_s / span, 4),
            "busiest_worker_busy_share": round(max(workers, default=0.0) / span, 4),
        }


def run(sc: Scenario) -> dict[str, Any]:
    with quiet_logs():
        return World(sc).run()


__all__ = ["STATS_INTERVAL_S", "World", "run"]
