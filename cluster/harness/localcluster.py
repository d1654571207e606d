"""A local cluster under ``torchrun --standalone``, driven over HTTP: what the fault suite,
the soak, the benchmarks and the integration tests start and talk to; or a two-node cluster
on one machine (:func:`two_nodes`), its second node behind a link that can be taken down.
Every wait is bounded.

Every cluster started here runs with a cluster secret of its own, generated for it
(``KVFERRY_SECRET`` in its processes' environment; the cluster's ``secret``), so the fault
suite, the soak, the benchmarks and the demo run with authenticated control messages and
store records. ``api_key``: the front door's key (off unless given); every call made
through the cluster then carries it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

from kvferry.cluster import domains
from kvferry.cluster import trust as trusts
from kvferry.cluster.topology import Topology

from . import netns

STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def startup_report(log: Path, tail_chars: int = 2000) -> str:
    """The ranks' ERROR lines first (the reason a rank refused to start), then the log's tail:
    torchrun's own tracebacks are long enough to push the reason out of any fixed tail."""
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if " ERROR " in line][:8]
    return "\n".join([*errors, "--- log tail ---", text[-tail_chars:]])


@dataclass
class LogTail:
    """A log from ``offset`` on: what the ranks wrote since a scenario began, so that a wait
    on a line is never satisfied by an earlier scenario's."""

    path: Path
    offset: int = 0

    @classmethod
    def at_end(cls, path: Path) -> LogTail:
        return cls(path, path.stat().st_size)

    def text(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of the regular expression ``pattern``; TimeoutError, with the
        tail, if none appears within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (found := re.search(pattern, text := self.text())) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no /{pattern}/ in {self.path.name} within {timeout_s:.0f} s:\n{text[-3000:]}"
                )
            time.sleep(0.1)
        return found


RELEASES_KEY = 'kvferry_releases_total{justification="'


def releases_by_justification(metrics: dict[str, float]) -> dict[str, float]:
    """The release counts of a /metrics sample dict, keyed by justification."""
    return {
        key[len(RELEASES_KEY) : -2]: value
        for key, value in metrics.items()
        if key.startswith(RELEASES_KEY)
    }


class Reply(NamedTuple):
    status: int
    body: dict


