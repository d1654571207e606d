"""The connector's figures through vLLM's own stats plumbing: the Prometheus metrics vLLM
builds from the connector class (KVConnectorProm -> build_prom_metrics) and the interval
log (KVConnectorLogging -> build_kv_connector_stats, aggregate, reduce)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from kvferry.cluster.vllm.metrics import COUNTERS, KvferryStats

LABELS = ["model_name", "engine"]
ENGINES = {0: ["m", "0"], 1: ["m", "1"]}


def _worker_stats(bytes_: int, pages: int, ms: list[float], aborts: dict[str, int]) -> dict:
    stats = KvferryStats()
    for t in ms:
        stats.add(transfer_ms=t, bytes=bytes_ // len(ms), pages=pages // len(ms))
    for source, n in aborts.items():
        for _ in range(n):
            stats.abort(source)
    stats.count("severed_peers")
    return stats.data


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return h.vllm_config(h.model_dir(tmp_path_factory.mktemp("model")), "kv_consumer", "d0", {}, 1)


def test_prometheus_counts_each_engine_apart(config):
    """Counters per engine label, aborts by source, the transfer histogram in seconds;
    an engine that observed nothing stays at zero."""
    unregister_vllm_metrics()
    prom = KVConnectorProm(config, LABELS, ENGINES)
    assert prom.prom_metrics is not None, "vLLM did not build the connector's metrics"
    prom.observe(_worker_stats(4096, 4, [2.0, 6.0], {"client": 2, "timeout": 1}), engine_idx=1)
    prom.observe(_worker_stats(1024, 2, [1.0], {}), engine_idx=1)

    def sample(name: str, engine: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"model_name": "m", "engine": engine, **extra})

    assert sample("vllm:kvferry_bytes_total", "1") == 4096 + 1024
    assert sample("vllm:kvferry_pages_total", "1") == 6
    assert sample("vllm:kvferry_severed_peers_total", "1") == 2
    assert sample("vllm:kvferry_bytes_total", "0") == 0
    assert sample("vllm:kvferry_aborts_total", "1", source="client") == 2
    assert sample("vllm:kvferry_aborts_total", "1", source="timeout") == 1
    assert sample("vllm:kvferry_transfer_seconds_count", "1") == 3
    assert sample("vllm:kvferry_transfer_seconds_sum", "1") == pytest.approx(0.009)
    assert sample("vllm:kvferry_transfer_seconds_bucket", "1", le="0.005") == 2
    for name in COUNTERS:  # every counter is registered for every engine
        assert sample(f"vllm:kvferry_{name}_total", "0") == 0
    unregister_vllm_metrics()


def test_the_interval_log_sums_workers_and_averages_transfer_times(config):
    logging = KVConnectorLogging(config.kv_transfer_config)
    logging.observe(_worker_stats(4096, 4, [2.0, 6.0], {"client": 1}))
    logging.observe(_worker_stats(1024, 2, [1.0], {"client": 1, "peer": 1}))
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "bytes=5120" in line and "pages=6" in line and "transfers=3" in line
    assert "transfer_ms_avg=3.0" in line and "aborts_client=2" in line and "aborts_peer=1" in line
    assert "severed_peers=2" in line
    lines.clear()
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == []  # reset after each interval: nothing new, nothing logged
