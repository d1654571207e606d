"""Fixtures for the cluster tests: real local clusters (kvferry.cluster.harness.localcluster)."""

from __future__ import annotations

import pytest

from kvferry.cluster.harness.localcluster import LocalCluster, start


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
