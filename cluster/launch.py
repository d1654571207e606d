"""One rank of a kvferry cluster, started by torchrun, in one of two ways:

    torchrun --standalone --nproc-per-node 3 -m kvferry.cluster.launch [serve options]

every rank in one torchrun group (the demo's way: torchrun stops the whole group when any
rank dies), or as failure domains, one torchrun job per role group meeting through the
cluster's rendezvous store (:mod:`.store`), each job restarted on its own:

    python -m kvferry.cluster.store --port 29400 &
    torchrun --nproc-per-node 1 --max-restarts 3 -m kvferry.cluster.launch \
        --store 127.0.0.1:29400 --world 4 --first-rank 1 [serve options]   # one job

or with ``--store etcd://HOST:PORT,...`` an etcd cluster instead of the store process.

Rank 0 is the router and front door, then prefill ranks, then decode ranks (see
:mod:`.topology`). Each rank builds its transfer engine and pool, checks the pool's
measured capacity against the context length (I3), publishes its card, reads everyone
else's, and serves until SIGTERM/SIGINT or a SHUTDOWN from the router. As a failure
domain, each rank is forked by a launcher that publishes its exit (:mod:`.supervise`),
and a restarted rank publishes a new card with a new incarnation.

Every rank holds the cluster's secret (``--secret-file``, ``KVFERRY_SECRET_FILE`` or
``KVFERRY_SECRET``; :mod:`.trust`) and refuses to start without one: its card, its
launcher's exit record and every control message it sends are sealed with it.
``--cluster-interface`` sets ``UCX_NET_DEVICES`` before the engine is built, and the front
door checks ``--api-key`` when one is given.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvferry.engine.capacity import CapacityError, enforce_startup_capacity
from kvferry.engine.kernels import tuning as decode_tuning
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol.words import Kind
from kvferry.transfer import TransferConfig, TransferEngine, TransferError

from . import messages as m
from . import trust as trusts
from .config import ServeConfig, add_serve_arguments, config_from_args
from .decode import DecodeRank
from .faults import FaultPlan
from .frontdoor import FrontDoor
from .heap import keep_freed_buffers
from .hostid import this_host
from .metrics import ClusterMetrics
from .models import build_model, pool_config
from .prefill import PrefillRank
from .prefill_path import Route
from .rendezvous import (
    FAIL_PREFIX,
    CardRefused,
    RankCard,
    RendezvousError,
    card_after,
    gather,
    publish,
    publish_failure,
)
from .router import Router
from .runtime import RankRuntime
from .stepping import STEP_POLL_S, Stepper
from .store import (
    StoreAddressError,
    StoreError,
    access_of,
    refuse_access_without_store,
    spec_of,
)
from .supervise import fork_rank
from .topology import HeadSplit, Role, Topology
from .wakeup import EngineWaker

log = logging.getLogger("kvferry.cluster")

STATS_INTERVAL_S = 0.5
DRAIN_MIN_S = 0.001  # least progress time a decoding owner gives in-flight transfers per step
HEARTBEAT_CHECK_S = 0.5
ROUTER_MAX_SLEEP_S = 0.05  # a stop asked for by a signal is seen within this
RENDEZVOUS_TIMEOUT_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry serve",
        description="Serve a disaggregated cluster: run under torchrun; rank 0 is the router "
        "(HTTP front door), then prefill ranks, then decode ranks.",
    )
    add_serve_arguments(parser)
    parser.add_argument("--log-level", default=os.environ.get("KVFERRY_LOG", "INFO"))
    return parser


def setup_logging(level: str, rank: int, role: Role) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format=f"%(asctime)s rank{rank}/{role.value} %(levelname)s %(name)s: %(message)s",
    )


def init_distributed() -> tuple[int, int, Any]:
    """torch.distributed (gloo) from torchrun's environment; returns rank, world, store."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    return dist.get_rank(), dist.get_world_size(), store


