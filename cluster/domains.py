"""Start a cluster, or one host's part of it, as failure domains, and keep them running:

    python -m kvferry.cluster.domains --nproc 4 [--max-restarts 3] -- [serve options]

hosts the rendezvous store (:mod:`.store`) and starts one torchrun job per role group: the
router, each prefill group (its ``--tp`` ranks together) and each decode rank. torchrun
restarts a job whose rank died (``--max-restarts``); the restarted rank rejoins with a new
incarnation. A job whose restarts are spent stays down and the rest keep serving. On
SIGTERM or SIGINT the router's job is stopped first (it tells every rank to stop), then
whatever is left, then the store. If the router's job ends, everything is stopped.

On several hosts each runs the jobs of its own ranks (``--first-rank``, ``--nproc``) and
node 0 hosts the store (``--host-store``); see ``scripts/serve-node.sh``. With ``--store
etcd://HOST:PORT,...`` the ranks meet on that etcd cluster and no store process is started.

The store listens on the address of ``--store`` only (loopback for a cluster on one host).
Every rank needs the cluster's secret (:mod:`.trust`): on one host (no ``--store``, or a
loopback one) a fresh one is made for the cluster when none is given; on several hosts
none is made, and this refuses to start without one.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from . import trust as trusts
from .store import (
    ACCESS_OPTIONS,
    StoreAccess,
    StoreAddressError,
    StoreKind,
    parse_store,
    refuse_access_without_store,
)
from .topology import Topology, TopologyError

STOP_WAIT_S = 15.0


@dataclass(frozen=True)
class Job:
    """One torchrun job: ``nproc`` ranks from ``first_rank``."""

    name: str
    first_rank: int
    nproc: int


class DomainPlanError(ValueError):
    """The ranks asked for do not split into whole jobs."""


def plan_jobs(topology: Topology, first_rank: int = 0, nproc: int | None = None) -> list[Job]:
    """The jobs of ranks ``first_rank .. first_rank + nproc - 1``: the router alone, each
    prefill group whole, each decode rank alone. A prefill group split across the range's
    edge is refused (its members must share one job: one dies, the group restarts)."""
    nproc = topology.world_size - first_rank if nproc is None else nproc
    ranks = range(first_rank, first_rank + nproc)
    if nproc < 1 or ranks.stop > topology.world_size:
        raise DomainPlanError(
            f"ranks {ranks.start}..{ranks.stop - 1} fall outside a world of {topology.world_size}"
        )
    jobs = []
    if 0 in ranks:
        jobs.append(Job("router", 0, 1))
    for g, group in enumerate(topology.prefill_groups):
        inside = [r in ranks for r in group]
        if any(inside) and not all(inside):
            raise DomainPlanError(
                f"prefill group {g} (ranks {group}) is split by ranks "
                f"{ranks.start}..{ranks.stop - 1}: a tensor-parallel group runs in one job"
            )
        if all(inside):
            jobs.append(Job(f"prefill{g}", group[0], len(group)))
    for d, rank in enumerate(topology.decode_ranks):
        if rank in ranks:
            jobs.append(Job(f"decode{d}", rank, 1))
    return jobs


def job_command(
    job: Job, world: int, store: str, serve_args: list[str], max_restarts: int
) -> list[str]:
    """The torchrun line of one job."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={job.nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "-m",
        "kvferry.cluster.launch",
        "--store",
        store,
        "--world",
        str(world),
        "--first-rank",
        str(job.first_rank),
        *serve_args,
    ]


def topology_of(world: int, serve_args: list[str]) -> Topology:
    """The cluster's roles from its size and the serve options' --prefill, --tp and
    --decode-tp."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--prefill", type=int, default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    known, _ = p.parse_known_args(serve_args)
    return Topology.for_world(world, known.prefill, known.tp, known.decode_tp)


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def parse_host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def secret_file_of(serve_args: list[str]) -> str | None:
    """The ``--secret-file`` among the serve options, if one is there."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--secret-file", default=None)
    return p.parse_known_args(serve_args)[0].secret_file


