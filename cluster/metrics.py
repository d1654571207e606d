"""Cluster-wide metrics, exported by the router in Prometheus text format (I6).

prometheus_client provides the registry, the text exposition and the histogram buckets, so
the output is what Prometheus scrapers expect without code of our own. Per-rank figures
(pages by state, bytes moved) arrive in STATS messages and are set as labelled gauges, so
one scrape of the router shows the whole cluster.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvferry.engine.protocol.words import Answer

OUTCOMES = tuple(Answer)


class ClusterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvferry_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.aborts = Counter("kvferry_aborts", "Aborts by source", ["source"], registry=r)
        self.releases = Counter(
            "kvferry_releases",
            "Page releases (rank, request) by the proof that made each safe: every writer's "
            "notice or ack after its flush, or its end (process gone, exit record past the "
            "horizon); 'none' only in the unsafe modes",
            ["justification"],
            registry=r,
        )
        self.pages = Gauge(
            "kvferry_pages", "KV pool pages by state", ["rank", "role", "state"], registry=r
        )
        self.capacity = Gauge(
            "kvferry_pool_capacity_tokens", "Measured pool capacity", ["rank", "role"], registry=r
        )
        self.context_length = Gauge(
            "kvferry_context_length_tokens", "Context length the cluster serves", registry=r
        )
        self.bytes_moved = Gauge(
            "kvferry_transfer_bytes", "Bytes written one-sided, per rank", ["rank"], registry=r
        )
        self.batches = Gauge(
            "kvferry_transfer_batches", "Write batches posted, per rank", ["rank"], registry=r
        )
        self.integrity_failures = Gauge(
            "kvferry_integrity_failures",
            "Pages that failed checksum, canary or length checks",
            ["rank"],
            registry=r,
        )
        self.allocations = Gauge(
            "kvferry_page_allocations", "Page grants made, per rank", ["rank"], registry=r
        )
        self.severed = Gauge(
            "kvferry_severed_peers", "Peers severed after an abort deadline", ["rank"], registry=r
        )
        self.dropped_messages = Gauge(
            "kvferry_dropped_messages",
            "Control messages dropped (duplicate, stale, malformed, unauthenticated: no "
            "valid MAC of the cluster's secret; duplicate_assign: a decode rank's second "
            "ASSIGN of a live request, the router's bug)",
            ["rank", "reason"],
            registry=r,
        )
        self.transfer_latency = Histogram(
            "kvferry_transfer_seconds",
            "From write plan to the last writer's notice",
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
        )
        self.abort_release = Histogram(
            "kvferry_abort_release_seconds",
            "From the abort's first sign at the owner (its ABORT or a writer's ack) to its "
            "pages' release",
            registry=r,
            buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1, 5, 30),
        )
        self.abort_from_router = Histogram(
            "kvferry_abort_from_router_seconds",
            "From the router's ABORT to the owner's release (owner's clock on this host, "
            "else until its RELEASED arrived)",
            registry=r,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 1, 5, 30),
        )
        self.ttft = Histogram(
            "kvferry_time_to_first_token_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )

    def set_rank_stats(self, rank: int, role: str, stats: dict) -> None:
        labels = str(rank)
        for state in ("free", "owned", "quarantined"):
            self.pages.labels(labels, role, state).set(stats.get(state, 0))
        self.capacity.labels(labels, role).set(stats.get("capacity_tokens", 0))
        self.bytes_moved.labels(labels).set(stats.get("bytes_written", 0))
        self.batches.labels(labels).set(stats.get("batches", 0))
        self.integrity_failures.labels(labels).set(stats.get("integrity_failures", 0))
        self.severed.labels(labels).set(stats.get("severed", 0))
        self.allocations.labels(labels).set(stats.get("allocations", 0))
        for reason, count in stats.get("dropped", {}).items():
            self.dropped_messages.labels(labels, reason).set(count)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
