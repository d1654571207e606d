"""A decode worker's handshakes with a prefill (cluster/vllm/owner_host.py): a failed one
fails the loads waiting for it and is remembered a while, so that loads right after fail
at once with its reason; a load that comes later asks again (the prefill may have been
starting, or has restarted) and is planned once the handshake comes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from owner_fakes import KEY, make_owner, spec

from kvferry.cluster.vllm import owner_host, wire


@pytest.mark.parametrize("broken", [False, True], ids=["asks-again", "broken-remembered-forever"])
def test_a_failed_handshake_is_asked_again_by_a_later_load(monkeypatch, broken):
    retry_s = owner_host.HANDSHAKE_RETRY_S
    if broken:
        monkeypatch.setattr(owner_host, "HANDSHAKE_RETRY_S", float("inf"))
    o = make_owner()
    host, fetcher = o.host, o.host.fetcher
    host.on_recv("d-1", spec("p-1"))
    assert fetcher.asks == [(KEY, False)]
    fetcher.results.append((KEY, None, "ConnectionRefusedError: not up yet"))
    host.poll()
    assert "d-1" in host.failed_recving
    host.on_recv("d-2", spec("p-2"))  # at once: the same reason, no new fetch
    host.poll()
    assert "d-2" in host.failed_recving and (KEY, True) not in fetcher.asks
    o.clock.t += retry_s
    host.on_recv("d-3", spec("p-3"))
    if broken:
        host.poll()
        assert "d-3" in host.failed_recving
        return
    assert fetcher.asks[-1] == (KEY, True)
    fetcher.results.append((KEY, o.handshake(), ""))
    host.poll()
    assert "d-3" not in host.failed_recving
    assert [m["orid"] for m in o.link.of(wire.PLAN)] == ["d-3"]