@dataclass
class LocalCluster:
    proc: subprocess.Popen
    url: str
    log: Path
    secret: str | None = field(default=None, kw_only=True, repr=False)
    api_key: str | None = field(default=None, kw_only=True, repr=False)

    def headers(self) -> dict[str, str]:
        """What every request to the front door carries: the API key, when it has one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def call(
        self, method: str, path: str, body: dict | None = None, timeout: float = 60.0
    ) -> Reply:
        """One HTTP call; HTTP errors come back as replies, network errors raise."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **self.headers()},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return Reply(status, json.loads(raw or b"{}"))
        except json.JSONDecodeError:
            return Reply(status, {"raw": raw.decode(errors="replace")})

    def complete(self, prompt: str, max_tokens: int, timeout: float = 60.0) -> Reply:
        return self.call(
            "POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, timeout=timeout
        )

    def metrics_text(self) -> str:
        req = urllib.request.Request(self.url + "/metrics", headers=self.headers())
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by its name and labels as printed."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def status(self) -> dict:
        return self.call("GET", "/status", timeout=10).body

    def wait_status(self, ok: Callable[[dict], bool], what: str, timeout_s: float) -> dict:
        """/status once ``ok(status)`` holds (looked at every 0.2 s); AssertionError naming
        ``what`` and the last status when it does not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        body: dict = {}
        while time.monotonic() < deadline:
            body = self.status()
            if ok(body):
                return body
            time.sleep(0.2)
        raise AssertionError(f"/status never showed {what} within {timeout_s} s: {body}")

    def releases(self) -> dict[str, float]:
        """``kvferry_releases_total`` by justification (the proof each release recorded)."""
        return releases_by_justification(self.metrics())

    def held(self, every_rank: bool = False) -> int:
        """Pages owned or quarantined on any healthy rank (a crashed rank's pool is gone),
        or, with ``every_rank``, on any rank at all: when none died, a rank the router
        stopped routing to (severed, silent for a while) still has to free its pages."""
        st = self.status()
        dead = set() if every_rank else {str(r) for r in st.get("unhealthy", {})}
        used = sum(
            r.get("owned", 0) + r.get("quarantined", 0)
            for rank, r in st["ranks"].items()
            if rank not in dead
        )
        held = sum(n for rank, n in st["held_pages"].items() if rank not in dead)
        return max(used, held)

    def fresh_reports(self, timeout_s: float = 5.0) -> list[int]:
        """Wait until every healthy rank has sent two reports (STATS, every 0.5 s) since
        this call, so that at least one of them was sent after it: /status and /metrics
        then show the ranks as of now, not a report already on its way. The ranks that
        had not by the deadline."""
        st = self.status()
        dead = {str(r) for r in st.get("unhealthy", {})}
        start = {r: n for r, n in st.get("reports", {}).items() if str(r) not in dead}
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.status().get("reports", {})
            late = [int(r) for r, n in start.items() if now.get(r, 0) < n + 2]
            if not late or time.monotonic() > deadline:
                return late
            time.sleep(0.1)

    def quiesce(self, timeout_s: float = 20.0, every_rank: bool = False) -> int:
        """Wait until no rank holds a page, judged on reports sent after this call
        (:meth:`fresh_reports`); the pages still held. ``every_rank``: as for :meth:`held`."""
        deadline = time.monotonic() + timeout_s
        self.fresh_reports(min(5.0, timeout_s))
        while True:
            held = self.held(every_rank)
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.2)

    def stop(self) -> None:
        _stop_group(self.proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group ``proc`` leads; SIGKILL it if it is not gone in 15 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


C = TypeVar("C", bound="LocalCluster")


@dataclass
class TwoNodeCluster(LocalCluster):
    """Node 0 (``proc``, ``log``: the router and the first ranks) in the root namespace,
    node 1 (the last ranks) in a namespace of its own behind a veth pair, over tcp. The
    router is reached on 127.0.0.1 as in any local cluster; node 1's end of the link can be
    taken down and brought back (a partition between the nodes, both sides alive)."""

    node1: subprocess.Popen
    node1_log: Path
    node1_host: netns.Host

    def partition(self) -> None:
        self.node1_host.set_link(False)

    def heal(self) -> None:
        self.node1_host.set_link(True)

    def stop(self) -> None:
        _stop_group(self.node1)
        _stop_group(self.proc)


PORT_ATTEMPTS = 3


def start(
    nproc: int,
    args: list[str],
    log_dir: Path,
    startup_s: float = STARTUP_TIMEOUT_S,
    api_key: str | None = None,
) -> LocalCluster:
    """Start ``nproc`` ranks with ``args`` and wait for /health; the log goes to ``log_dir``.
    The HTTP port is picked free but bound only later, by the router: if another process
    took it meanwhile, the cluster is started again on another port. The cluster gets a
    secret of its own and, given ``api_key``, a front door behind it."""
    return _with_port_retries(lambda: _start_once(nproc, args, log_dir, startup_s, api_key))


class PortTaken(RuntimeError):
    """The router could not listen on the port picked for it."""


def _with_port_retries(start_once: Callable[[], C]) -> C:
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return start_once()
        except PortTaken:
            continue
    return start_once()


RANK_THREADS = 1  # torch's threads in each rank: ranks share this host's cores


def cluster_env(secret: str, api_key: str | None) -> dict[str, str]:
    """The environment of one cluster's processes: this one's, with the cluster's own
    secret and API key (or none) in place of any this environment names."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*trusts.SECRET_VARIABLES, trusts.API_KEY_ENV)
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(RANK_THREADS))
    env[trusts.SECRET_ENV] = secret
    if api_key:
        env[trusts.API_KEY_ENV] = api_key
    return env


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _start_once(
    nproc: int, args: list[str], log_dir: Path, startup_s: float, api_key: str | None
) -> LocalCluster:
    port = free_port()
    secret = trusts.generate_secret()
    log = Path(log_dir) / f"cluster-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "kvferry.cluster.launch",
        "--port",
        str(port),
        *args,
    ]
    cluster = LocalCluster(
        _spawn(cmd, log, cluster_env(secret, api_key)),
        f"http://127.0.0.1:{port}",
        log,
        secret=secret,
        api_key=api_key,
    )
    _wait_healthy(cluster, [(cluster.proc, log)], port, startup_s)
    return cluster


