"""Fixtures for the cluster tests (see cluster_harness.py)."""
from __future__ import annotations

import pytest

from cluster_harness import LocalCluster, start_cluster


@pytest.fixture
def cluster_factory(tmp_path):
    started: list[LocalCluster] = []

    def make(nproc: int, *args: str) -> LocalCluster:
        c = start_cluster(tmp_path, nproc, *args)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()
