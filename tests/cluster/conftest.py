"""Fixtures for the cluster tests: real local clusters (kvferry.cluster.harness.localcluster)."""

from __future__ import annotations

import os

import pytest

from kvferry.cluster.harness.localcluster import LocalCluster, start
from kvferry.cluster.trust import SECRET_ENV, generate_secret

# One secret for this test session and the processes it starts (a launcher test's rank
# publishes what this process reads back); every local cluster still gets its own.
os.environ.setdefault(SECRET_ENV, generate_secret())


@pytest.fixture
def cluster_factory(tmp_path):
    started: list[LocalCluster] = []

    def make(nproc: int, *args: str) -> LocalCluster:
        c = start(nproc, list(args), tmp_path, startup_s=90.0)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()