def _wait_healthy(
    cluster: LocalCluster,
    nodes: list[tuple[subprocess.Popen, Path]],
    port: int,
    startup_s: float,
    taken: tuple[str, ...] = (),
) -> None:
    """Wait for the router's /health; stop the cluster and raise if a node exits first
    (PortTaken if node 0's log says one of its ports was taken) or the deadline passes."""
    deadline = time.monotonic() + startup_s
    while True:
        for proc, log in nodes:
            if proc.poll() is not None:
                report = startup_report(log)
                cluster.stop()
                if any(
                    s in startup_report(nodes[0][1])
                    for s in (f"cannot listen on 127.0.0.1:{port}", *taken)
                ):
                    raise PortTaken(report)
                raise RuntimeError(f"cluster exited during start-up ({log.name}):\n{report}")
        try:
            if cluster.call("GET", "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            cluster.stop()
            report = "\n".join(f"{log.name}:\n{startup_report(log)}" for _, log in nodes)
            raise RuntimeError(f"cluster not healthy within {startup_s:.0f} s:\n{report}")
        time.sleep(0.3)


# ------------------------------------------------------------------ two nodes
TWO_NODE_NET = "10.79"  # node 0's end of the link is in the root namespace: a /24 under
# this that no route of this machine uses yet is picked per cluster


@contextlib.contextmanager
def two_nodes(
    nproc0: int,
    nproc1: int,
    args: list[str],
    log_dir: Path,
    startup_s: float = STARTUP_TIMEOUT_S,
    api_key: str | None = None,
) -> Iterator[TwoNodeCluster]:
    """A two-node cluster, as ``scripts/serve-node.sh`` starts one on two hosts: torchrun's
    static rendezvous through node 0, ``nproc0`` ranks on node 0 (the router first) and
    ``nproc1`` on node 1, tcp only, each node's UCX and gloo on its end of the veth pair.
    Needs root and iproute2 (:func:`netns.unavailable_reason`). The nodes are stopped and
    the namespace and the link removed on leaving, also on failure."""
    with netns.two_hosts("kf", netns.unused_subnet(TWO_NODE_NET), root_a=True) as (a, b):
        cluster = _with_port_retries(
            lambda: _start_two_nodes(a, b, nproc0, nproc1, args, log_dir, startup_s, api_key)
        )
        try:
            yield cluster
        finally:
            cluster.stop()


def _start_two_nodes(
    a: netns.Host,
    b: netns.Host,
    nproc0: int,
    nproc1: int,
    args: list[str],
    log_dir: Path,
    startup_s: float,
    api_key: str | None = None,
) -> TwoNodeCluster:
    port, master_port = free_port(), free_port()
    secret = trusts.generate_secret()  # the same on both nodes, as serve-node.sh passes it
    logs = [Path(log_dir) / f"cluster-{port}-node{i}.log" for i in (0, 1)]
    procs = [
        _spawn(
            host.command(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    f"--node-rank={i}",
                    f"--nproc-per-node={nproc}",
                    "--rdzv-backend=static",
                    f"--master-addr={a.addr}",
                    f"--master-port={master_port}",
                    "-m",
                    "kvferry.cluster.launch",
                    "--transports",
                    "tcp",
                    "--port",
                    str(port),
                    *args,
                ],
                env={"UCX_NET_DEVICES": host.dev, "GLOO_SOCKET_IFNAME": host.dev},
            ),
            log,
            cluster_env(secret, api_key),
        )
        for i, (host, nproc, log) in enumerate(zip((a, b), (nproc0, nproc1), logs, strict=True))
    ]
    cluster = TwoNodeCluster(
        procs[0],
        f"http://127.0.0.1:{port}",
        logs[0],
        node1=procs[1],
        node1_log=logs[1],
        node1_host=b,
        secret=secret,
        api_key=api_key,
    )
    _wait_healthy(
        cluster,
        list(zip(procs, logs, strict=True)),
        port,
        startup_s,
        taken=("Address already in use",),
    )
    return cluster


