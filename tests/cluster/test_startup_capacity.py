"""I3 through a real cluster: ranks whose measured pool is below the context length refuse
to start, naming both numbers, unless the operator lowers the context length; then the
cluster serves the measured capacity and reports it."""

from __future__ import annotations

import pytest

from kvferry.cluster.harness.localcluster import start

pytestmark = pytest.mark.slow


def test_ranks_refuse_a_pool_below_the_context_length(tmp_path):
    with pytest.raises(RuntimeError) as err:
        start(3, ["--context-length", "8192", "--pool-tokens", "4096"], tmp_path, startup_s=90.0)
    log = str(err.value)
    assert "refusing to start" in log and "4096" in log and "8192" in log


def test_an_explicitly_lowered_context_length_starts_and_is_reported(cluster_factory):
    c = cluster_factory(
        3, "--context-length", "8192", "--pool-tokens", "4096", "--lower-context-length"
    )
    cap = c.call("GET", "/capacity").body
    assert cap["context_length"] == 4096
    assert all(r["capacity_tokens"] == 4096 and r["ok"] for r in cap["ranks"])
    reply = c.complete("x" * 4000, 200)  # over the lowered length: refused (I1)
    assert reply.status == 400 and reply.body["context_length"] == 4096
    assert "lowered by the operator" in c.log.read_text()


def test_a_taken_port_is_named_and_the_cluster_starts_on_another(tmp_path, monkeypatch):
    """The router binds its HTTP port after the ranks start; if another process holds it,
    the router says so (ERROR line) and the local cluster starts again on another port."""
    import socket

    from kvferry.cluster.harness import localcluster

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken])
        real = localcluster.free_port
        monkeypatch.setattr(localcluster, "free_port", lambda: next(ports, None) or real())
        cluster = localcluster.start(3, [], tmp_path, startup_s=90.0)
        try:
            assert cluster.url != f"http://127.0.0.1:{taken}"
            assert cluster.call("GET", "/health").status == 200
            first = (tmp_path / f"cluster-{taken}.log").read_text()
            assert f"cannot listen on 127.0.0.1:{taken}" in first
        finally:
            cluster.stop()