def store_access_of(serve_args: list[str]) -> StoreAccess:
    """The ``--store-*`` options among the serve options."""
    p = argparse.ArgumentParser(add_help=False)
    for name, option in ACCESS_OPTIONS.items():
        p.add_argument(option, dest=name, default=None)
    return StoreAccess(**vars(p.parse_known_args(serve_args)[0]))


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(proc, signal.SIGKILL)
            proc.wait(timeout=5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvferry domains",
        description="Run a cluster (or this host's ranks of one) as failure domains: one "
        "torchrun job per role group, meeting through a rendezvous store.",
        epilog="Options after -- go to every rank (see `kvferry serve --help`).",
    )
    p.add_argument("--nproc", type=int, required=True, help="ranks on this host")
    p.add_argument(
        "--world", type=int, default=None, help="ranks in the whole cluster (default: --nproc)"
    )
    p.add_argument("--first-rank", type=int, default=0, help="this host's first rank (default 0)")
    p.add_argument(
        "--store",
        default=None,
        metavar="HOST:PORT|etcd://HOST:PORT,...[/PREFIX]",
        help="the cluster's rendezvous store (default: a TCPStore hosted here on a free "
        "port); an etcd cluster is run by its operator, and its TLS and authentication go "
        "to the ranks as serve options (--store-ca, --store-user, ...: kvferry serve --help)",
    )
    p.add_argument(
        "--host-store",
        action="store_true",
        help="host the TCPStore given by --store here (node 0 of several hosts)",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help="the cluster secret, passed to every rank (else KVFERRY_SECRET_FILE or "
        "KVFERRY_SECRET; on one host a fresh one is made when none is given)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts torchrun gives each job whose rank died (default %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = build_parser().parse_args(own)
    world = args.world or args.nproc
    try:
        topology = topology_of(world, serve_args)
        jobs = plan_jobs(topology, args.first_rank, args.nproc)
    except (TopologyError, DomainPlanError) as exc:
        print(f"kvferry domains: error: {exc}", file=sys.stderr)
        return 2
    try:
        access = store_access_of(serve_args)
        refuse_access_without_store(args.store, access)
        spec = parse_store(args.store, access) if args.store is not None else None
    except StoreAddressError as exc:
        print(f"kvferry domains: error: {exc}", file=sys.stderr)
        return 2
    etcd = spec is not None and spec.kind is StoreKind.ETCD
    if etcd and args.host_store:
        print(
            "kvferry domains: error: --host-store hosts a TCPStore; an etcd store is run by "
            "its operator (--store etcd://... alone)",
            file=sys.stderr,
        )
        return 2
    # torch's TCPStore client logs a C++ warning with a backtrace at every failed call:
    # a lost store is logged by kvferry itself, once and then every 30 s (store.py)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.secret_file:
        env[trusts.SECRET_FILE_ENV] = args.secret_file
    one_host = world == args.nproc and (spec is None or spec.loopback())
    try:
        found = trusts.secret_from(secret_file_of(serve_args), env)
    except trusts.TrustError as exc:
        print(f"kvferry domains: error: {exc}", file=sys.stderr)
        return 2
    if found is None and not one_host:
        print(
            f"kvferry domains: error: a cluster on several hosts needs one secret on every "
            f"node: {trusts.NO_SECRET.removeprefix('no cluster secret: ')}",
            file=sys.stderr,
        )
        return 2
    if found is None:
        env = trusts.with_secret(env)  # one host: a fresh secret for this cluster's ranks
    store_proc = None
    store = args.store
    if not etcd and (store is None or args.host_store):
        if store is None:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                store = f"127.0.0.1:{s.getsockname()[1]}"
        host, _, port = store.rpartition(":")
        listen = host.strip("[]")  # there only: loopback on one host
        store_proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry.cluster.store", "--host", listen, "--port", port],
            env={k: v for k, v in env.items() if k not in trusts.SECRET_VARIABLES},
            start_new_session=True,
        )
    procs: dict[Job, subprocess.Popen] = {}
    for job in jobs:
        procs[job] = subprocess.Popen(
            job_command(job, world, store, serve_args, args.max_restarts),
            env=env,
            start_new_session=True,
        )
    print(
        f"kvferry domains: store {store}; jobs "
        + ", ".join(
            f"{j.name} (ranks {j.first_rank}..{j.first_rank + j.nproc - 1}, pid {p.pid})"
            for j, p in procs.items()
        ),
        file=sys.stderr,
        flush=True,
    )
    stopping: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stopping.append(signal.Signals(s).name))
    router = next((p for j, p in procs.items() if j.name == "router"), None)
    ended: set[Job] = set()
    code = 0
    while not stopping:
        for job, proc in procs.items():
            if job not in ended and proc.poll() is not None:
                ended.add(job)
                print(
                    f"kvferry domains: job {job.name} ended with {proc.returncode}"
                    + ("" if proc is router else "; the other jobs keep serving"),
                    file=sys.stderr,
                    flush=True,
                )
        if router is not None and router.poll() is not None:
            code = router.returncode
            break
        if len(ended) == len(procs):
            break
        time.sleep(0.2)
    if router is not None:
        _stop(router)
        _wait([router], STOP_WAIT_S)
    rest = [p for p in procs.values() if p is not router]
    deadline = time.monotonic() + STOP_WAIT_S
    while (
        any(p.poll() is None for p in rest) and time.monotonic() < deadline and router is not None
    ):
        time.sleep(0.1)  # the router's SHUTDOWN stops them with status 0
    for proc in rest:
        _stop(proc)
    _wait(rest, STOP_WAIT_S)
    if store_proc is not None:
        _stop(store_proc)
        _wait([store_proc], 5)
    return code


if __name__ == "__main__":
    sys.exit(main())