# ------------------------------------------------------------------ failure domains
@dataclass
class DomainCluster(LocalCluster):
    """A local cluster run as failure domains: a rendezvous store process, then one
    torchrun job per role group (``proc`` is the router's job). Every job's output goes
    to ``log``. A rank can be killed on its own (:meth:`kill_rank`); its job's torchrun
    restarts it (``max_restarts``) and it rejoins with a new incarnation."""

    store_proc: subprocess.Popen | None = None
    jobs: dict[str, subprocess.Popen] | None = None

    def pid_of(self, rank: int) -> int:
        return int(self.status()["processes"][str(rank)]["pid"])

    def incarnation_of(self, rank: int) -> str:
        return str(self.status()["processes"][str(rank)]["incarnation"])

    def kill_rank(self, rank: int) -> int:
        """SIGKILL ``rank``'s process (not its launcher); returns the pid killed."""
        pid = self.pid_of(rank)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_rejoined(self, rank: int, old_incarnation: str, timeout_s: float) -> str:
        """Until ``rank`` serves again in a new incarnation; returns it."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            inc = st["processes"][str(rank)]["incarnation"]
            if inc != old_incarnation and str(rank) not in st["unhealthy"]:
                return inc
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank} not serving again within {timeout_s:.0f} s: incarnation "
                    f"{inc} (was {old_incarnation}), unhealthy {st['unhealthy']}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """The router first: its SHUTDOWN stops every rank, whose jobs then end with
        status 0 (not restarted); a job still running after that is stopped. Last, any
        rank process of this cluster that outlived its job (torchrun runs its workers in
        sessions of their own, which a SIGKILL of the job does not reach) is killed."""
        _stop_group(self.proc)
        deadline = time.monotonic() + 10
        for proc in (self.jobs or {}).values():
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            _stop_group(proc)
        if self.store_proc is not None:
            _stop_group(self.store_proc)
        kill_leftover_ranks(self.port)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])


def kill_leftover_ranks(port: int) -> list[int]:
    """SIGKILL every ``kvferry.cluster.launch`` process serving the cluster whose front
    door is ``port`` (its command line says ``--port PORT``); returns their pids."""
    wanted = [b"kvferry.cluster.launch", b"--port\x00" + str(port).encode() + b"\x00"]
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read() + b"\x00"
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if all(w in cmdline for w in wanted):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


def start_domains(
    prefill: int,
    decode: int,
    args: list[str],
    log_dir: Path,
    tp: int = 1,
    max_restarts: int = 1,
    startup_s: float = STARTUP_TIMEOUT_S,
    api_key: str | None = None,
    store: str | None = None,
) -> DomainCluster:
    """A local cluster of failure domains (see :class:`DomainCluster`), ``args`` going to
    every rank; waits for /health. ``store``: a store already running (``etcd://...``,
    its TLS and user among ``args``) instead of a TCPStore process of the cluster's own."""
    return _with_port_retries(
        lambda: _start_domains_once(
            prefill, decode, tp, args, log_dir, max_restarts, startup_s, api_key, store
        )
    )


def _start_domains_once(
    prefill: int,
    decode: int,
    tp: int,
    args: list[str],
    log_dir: Path,
    max_restarts: int,
    startup_s: float,
    api_key: str | None = None,
    store: str | None = None,
) -> DomainCluster:
    return _start_domain_jobs(
        Topology(1 + prefill + decode, prefill, decode, tp),
        ["--tp", str(tp), *args],
        log_dir,
        max_restarts,
        startup_s,
        store_host="127.0.0.1",
        place=lambda job, cmd: cmd,
        api_key=api_key,
        store=store,
    )