def join_domain(cfg: ServeConfig, trust: trusts.Trust) -> tuple[int, int, Any]:
    """This process's cluster rank, the cluster's size and the store, for a job run as a
    failure domain (``--store``): the rank is the job's first rank plus torchrun's rank
    within the job. Forks here: the parent stays behind as the rank's launcher
    (:func:`.supervise.fork_rank`) and this returns in the child."""
    job_rank = int(os.environ.get("RANK", "0"))
    job_world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.world is None:
        raise ValueError("--store needs --world, the number of ranks in the whole cluster")
    last = cfg.first_rank + job_world - 1
    if cfg.first_rank < 0 or last >= cfg.world:
        raise ValueError(
            f"this job's ranks {cfg.first_rank}..{last} ({job_world} processes from "
            f"--first-rank {cfg.first_rank}) fall outside a world of {cfg.world}"
        )
    rank = cfg.first_rank + job_rank
    spec = spec_of(cfg)  # a bad --store stops the start before the fork
    fork_rank(rank, spec, trust)
    return rank, cfg.world, spec.connect()


def use_cluster_interface(devices: str | None, env=os.environ) -> str | None:
    """``--cluster-interface``: UCX_NET_DEVICES for this rank's engine (UCX then uses and
    listens on those devices only) and, when one of them is a network interface of this
    host, GLOO_SOCKET_IFNAME for a single torchrun group's gloo. Returns a warning when
    it replaces another UCX_NET_DEVICES."""
    if not devices:
        return None
    before = env.get("UCX_NET_DEVICES")
    env["UCX_NET_DEVICES"] = devices
    interfaces = [d for d in devices.split(",") if d and ":" not in d]
    if interfaces and os.path.isdir(f"/sys/class/net/{interfaces[0]}"):
        env.setdefault("GLOO_SOCKET_IFNAME", interfaces[0])
    if before and before != devices:
        return f"--cluster-interface {devices} replaces UCX_NET_DEVICES={before}"
    return None


def freeze_long_lived_objects() -> None:
    """Called once a rank is set up: everything allocated so far (torch, the model, the
    codec tables) lives as long as the rank, so it is moved out of the collector's sight.
    A full collection then walks only what the protocol allocates, instead of stalling an
    exchange for tens of milliseconds every so often."""
    gc.collect()
    gc.freeze()


