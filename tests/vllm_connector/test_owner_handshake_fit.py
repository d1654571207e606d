"""A prefill's handshake that does not fit (cluster/vllm/handshake.py): from an engine of
another version, or a buggy one, that holds the secret. Its loads fail with the reason, in
``finished_recving`` and ``failed_recving``; nothing raises out of the worker's poll into
vLLM, and no load waits without a deadline. A writer's exit, the decode's proof that its
writes cannot land (I4), is watched on the process behind its transfer address, never a
pid the card names."""

from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from owner_fakes import KEY, W_ADDR, make_owner, spec

from kvferry.cluster.vllm import owner_host, wire
from kvferry.cluster.vllm.handshake import handshake_problem
from kvferry.transfer.protocol import ADDRESS, CODEC


def _card(hs: dict) -> dict:
    return hs["workers"][0]


def _address(pid: int, host: str = "h2", incarnation: int = 7) -> bytes:
    return CODEC.encode(
        ADDRESS.make(
            ucx=b"u", incarnation=incarnation, name="w", host=host, boot_id="b", pidns=1, pid=pid
        )
    )


UNFIT = {
    "not a map": (lambda hs: [hs], "not a map"),
    "no workers": (lambda hs: hs.pop("workers"), "workers is a NoneType"),
    "workers a list": (lambda hs: hs.update(workers=[_card(hs)]), "workers is a list"),
    "from an older kvferry": (lambda hs: hs.pop("wire"), "its control messages are an older"),
    "another codec version": (lambda hs: hs.update(wire=5), "are kvf.vllm 5, this engine's"),
    "tp_size None": (lambda hs: hs.update(tp_size=None), "tp_size None"),
    "tp_size 0": (lambda hs: hs.update(tp_size=0), "tp_size 0"),
    "kv_heads a string": (lambda hs: hs.update(kv_heads="4 heads"), "kv_heads '4 heads'"),
    "a rank past tp_size": (lambda hs: hs["workers"].update({1: {}}), "TP ranks [0, 1]"),
    "a rank missing": (lambda hs: hs.update(tp_size=2), "tp_size 2 needs 0 to 1"),
    "regions without buffers": (
        lambda hs: _card(hs).update(regions={"layout": "NHD"}),
        "KV geometry does not parse",
    ),
    "regions a list": (lambda hs: _card(hs).update(regions=[1, 2]), "KV geometry does not parse"),
    "no regions": (lambda hs: _card(hs).pop("regions"), "no KV geometry"),
    "address a string": (lambda hs: _card(hs).update(address="w0"), "address is a str"),
    "address None": (lambda hs: _card(hs).update(address=None), "address is a NoneType"),
    "address garbage": (lambda hs: _card(hs).update(address=b"\x93xx"), "does not decode"),
    "no pid": (lambda hs: _card(hs).pop("pid"), "its pid None"),
    "pid a string": (lambda hs: _card(hs).update(pid="n/a"), "its pid 'n/a'"),
    "pid 0": (lambda hs: _card(hs).update(pid=0), "its pid 0 is not"),
    "pid not the address's": (lambda hs: _card(hs).update(pid=1), "its pid 1 is not"),
}


# handshakes the plan refused already before they were checked on arrival (its message
# now names the field); every other one raised into vLLM, hung its load, or was planned
REFUSED_BEFORE = {"tp_size 0", "a rank missing", "no regions"}


def _unfit(o, name: str) -> dict | list:
    hs = o.handshake()
    change, _ = UNFIT[name]
    out = change(hs)
    return out if isinstance(out, list) else hs


