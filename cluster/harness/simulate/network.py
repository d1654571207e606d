"""The simulated network: per-hop latency, loss, duplication, reordering, rack partitions,
and one-sided writes whose time is their bytes over the link bandwidth.

Latency (:class:`Latency`) is a log-normal body with an exponential tail mixed in, fitted
to what this machine measured (see :data:`LOCAL`); :data:`DATACENTRE` is a configurable
stand-in for a real fabric. Each message draws its own latency, so two messages on one
path can overtake each other; ``reorder`` adds an extra delay to a share of them on top.

A partition cuts a set of racks off from everything else for a while. A message or a
write that crosses it waits (the transport retransmits) and goes through at the heal if
that comes within ``failure_horizon_s`` of the send; otherwise the transport gives up at
the horizon: the message is lost and its sender learns of it (``on_fail``), the write
fails at its writer and lands nothing. ``failure_horizon_s`` defaults to the horizon the
transfer engine sets up for tcp (``TCP_USER_TIMEOUT`` and keep-alives, see
:mod:`kvferry.transfer.horizon`).

A message to a crashed rank is refused when it gets there (the kernel closed the dead
process's connections): the sender learns one hop later.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.transfer.config import TCP_FAILURE_OPTIONS
from kvferry.transfer.horizon import tcp_horizon

from .clock import Clock

_TCP = tcp_horizon(
    TCP_FAILURE_OPTIONS["TCP_KEEPIDLE"],
    TCP_FAILURE_OPTIONS["TCP_KEEPINTVL"],
    TCP_FAILURE_OPTIONS["TCP_KEEPCNT"],
    TCP_FAILURE_OPTIONS["TCP_USER_TIMEOUT"],
    True,
)
assert _TCP.seconds is not None, _TCP
TCP_FAILURE_HORIZON_S: float = _TCP.seconds


@dataclass(frozen=True)
class Latency:
    """One hop: ``shift + LogNormal(median, sigma)``, plus, with probability ``tail_p``,
    an exponential extra of mean ``tail_mean_ms``; plus ``cross_rack_ms`` between racks."""

    median_ms: float
    sigma: float
    shift_ms: float = 0.0
    tail_p: float = 0.0
    tail_mean_ms: float = 0.0
    cross_rack_ms: float = 0.0
    source: str = ""

    def draw(self, rng: random.Random, cross_rack: bool = False) -> float:
        ms = self.shift_ms + self.median_ms * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        if self.tail_p and rng.random() < self.tail_p:
            ms += rng.expovariate(1.0 / self.tail_mean_ms)
        if cross_rack:
            ms += self.cross_rack_ms
        return ms / 1e3


# Measured on this machine with bench-abort's relay case (kvferry.cluster.harness.benchabort
# run_relay, 1,000 exchanges after the warm-up, UCX's default transports (shared memory),
# one relay = two hops in a row: driver -> writer -> owner): relay p10 0.38, p50 0.589,
# p90 0.701, p99 1.006, max 2.724 ms. The parameters are the per-hop distribution whose sum
# of two draws fits those quantiles best (least squares on log quantiles p10..p99; the fit
# gives p10 0.435, p50 0.56, p90 0.724, p99 1.00 ms).
LOCAL = Latency(
    median_ms=0.275,
    sigma=0.275,
    tail_p=0.005,
    tail_mean_ms=2.0,
    source="bench-abort relay, UCX default transports (shm), this machine",
)
# The same over tcp on loopback (--transports tcp): relay p50 0.656, p90 2.788, p99 5.633 ms;
# fitted p50 0.649, p90 2.079, p99 6.688 ms.
LOCAL_TCP = Latency(
    median_ms=0.175,
    sigma=0.725,
    shift_ms=0.1,
    tail_p=0.1,
    tail_mean_ms=2.0,
    source="bench-abort relay, UCX tcp on loopback, this machine",
)
# Not measured: a stand-in for an RDMA fabric (a few microseconds a hop within a rack, a
# few more through the spine), to be set from the operator's own figures.
DATACENTRE = Latency(
    median_ms=0.008,
    sigma=0.3,
    tail_p=0.001,
    tail_mean_ms=0.2,
    cross_rack_ms=0.004,
    source="assumed datacentre fabric (not measured)",
)
LATENCIES = {"local": LOCAL, "local-tcp": LOCAL_TCP, "datacentre": DATACENTRE}


@dataclass(frozen=True)
class NetConfig:
    latency: Latency = LOCAL
    loss: float = 0.0  # share of control messages dropped
    dup: float = 0.0  # share delivered twice
    reorder: float = 0.0  # share held back by an extra delay, so later ones overtake
    reorder_ms: float = 2.0  # the extra delay's upper bound (uniform)
    bandwidth_gbps: float = 25.0  # GB/s of one rank's link, each way (a 200 Gb/s NIC)
    failure_horizon_s: float = TCP_FAILURE_HORIZON_S


@dataclass(frozen=True)
class Partition:
    racks: frozenset[int]
    start: float
    end: float


@dataclass(frozen=True)
class Layout:
    """Where ranks run: rank 0 the router, 1..P prefill, P+1..P+D decode (as
    :class:`kvferry.cluster.topology.Topology` numbers them). Prefill and decode ranks sit
    on hosts of their own (``ranks_per_host`` each) unless ``colocate``, where each host
    holds half prefill, half decode ranks; ``hosts_per_rack`` hosts make a rack. The
    router has a host and a rack of its own."""

    prefill: int
    decode: int
    ranks_per_host: int = 8
    hosts_per_rack: int = 4
    colocate: bool = False
    host: list[int] = field(init=False, repr=False)
    rack: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        host, rph = [-1], self.ranks_per_host
        if self.colocate:
            half = max(1, rph // 2)
            host += [(r - 1) // half for r in range(1, 1 + self.prefill)]
            host += [(r - 1 - self.prefill) // half for r in range(1 + self.prefill, self.world)]
        else:
            p_hosts = -(-self.prefill // rph)
            host += [(r - 1) // rph for r in range(1, 1 + self.prefill)]
            host += [
                p_hosts + (r - 1 - self.prefill) // rph for r in range(1 + self.prefill, self.world)
            ]
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "rack", [-1] + [h // self.hosts_per_rack for h in host[1:]])

    @property
    def world(self) -> int:
        return 1 + self.prefill + self.decode

    def prefill_racks(self) -> list[int]:
        return sorted({self.rack[r] for r in range(1, 1 + self.prefill)})

    def ranks_in(self, racks: frozenset[int]) -> list[int]:
        return [r for r in range(self.world) if self.rack[r] in racks]


@dataclass
class NetCounters:
    messages: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    held: int = 0  # waited for a partition to heal
    cut: int = 0  # lost to a partition past the failure horizon
    refused: int = 0  # reached a crashed rank
    writes: int = 0
    write_bytes: int = 0
    writes_failed: int = 0


class Network:
    def __init__(
        self,
        clock: Clock,
        cfg: NetConfig,
        layout: Layout,
        rng: random.Random,
        gone: Callable[[int], bool] = lambda rank: False,
    ) -> None:
        self.clock = clock
        self.cfg = cfg
        self.layout = layout
        self.rng = rng
        self.gone = gone
        self.partitions: list[Partition] = []
        self.counters = NetCounters()
        self._egress: dict[int, float] = {}
        self._ingress: dict[int, float] = {}
        self._bytes_per_s = cfg.bandwidth_gbps * 1e9

    # -------------------------------------------------------------- partitions
    def partition(self, racks: frozenset[int], start: float, end: float) -> None:
        self.partitions.append(Partition(racks, start, end))

    def cut_until(self, a: int, b: int, t: float) -> float | None:
        """When the partition between ranks ``a`` and ``b`` at time ``t`` heals; None if
        there is none."""
        if not self.partitions:
            return None
        ra, rb = self.layout.rack[a], self.layout.rack[b]
        for p in self.partitions:
            if p.start <= t < p.end and ((ra in p.racks) != (rb in p.racks)):
                return p.end
        return None

    def hop(self, a: int, b: int) -> float:
        rack = self.layout.rack
        return self.cfg.latency.draw(self.rng, rack[a] != rack[b])

    def _through(self, a: int, b: int, t: float) -> tuple[float | None, bool]:
        """(when the path opens at or after ``t``, False if it never does in time)."""
        heal = self.cut_until(a, b, t)
        if heal is None:
            return t, True
        if heal - t <= self.cfg.failure_horizon_s:
            self.counters.held += 1
            return heal, True
        return None, False

    # -------------------------------------------------------------- messages
    def message(
        self,
        src: int,
        dst: int,
        deliver: Callable[[bool], None],
        on_fail: Callable[[], None] | None = None,
    ) -> None:
        """Carry one control message: ``deliver(twinned)`` at its arrival (twice if
        duplicated, both times with ``twinned`` True); ``on_fail()`` at the sender when
        the transport gives up on it."""
        c, rng, cfg, now = self.counters, self.rng, self.cfg, self.clock.now
        c.messages += 1
        if cfg.loss and rng.random() < cfg.loss:
            c.lost += 1
            return
        start, ok = self._through(src, dst, now)
        if not ok or start is None:
            c.cut += 1
            if on_fail is not None:
                self.clock.at(now + cfg.failure_horizon_s, on_fail)
            return
        delay = self.hop(src, dst)
        if cfg.reorder and rng.random() < cfg.reorder:
            c.reordered += 1
            delay += rng.uniform(0.0, cfg.reorder_ms / 1e3)
        twin = bool(cfg.dup) and rng.random() < cfg.dup
        self.clock.at(start + delay, self._arrive, src, dst, deliver, on_fail, twin)
        if twin:  # both copies say so: the receiver drops whichever comes second
            c.duplicated += 1
            self.clock.at(start + self.hop(src, dst), self._arrive, src, dst, deliver, None, True)

    def _arrive(
        self,
        src: int,
        dst: int,
        deliver: Callable[[bool], None],
        on_fail: Callable[[], None] | None,
        twinned: bool,
    ) -> None:
        if self.gone(dst):
            self.counters.refused += 1
            if on_fail is not None:
                self.clock.after(self.hop(dst, src), on_fail)
            return
        deliver(twinned)

    # -------------------------------------------------------------- one-sided writes
    def write(self, src: int, dst: int, nbytes: int) -> tuple[float | None, float]:
        """Post a write of ``nbytes``: (when it lands at ``dst``, or None if it never
        does; when the writer sees it settle). Each rank's link carries one write at a
        time each way, at ``bandwidth_gbps``."""
        c, now = self.counters, self.clock.now
        c.writes += 1
        c.write_bytes += nbytes
        start, ok = self._through(src, dst, now)
        if not ok or start is None:
            c.writes_failed += 1
            return None, now + self.cfg.failure_horizon_s
        start = max(start, self._egress.get(src, 0.0), self._ingress.get(dst, 0.0))
        done = start + nbytes / self._bytes_per_s
        self._egress[src] = self._ingress[dst] = done
        land = done + self.hop(src, dst)
        heal = self.cut_until(src, dst, land)
        if heal is not None:  # cut while on the wire
            if heal - land > self.cfg.failure_horizon_s:
                c.writes_failed += 1
                return None, land + self.cfg.failure_horizon_s
            c.held += 1
            land = heal + self.hop(src, dst)
        return land, land + self.hop(dst, src)