class StopFlag:
    def __init__(self) -> None:
        self.stop = False
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.stop:
            self.stop, self.reason = True, reason


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        # Before anything else: a rank without the cluster's secret never joins (and never
        # reads or writes the store). The secret itself is never logged.
        trust, secret_source = trusts.load(cfg.secret_file)
        api_key = trusts.api_key_from(cfg.api_key, cfg.api_key_file, os.environ)
    except trusts.TrustError as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    replaced = use_cluster_interface(cfg.cluster_interface)
    try:
        refuse_access_without_store(cfg.store, access_of(cfg))
        rank, world, store = init_distributed() if cfg.store is None else join_domain(cfg, trust)
    except (ValueError, StoreAddressError, StoreError) as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        topology = Topology.for_world(world, cfg.prefill, cfg.tp, cfg.decode_tp)
    except ValueError as exc:  # every rank sees the same: each says why and stops
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    role = topology.role(rank)
    setup_logging(args.log_level, rank, role)
    log.info("%s", keep_freed_buffers().describe())  # before the first long prompt's buffers
    log.info(
        "cluster secret from %s (fingerprint %s); front door %s",
        secret_source,
        trust.fingerprint,
        "behind an API key" if api_key else "open (no API key)",
    )
    if replaced:
        log.warning("%s", replaced)
    if cfg.unsafe_release_on_sever:
        log.error(
            "UNSAFE MODE: quarantined pages are released at the abort deadline once "
            "silent writers are severed, without proof their writes stopped"
        )
    if cfg.unsafe_free_on_abort:
        log.error(
            "UNSAFE MODE: pages are freed at abort without quarantine and integrity "
            "checks are off; answers can contain other requests' data"
        )
    faults = FaultPlan.parse(cfg.fault, seed=rank, rank=rank)
    try:
        tuning = decode_tuning.active()  # a bad KVFERRY_DECODE_TUNING stops the start
    except ValueError as exc:
        log.error("refusing to start: %s", exc)
        publish_failure(store, rank, str(exc), trust)
        return 2
    if tuning != decode_tuning.DEFAULT:
        log.info("decode kernel tuning %s (%s)", tuning.name, decode_tuning.ENV)
    try:
        engine = TransferEngine(
            TransferConfig(
                transports=cfg.transports,
                name=f"rank{rank}/{role.value}",
                max_message_bytes=4 << 20,
            )
        )
    except TransferError as exc:  # e.g. --transports rdma without a device or verbs
        log.error("refusing to start: %s", exc)
        publish_failure(store, rank, str(exc), trust)
        return 3
    log.info("UCX: %s", {k: v for k, v in engine.describe().items() if k != "peers"})
    log.log(*engine.failure_horizon().log_record(cfg.abort_deadline_s))
    pool = segment = model = None
    context_length = cfg.context_length
    try:
        if role is not Role.ROUTER:
            held = None  # a decode group's member holds its share of the heads
            if role is Role.DECODE:
                split = topology.split(cfg.kv_heads, cfg.kv_replicated)
                lo, hi = split.owner_heads(topology.decode_member(rank)[1])
                held = hi - lo
            model = build_model(cfg, kv_heads=held)
            pcfg = pool_config(cfg, model, prefill=role is Role.PREFILL, kv_heads=held)
            segment = engine.allocate(pcfg.total_bytes)
            pool = KVPool.from_buffer(pcfg, segment.as_torch())
            lowered = (
                min(cfg.context_length, pool.capacity_tokens) if cfg.lower_context_length else None
            )
            context_length = enforce_startup_capacity(pool, cfg.context_length, lowered)
            log.info("pool: %s; serving context length %d", pool, context_length)
    except (CapacityError, ValueError) as exc:
        log.error("refusing to start: %s", exc)
        publish_failure(store, rank, str(exc), trust)
        engine.shutdown()
        return 3
    card = RankCard(
        rank=rank,
        role=role,
        address=engine.address,
        incarnation=engine.incarnation,
        segment=segment.descriptor().pack() if segment is not None else None,
        num_pages=pool.num_pages if pool is not None else 0,
        page_size=pool.page_size if pool is not None else cfg.page_size,
        kv_layout=pool.order.value if pool is not None else "HND",
        capacity_tokens=pool.capacity_tokens if pool is not None else 0,
        context_length=context_length,
        host=this_host(),
        pid=os.getpid(),
        transports=transports_in_use(engine.describe()),
        published_ns=card_after(store, rank, trust),
    )
    if cfg.store is not None:
        store.delete_key(f"{FAIL_PREFIX}{rank}")  # an earlier incarnation's refusal
    publish(store, card, trust)
    try:
        cards = gather(store, world, RENDEZVOUS_TIMEOUT_S, trust=trust)
    except CardRefused as exc:
        log.error("rendezvous refused: %s", exc)
        engine.shutdown()
        return 3
    except RendezvousError as exc:
        log.error("rendezvous failed: %s", exc)
        engine.shutdown()
        return 3
    cards[rank] = card
    log.info(
        "rank %d incarnation %#x (pid %d)%s",
        rank,
        card.incarnation,
        card.pid,
        f", failure domain through the store at {cfg.store}" if cfg.store else "",
    )
    runtime = RankRuntime(
        rank, engine, cards, faults, store=store if cfg.store else None, trust=trust
    )
    freeze_long_lived_objects()
    stop = StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.set(signal.Signals(s).name))
    try:
        if role is Role.ROUTER:
            return asyncio.run(serve_router(runtime, topology, cards, cfg, stop, api_key))
        assert pool is not None, "a prefill or decode rank has a pool"
        return serve_worker(runtime, role, topology, cfg, model, pool, segment, stop)
    finally:
        engine.shutdown()


def transports_in_use(described: dict) -> str:
    """One line for /status: the transports a rank's engine asked UCX for, its UCX version,
    and with rdma the devices and transports found."""
    line = f"{described['transports_requested']} (UCX {described['ucx_version']})"
    rdma = described.get("rdma")
    if rdma:
        line += f"; rdma {rdma}"
    return line