@pytest.mark.parametrize("name", list(UNFIT))
@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-unchecked"])
def test_a_handshake_that_does_not_fit_fails_its_loads_and_raises_nothing(
    monkeypatch, name, broken
):
    """Broken mode: the handshake taken unchecked, as before (the load raises into vLLM,
    waits for ever, or is planned from fields that do not fit)."""
    if broken:
        monkeypatch.setattr(owner_host, "handshake_problem", lambda hs: "")
        monkeypatch.setattr(owner_host.OwnerHost, "_try_assign", owner_host.OwnerHost._assign)
    o = make_owner()
    host = o.host
    host.on_recv("d-1", spec("p-1"))
    host.fetcher.results.append((KEY, _unfit(o, name), ""))
    try:
        host.poll()
        raised = None
    except Exception as exc:
        raised = exc
    if broken:
        if name in REFUSED_BEFORE:
            return  # refused by the plan's own checks, as before
        planned = [m["orid"] for m in o.link.of(wire.PLAN)] == ["d-1"]
        assert raised is not None or "d-1" not in host.failed_recving or planned
        return
    assert raised is None
    assert "d-1" in host.failed_recving and "d-1" in host.finished_recving
    assert not o.link.of(wire.PLAN)
    why = host.handshake_errors[KEY][0]
    assert why.startswith("its handshake does not fit: ") and UNFIT[name][1] in why, why
    host.on_recv("d-2", spec("p-2"))  # a load right after fails at once, with the reason
    assert "d-2" in host.failed_recving


def test_a_scheduler_abort_of_a_load_from_an_unfit_handshake_is_reported():
    o = make_owner()
    host = o.host
    host.on_recv("d-1", spec("p-1"))
    hs = o.handshake()
    hs.pop("workers")
    host.fetcher.results.append((KEY, hs, ""))
    host.poll()
    host.on_scheduler_abort("d-1", "client gone")  # ended already: nothing raises
    assert "d-1" in host.finished_recving and "d-1" not in host.loads


def _reaped_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("card_pid", ["zero", "reaped"])
@pytest.mark.parametrize("broken", [False, True], ids=["address-pid", "broken-card-pid"])
def test_a_writers_exit_is_watched_on_the_process_behind_its_address(monkeypatch, card_pid, broken):
    """A local writer, alive (this test's process), whose card names another pid (0, or a
    process that exited): the load is refused before anything is planned, and a planned
    writer is watched through its address's pid. Broken mode: the card's pid taken
    unchecked; the live writer is "proven gone" and its blocks go back to vLLM with
    neither its notice nor its ack (I4)."""
    if broken:
        monkeypatch.setattr(owner_host, "handshake_problem", lambda hs: "")

        assign = owner_host.OwnerHost._assign

        def card_pid_of(self, o):  # the writer's pid as the card names it
            assign(self, o)
            for link in o.links:
                link.pid = int(link.card["pid"])

        monkeypatch.setattr(owner_host.OwnerHost, "_assign", card_pid_of)
    o = make_owner()
    host = o.host
    host.on_recv("d-1", spec("p-1"))
    hs = o.handshake()
    _card(hs)["address"] = _address(os.getpid(), host="h")  # this host: watched by its pid
    _card(hs)["pid"] = 0 if card_pid == "zero" else _reaped_pid()
    host.fetcher.results.append((KEY, hs, ""))
    host.poll()
    if not broken:
        assert not o.link.of(wire.PLAN) and "d-1" in host.failed_recving
        assert "its pid" in host.handshake_errors[KEY][0]
        return
    load = host.loads["d-1"]
    assert [m["orid"] for m in o.link.of(wire.PLAN)] == ["d-1"]
    for _ in range(30):  # 3 s: no notice, no ack from the writer, whose process lives
        o.clock.t += 0.1
        host.poll()
        host.timers.fire_due()
    assert not (load.book.noticed | load.book.acked)
    assert "d-1" in host.finished_recving  # the test catches blocks given back unproven


def test_a_planned_writers_pid_is_its_addresses():
    o = make_owner()
    host = o.host
    host.on_recv("d-1", spec("p-1"))
    host.fetcher.results.append((KEY, o.handshake(), ""))
    host.poll()
    (link,) = host.loads["d-1"].links
    assert link.card["address"] == W_ADDR and link.pid == 4242 and not link.local


def test_two_ranks_on_one_address_are_refused():
    """Two writers of one load behind one endpoint: every message of that process would
    count for the first, and the second could never ack (its load held for ever)."""
    hs = make_owner().handshake()
    hs["tp_size"] = 2
    hs["workers"][1] = dict(_card(hs))
    assert handshake_problem(hs) == "prefill workers tp0 and tp1 give one transfer address"
    hs["workers"][1].update(address=_address(4243, incarnation=8), pid=4243)
    assert handshake_problem(hs) == ""