def _start_domain_jobs(
    topology: Topology,
    args: list[str],
    log_dir: Path,
    max_restarts: int,
    startup_s: float,
    store_host: str,
    place: Callable[[domains.Job, list[str]], list[str]],
    api_key: str | None = None,
    store: str | None = None,
) -> DomainCluster:
    """The store (listening on ``store_host``, and there only; or ``store``, running
    already) and one job per role group, each job's command as ``place`` wraps it (run on
    another host: in its namespaces)."""
    port, store_port = free_port(), free_port()
    log = Path(log_dir) / f"cluster-{port}.log"
    log.write_bytes(b"")
    listen = store_host
    secret = trusts.generate_secret()
    env = cluster_env(secret, api_key)
    store_proc = None
    if store is None:
        store = f"{store_host}:{store_port}"
        store_proc = _spawn_appending(
            [
                sys.executable,
                "-m",
                "kvferry.cluster.store",
                "--host",
                listen,
                "--port",
                str(store_port),
            ],
            log,
            {k: v for k, v in env.items() if k not in trusts.SECRET_VARIABLES},
        )
    role_args = ["--prefill", str(topology.prefill), "--port", str(port), *args]
    jobs: dict[str, subprocess.Popen] = {}
    for job in domains.plan_jobs(topology):
        cmd = domains.job_command(job, topology.world_size, store, role_args, max_restarts)
        jobs[job.name] = _spawn_appending(place(job, cmd), log, env)
    cluster = DomainCluster(
        jobs["router"],
        f"http://127.0.0.1:{port}",
        log,
        store_proc=store_proc,
        jobs=jobs,
        secret=secret,
        api_key=api_key,
    )
    _wait_healthy(
        cluster,
        [(p, log) for p in [*([store_proc] if store_proc else []), *jobs.values()]],
        port,
        startup_s,
        taken=(f"cannot listen on {listen}:{store_port}", "Address already in use"),
    )
    return cluster


def _spawn_appending(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """As :func:`_spawn`, every process appending to one log (whole lines)."""
    return subprocess.Popen(
        cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


@contextlib.contextmanager
def domains_two_hosts(
    remote_prefill: int,
    local_prefill: int,
    args: list[str],
    log_dir: Path,
    max_restarts: int = 2,
    startup_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[DomainCluster]:
    """A cluster of failure domains on two "hosts": host a (the root namespace) runs the
    store, the router, ``local_prefill`` prefill ranks and one decode rank; host b (a
    network namespace and a PID namespace of its own, behind a veth pair) runs the first
    ``remote_prefill`` prefill ranks. tcp only. An owner on host a cannot see host b's
    processes, so a writer that died there is proven gone only by its launcher's exit
    record. Needs root, iproute2 and util-linux's unshare."""
    with netns.two_hosts("kd", netns.unused_subnet(TWO_NODE_NET), root_a=True) as (a, b):
        cluster = _with_port_retries(
            lambda: _start_domains_two_hosts(
                a, b, remote_prefill, local_prefill, args, log_dir, max_restarts, startup_s
            )
        )
        try:
            yield cluster
        finally:
            cluster.stop()


def _start_domains_two_hosts(
    a: netns.Host,
    b: netns.Host,
    remote_prefill: int,
    local_prefill: int,
    args: list[str],
    log_dir: Path,
    max_restarts: int,
    startup_s: float,
) -> DomainCluster:
    prefill = remote_prefill + local_prefill

    def place(job: domains.Job, cmd: list[str]) -> list[str]:
        remote = job.name.startswith("prefill") and job.first_rank <= remote_prefill
        host = b if remote else a
        return host.command(cmd, env={"UCX_NET_DEVICES": host.dev}, own_pids=remote)

    return _start_domain_jobs(
        Topology(2 + prefill, prefill, 1),
        ["--transports", "tcp", *args],
        log_dir,
        max_restarts,
        startup_s,
        store_host=a.addr,
        place=place,
    )