def _stats_sender(runtime: RankRuntime, worker, router: int, context_length: int):
    def send() -> None:
        runtime.refresh_cards()  # a restarted peer's new card, before the stats say which
        s = worker.stats()
        c = runtime.engine.counters
        d = runtime.dropped()
        runtime.send(
            router,
            m.STATS,
            free=s["free"],
            owned=s["owned"],
            quarantined=s["quarantined"],
            capacity_tokens=s["capacity_tokens"],
            context_length=context_length,
            bytes_written=c.bytes_written,
            batches=c.batches,
            integrity_failures=s["integrity_failures"],
            severed=runtime.counters.severed,
            allocations=s["allocations"],
            dropped_duplicate=d["duplicate"],
            # with the messages an owner refused from a restarted writer's new incarnation
            dropped_stale=d["stale"] + getattr(worker, "dropped_other_incarnation", 0),
            dropped_malformed=d["malformed"],
            dropped_unauthenticated=d["unauthenticated"],
            dropped_duplicate_assign=s.get("duplicate_assigns"),
            cards_epoch=runtime.cards_epoch,
            fenced=worker.fenced_writers(),
            quarantines=worker.quarantines(),
            other_routers=s.get("other_routers"),
        )
        worker.sweep()
        runtime.call_later(STATS_INTERVAL_S, send)

    return send


def serve_worker(
    runtime: RankRuntime,
    role: Role,
    topology: Topology,
    cfg: ServeConfig,
    model,
    pool: KVPool,
    segment,
    stop: StopFlag,
) -> int:
    router = topology.router_rank
    worker: PrefillRank | DecodeRank
    if role is Role.PREFILL:
        _, index = topology.group_of(runtime.rank)
        split = topology.split(model.kv_heads, cfg.kv_replicated)
        worker = PrefillRank.serving(
            runtime,
            model,
            pool,
            segment,
            split.writer_heads(index),
            router,
            unsafe=cfg.unsafe_free_on_abort,
            max_batch_bytes=batch_bound(cfg.abort_deadline_s),
            batch_target_s=cfg.abort_deadline_s / 10,
            integrity=cfg.integrity,
            routes=write_routes(topology, split, index),
        )
        # the owners' pools mapped now, not by the first request's first write
        runtime.open_segments(r for r, card in runtime.cards.items() if card.role is Role.DECODE)
    else:
        worker = DecodeRank.serving(
            runtime,
            model,
            pool,
            router,
            transfer_timeout_s=cfg.transfer_timeout_s,
            abort_deadline_s=cfg.abort_deadline_s,
            integrity=cfg.integrity,
            unsafe=cfg.unsafe_free_on_abort,
            release_on_sever=cfg.unsafe_release_on_sever,
            prefill_tp=cfg.tp,
            decode_member=(
                topology.split(cfg.kv_heads, cfg.kv_replicated),
                topology.decode_member(runtime.rank)[1],
            ),
        )
    runtime.set_handlers(
        {**worker.handlers, Kind.SHUTDOWN: lambda msg: stop.set("SHUTDOWN from the router")},
        role=role,
    )
    _stats_sender(runtime, worker, router, runtime.cards[runtime.rank].context_length)()
    log.info("%s rank %d ready", role.value, runtime.rank)
    run_worker(runtime, worker, decode=role is Role.DECODE, stopped=lambda: stop.stop)
    log.info("rank %d stopping: %s", runtime.rank, stop.reason)
    return 0


def write_routes(topology: Topology, split: HeadSplit, position: int) -> Callable[[int], Route]:
    """For prefill member ``position``: what it writes into a decode rank (the heads of
    their pair in ``split``, into that member's share)."""

    def route(owner: int) -> Route:
        member = topology.decode_member(owner)[1]
        heads = split.pairs.get((position, member))
        if heads is None:
            raise ValueError(
                f"prefill member {position} of {topology.tp} writes nothing into decode "
                f"member {member} of {topology.decode_tp} (rank {owner}) for {split.kv_heads} "
                f"KV heads; its writers are members {split.writers_of(member)}"
            )
        return Route(heads, split.owner_heads(member))

    return route


