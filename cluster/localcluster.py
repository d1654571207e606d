"""A local cluster under ``torchrun --standalone``, driven over HTTP: what the fault suite,
the soak, the benchmarks and the integration tests start and talk to. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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


class Reply(NamedTuple):
    status: int
    body: dict


@dataclass
class LocalCluster:
    proc: subprocess.Popen
    url: str
    log: Path

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 60.0) -> Reply:
        """One HTTP call; HTTP errors come back as replies, network errors raise."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
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
        return self.call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens},
                         timeout=timeout)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
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

    def held(self) -> int:
        """Pages owned or quarantined on any healthy rank (a crashed rank's pool is gone)."""
        st = self.status()
        dead = {str(r) for r in st.get("unhealthy", {})}
        used = sum(r.get("owned", 0) + r.get("quarantined", 0)
                   for rank, r in st["ranks"].items() if rank not in dead)
        held = sum(n for rank, n in st["held_pages"].items() if rank not in dead)
        return max(used, held)

    def quiesce(self, timeout_s: float = 20.0) -> int:
        """Wait until no rank holds a page (ranks report every 0.5 s); the pages still held."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held()
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


PORT_ATTEMPTS = 3


def start(nproc: int, args: list[str], log_dir: Path,
          startup_s: float = STARTUP_TIMEOUT_S) -> LocalCluster:
    """Start ``nproc`` ranks with ``args`` and wait for /health; the log goes to ``log_dir``.
    The HTTP port is picked free but bound only later, by the router: if another process
    took it meanwhile, the cluster is started again on another port."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _start_once(nproc, args, log_dir, startup_s)
        except PortTaken:
            continue
    return _start_once(nproc, args, log_dir, startup_s)


class PortTaken(RuntimeError):
    """The router could not listen on the port picked for it."""


def _start_once(nproc: int, args: list[str], log_dir: Path, startup_s: float) -> LocalCluster:
    port = free_port()
    log = Path(log_dir) / f"cluster-{port}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "kvferry.cluster.launch", "--port", str(port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    cluster = LocalCluster(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            report = startup_report(log)
            if f"cannot listen on 127.0.0.1:{port}" in report:
                raise PortTaken(report)
            raise RuntimeError(f"cluster exited during start-up:\n{report}")
        try:
            if cluster.call("GET", "/health", timeout=2).status == 200:
                return cluster
        except OSError:
            pass
        if time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"cluster not healthy within {startup_s:.0f} s:\n{startup_report(log)}")
        time.sleep(0.3)
