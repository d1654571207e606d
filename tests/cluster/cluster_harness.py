"""A real local cluster under torchrun for the integration tests. Every wait is bounded."""
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
from dataclasses import dataclass, field
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    status: int
    body: dict


@dataclass
class LocalCluster:
    proc: subprocess.Popen
    url: str
    log: Path
    args: list[str] = field(default_factory=list)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 60.0) -> Reply:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        try:
            return Reply(status, json.loads(raw))
        except json.JSONDecodeError:
            return Reply(status, {"raw": raw.decode(errors="replace")})

    def complete(self, prompt: str, max_tokens: int, timeout: float = 60.0) -> Reply:
        return self.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens},
                            timeout=timeout)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def status(self) -> dict:
        return self.request("GET", "/status").body

    def wait_quiesced(self, timeout_s: float = 20.0) -> dict:
        """Wait until no rank holds a page (ranks report every 0.5 s); returns the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            used = sum(r.get("owned", 0) + r.get("quarantined", 0) for r in st["ranks"].values())
            if (used == 0 and sum(st["held_pages"].values()) == 0) or time.monotonic() > deadline:
                return st
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def start_cluster(tmp_path: Path, nproc: int, *args: str) -> LocalCluster:
    port = free_port()
    log = tmp_path / f"cluster-{port}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "kvferry.cluster.launch", "--port", str(port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    cluster = LocalCluster(proc, f"http://127.0.0.1:{port}", log, list(args))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"cluster exited during start-up:\n{log.read_text()[-3000:]}")
        try:
            if cluster.request("GET", "/health", timeout=2).status == 200:
                return cluster
        except OSError:
            pass
        if time.monotonic() > deadline:
            cluster.stop()
            raise RuntimeError(f"cluster not healthy in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