def run_worker(
    runtime: RankRuntime, worker, decode: bool, stopped, *, step_thread: bool = True
) -> None:
    """A prefill or decode rank's loop until ``stopped()``. With requests in the protocol
    it polls in C (napping 5 µs between polls), so an ABORT, an ack or a notice costs
    no wake-up; idle, it polls ``busy_poll_us`` after the last message, then sleeps on the
    engine's event fd. A decode rank with running requests steps them between polls.
    ``pump`` shortens every wait to the next timer.

    A long decode step runs on a step thread (:mod:`.stepping`) while this loop goes on
    pumping: the rank's heartbeats, the ABORTs and acks of other requests and, over tcp,
    the bytes of its writers never wait for it. ``step_thread=False`` runs every step
    here (the broken mode of its test).

    A decode rank that decodes inline while transfers into it are in flight gives them as
    much time as its last step took (``RankRuntime.progress_for``): over tcp the owner's
    own progress moves the bytes, so a loaded owner that polled once per step would
    starve its writers, whose batches (and acks, which wait for them) would miss the
    deadlines."""
    stepper = Stepper(worker, threaded=step_thread) if decode else None
    step_s = 0.0
    try:
        while not stopped():
            if stepper is not None and stepper.running:
                runtime.pump(STEP_POLL_S)
                stepper.poll()
                continue
            busy = decode and worker.busy()
            if busy and worker.in_flight():
                runtime.progress_for(max(DRAIN_MIN_S, step_s))
            else:
                awake = worker.in_flight() or (decode and worker.awaiting_peers())
                runtime.pump(0.0 if busy else 0.05, stay_awake=awake)
            if busy and stepper is not None:
                t0 = time.monotonic()
                stepper.poll()
                step_s = 0.0 if stepper.running else time.monotonic() - t0
    finally:
        if stepper is not None:
            stepper.close()


def measure_copy_gbps(nbytes: int = 32 << 20, rounds: int = 3) -> float:
    """Best of a few memcpys between pre-faulted buffers: the ceiling of a shared-memory
    write on this host."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def batch_bound(abort_deadline_s: float) -> int:
    """Largest write batch a writer posts at once: a tenth of what the measured bandwidth
    moves within the abort deadline, so an aborted writer's last batch lands and its ack
    follows well inside the deadline (clamped to [4 MiB, 1 GiB])."""
    gbps = measure_copy_gbps()
    bound = int(min(1 << 30, max(4 << 20, gbps * 1e9 * abort_deadline_s / 10)))
    log.info(
        "write batches bounded to %.1f MiB: measured copy bandwidth %.2f GB/s x abort "
        "deadline %.1f s / 10",
        bound / (1 << 20),
        gbps,
        abort_deadline_s,
    )
    return bound


async def serve_router(
    runtime: RankRuntime,
    topology: Topology,
    cards: dict[int, RankCard],
    cfg: ServeConfig,
    stop: StopFlag,
    api_key: str | None = None,
) -> int:
    from aiohttp import web

    metrics = ClusterMetrics()
    router = Router(
        runtime,
        topology,
        cards,
        context_length=cfg.context_length,
        request_timeout_s=cfg.request_timeout_s,
        admission_wait_s=cfg.admission_wait_s,
        metrics=metrics,
        fence_severed=cfg.fence_severed,
        kv_heads=cfg.kv_heads,
        kv_replicated=cfg.kv_replicated,
    )
    for row in router.capacity_table():
        metrics.capacity.labels(str(row["rank"]), row["role"]).set(row["capacity_tokens"])
    door = FrontDoor(router, api_key=api_key, open_metrics=cfg.open_metrics)
    runner = web.AppRunner(door.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    waker = None
    try:
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, exc)
            stop.set("no port to listen on")
            return 3
        log.info(
            "kvferry: serving on http://%s:%d (prefill groups %s, decode ranks %s, "
            "context length %d)",
            cfg.host,
            cfg.port,
            topology.prefill_groups,
            topology.decode_ranks,
            router.context_length,
        )
        waker = EngineWaker(runtime.engine, asyncio.get_running_loop())
        runtime.on_new_work = waker.wake
        next_check = 0.0
        while not stop.stop:
            runtime.pump(0)
            now = time.monotonic()
            if now >= next_check:
                router.check_heartbeats()
                next_check = now + HEARTBEAT_CHECK_S
            await waker.sleep(runtime.sleep_bound(min(next_check - now, ROUTER_MAX_SLEEP_S)))
    finally:
        log.info("router stopping: %s", stop.reason)
        ended = router.shutdown(f"the cluster is stopping ({stop.reason or 'router exit'})")
        if ended:
            log.info("router: %d live request(s) answered 503 at shutdown", ended)
        await asyncio.sleep(0)  # their handlers answer before the site closes
        if waker is not None:
            waker.close()
        for rank in range(1, topology.world_size):
            runtime.send(rank, m.SHUTDOWN)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            runtime.pump(0.01)
        await runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
