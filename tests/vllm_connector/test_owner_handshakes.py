"""A decode worker's handshakes with a prefill (cluster/vllm/owner_host.py): a failed one
fails the loads waiting for it and is remembered a while, so that loads right after fail
at once with its reason; a load that comes later asks again (the prefill may have been
starting, or has restarted) and is planned once the handshake comes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from owner_fakes import KEY, W_INC, W_PID, make_owner, spec

from kvferry.cluster.vllm import owner_host, wire
from kvferry.transfer.protocol import ADDRESS, CODEC


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


RESTARTED_ADDR = CODEC.encode(
    ADDRESS.make(
        ucx=b"ucx2", incarnation=W_INC + 1, name="prefill0", host="h2", boot_id="b2", pidns=1,
        pid=W_PID + 1,
    )
)  # fmt: skip


def _restarted(o) -> dict:
    """The handshake of the prefill engine restarted at KEY: another engine id, and its
    worker at another transfer address."""
    hs = o.handshake()
    hs["engine_id"] = "prefill-1"
    hs["workers"][0] = {**hs["workers"][0], "address": RESTARTED_ADDR, "pid": W_PID + 1}
    return hs


@pytest.mark.parametrize("broken", [False, True], ids=["asks-again", "broken-cached-forever"])
def test_a_load_from_an_engine_restarted_at_the_same_address_fetches_it_again(monkeypatch, broken):
    """The prefill engine at KEY restarts (a fixed side-channel port): a load whose ticket
    names the new engine is planned against the new engine's workers, fetched again,
    never against the dead ones cached. Broken mode: the cached handshake is used, and
    the plan goes to an address nobody serves."""
    if broken:
        monkeypatch.setattr(
            owner_host.OwnerHost, "_handshake", lambda self, remote: (self.handshakes.get(KEY), "")
        )
    o = make_owner()
    host, fetcher = o.host, o.host.fetcher
    host.on_recv("d-1", spec("p-1"))
    fetcher.results.append((KEY, o.handshake(), ""))
    host.poll()
    old_plan = o.link.sent[-1][0]
    o.clock.t += 2 * owner_host.HANDSHAKE_RETRY_S
    new = {**spec("p-2"), "engine": "prefill-1", "blocks": [0, 2, 5, 7]}
    host.on_recv("d-2", new)
    host.poll()
    if broken:
        assert [a for a, m in o.link.sent if m.get("orid") == "d-2"] == [old_plan]
        return
    assert fetcher.asks[-1] == (KEY, True)
    assert not [m for _, m in o.link.sent if m.get("orid") == "d-2"]  # waits for it
    fetcher.results.append((KEY, _restarted(o), ""))
    host.poll()
    sent = [(a, m["k"]) for a, m in o.link.sent if m.get("orid") == "d-2"]
    assert sent == [(RESTARTED_ADDR, wire.PLAN)]


def test_a_load_whose_engine_is_gone_from_its_address_fails_at_once():
    """The handshake just fetched at KEY names another engine than the load's ticket: the
    prompt's engine is gone, so the load fails (vLLM computes the prompt) and nothing is
    planned."""
    o = make_owner()
    host, fetcher = o.host, o.host.fetcher
    host.on_recv("d-1", {**spec("p-1"), "engine": "prefill-gone"})
    fetcher.results.append((KEY, o.handshake(), ""))
    host.poll()
    assert "d-1" in host.failed_recving and not o.link.of(wire.PLAN)


@pytest.mark.parametrize("refused", ["reused-id", "scheduler-refused"])
def test_a_load_refused_before_any_plan_is_reported_failed_at_once(refused):
    """A request id this worker loaded already (a client naming its requests), or a load
    the scheduler refused (a shape kvferry cannot load): nothing is planned, and the load
    is reported failed at once, its blocks as load errors, so vLLM computes the prompt
    rather than wait for good."""
    o = make_owner()
    host, fetcher = o.host, o.host.fetcher
    if refused == "reused-id":
        host.on_recv("d-1", spec("p-1"))
        fetcher.results.append((KEY, o.handshake(), ""))
        host.poll()
        host.on_scheduler_abort("d-1", "client gone")
        host.on_ack(host.loads["d-1"], 0)
        assert "d-1" in host.finished_recving and "d-1" in host.tombstones
        host.finished_recving.clear()
        host.on_recv("d-1", {**spec("p-2"), "blocks": [0, 2, 5, 7]})
    else:
        host.on_recv("d-1", {**spec("p-1"), "blocks": [0, 2, 5, 7], "refused": "two groups"})
    plans = len(o.link.of(wire.PLAN))
    host.poll()
    assert "d-1" in host.finished_recving and "d-1" in host.failed_recving
    assert host.load_errors >= {0, 2, 5, 7}
    assert len(o.link.of(wire.PLAN)) == plans  # nothing planned for it
