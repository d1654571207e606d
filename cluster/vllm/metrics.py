"""The connector's figures for vLLM's stats logger and Prometheus endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found]
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = (
    "bytes",
    "pages",
    "parts",
    "quarantined_blocks",
    "severed_peers",
    "checksum_failures",
    "malformed_messages",
    "internal_errors",
    "stale_messages",
    "unauthenticated_messages",
    "replayed_messages",
)


@dataclass
class KvferryStats(KVConnectorStats):
    """Counters, transfer times (ms) and aborts by source, summed across workers."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, transfer_ms: float | None = None, **counts: int) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v
        if transfer_ms is not None:
            self.data.setdefault("transfer_ms", []).append(transfer_ms)

    def count(self, name: str) -> None:
        self.add(**{name: 1})

    def abort(self, source: str) -> None:
        aborts = self.data.setdefault("aborts", {})
        aborts[source] = aborts.get(source, 0) + 1

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        for k, v in other.data.items():
            if k == "transfer_ms":
                self.data.setdefault(k, []).extend(v)
            elif k == "aborts":
                for src, n in v.items():
                    mine = self.data.setdefault("aborts", {})
                    mine[src] = mine.get(src, 0) + n
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        times = self.data.get("transfer_ms", [])
        out["transfers"] = len(times)
        out["transfer_ms_avg"] = round(sum(times) / len(times), 3) if times else 0.0
        for src, n in self.data.get("aborts", {}).items():
            out[f"aborts_{src}"] = n
        return out

    def is_empty(self) -> bool:
        return not self.data


class KvferryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvferry_*`` counters per engine, and a histogram of transfer times."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name in COUNTERS:
            c = self._counter_cls(
                name=f"vllm:kvferry_{name}", documentation=f"kvferry: {name}", labelnames=labelnames
            )
            self.counters[name] = {e: c.labels(*v) for e, v in per_engine_labelvalues.items()}
        aborts = self._counter_cls(
            name="vllm:kvferry_aborts",
            documentation="kvferry: aborted loads and sends by source",
            labelnames=[*labelnames, "source"],
        )
        self.aborts = aborts
        hist = self._histogram_cls(
            name="vllm:kvferry_transfer_seconds",
            documentation="kvferry: plan to verified notice",
            labelnames=labelnames,
            buckets=[0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0],
        )
        self.hist = {e: hist.labels(*v) for e, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, by_engine in self.counters.items():
            n = transfer_stats_data.get(name, 0)
            if n:
                by_engine[engine_idx].inc(n)
        for ms in transfer_stats_data.get("transfer_ms", []):
            self.hist[engine_idx].observe(ms / 1e3)
        labels = self.per_engine_labelvalues[engine_idx]
        for src, n in transfer_stats_data.get("aborts", {}).items():
            self.aborts.labels(*labels, src).inc(n)
