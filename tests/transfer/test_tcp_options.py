"""The engine's tcp defaults beside its failure detection: UCX reads a ready socket up to
``TCP_MAX_POLL`` times a progress call (kvferry.transfer.config.TCP_THROUGHPUT_OPTIONS),
set wherever tcp is in use, never where it is not, and an operator's ``UCX_TCP_MAX_POLL``
wins."""

from __future__ import annotations

from kvferry.transfer import TransferConfig, TransferEngine
from kvferry.transfer.config import TCP_THROUGHPUT_OPTIONS, plan_options


def test_tcp_reads_a_ready_socket_many_times_a_progress_call():
    assert int(TCP_THROUGHPUT_OPTIONS["TCP_MAX_POLL"]) > 16  # UCX's own default
    for transports in ("tcp", None, "tcp,sm,self"):
        opts = TransferConfig(transports=transports).resolved_ucx_options()
        assert opts["TCP_MAX_POLL"] == TCP_THROUGHPUT_OPTIONS["TCP_MAX_POLL"], transports
    for transports in ("shm", "rdma"):
        assert "TCP_MAX_POLL" not in TransferConfig(transports=transports).resolved_ucx_options()


def test_the_operators_max_poll_wins():
    cfg = TransferConfig(transports="tcp")
    env = {"UCX_TCP_MAX_POLL": "16"}
    plan = plan_options(cfg.resolved_ucx_options(), cfg.engine_defaults(), {}, env)
    assert plan.operator == {"UCX_TCP_MAX_POLL": "16"}
    assert "UCX_TCP_MAX_POLL" not in plan.environment
    explicit = {"TCP_MAX_POLL": "64"}
    cfg = TransferConfig(transports="tcp", ucx_options=explicit)
    plan = plan_options(cfg.resolved_ucx_options(), cfg.engine_defaults(), explicit, env)
    assert plan.environment["UCX_TCP_MAX_POLL"] == "64" and not plan.operator


def test_a_tcp_engine_reports_the_option_it_set(monkeypatch):
    monkeypatch.delenv("UCX_TCP_MAX_POLL", raising=False)
    engine = TransferEngine(TransferConfig(transports="tcp", name="max-poll"))
    try:
        described = engine.describe()
        assert described["ucx_options"]["TCP_MAX_POLL"] == TCP_THROUGHPUT_OPTIONS["TCP_MAX_POLL"]
        assert "TCP_MAX_POLL" not in str(described["ucx_unavailable"])
    finally:
        engine.shutdown()
