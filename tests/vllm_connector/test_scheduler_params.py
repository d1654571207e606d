"""A decode request's ``kv_transfer_params`` are a client's input. What does not name a
prefill kvferry can load from (values that do not parse, request ids longer than the wire
carries) is refused with the request id and why, and the prompt is computed at the
decode; nothing raises into vLLM's scheduler. What does not carry the prefill's ticket for
this very prompt (cluster/vllm/params.py) loads nothing: no client can name another
request's KV and read it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from vllm.v1.request import RequestStatus

from kvferry.cluster.vllm import connector, params, wire
from kvferry.cluster.vllm.connector import _SchedulerSide
from kvferry.cluster.vllm.params import TICKET, BadRemoteParams
from kvferry.cluster.vllm.settings import Settings
from kvferry.cluster.vllm.sidechannel import HandshakeKey

PROMPT = [(7 * i) % 900 + 1 for i in range(40)]
OTHER_PROMPT = PROMPT[:-1] + [PROMPT[-1] + 1]  # the same length, one token apart


def _side(role: str, engine: str, settings: Settings | None = None) -> _SchedulerSide:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine, kv_role=role),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
    )
    return _SchedulerSide(config, settings or Settings(side_channel_port=5600))


def _issued(rid: str = "cmpl-1", prompt: list[int] = PROMPT) -> dict:
    """The kv_transfer_params a prefill engine's scheduler returns for ``rid``."""
    prefill = _side("kv_producer", "prefill-0")
    request = SimpleNamespace(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        prompt_token_ids=list(prompt),
    )
    delay, out = prefill.request_finished(request, ([3, 4, 5, 6],))
    assert delay and out is not None and prefill.meta.send[rid]["blocks"] == [3, 4, 5]
    return out


GOOD = _issued()


def _request(rid: str, kv_params: dict, prompt: list[int] = PROMPT) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=dict(kv_params),
        prompt_token_ids=list(prompt),
        status=RequestStatus.FINISHED_ABORTED,
    )


def test_issued_params_load_from_the_prefill():
    side = _side("kv_consumer", "decode-0")
    request = _request("cmpl-9", GOOD)
    assert GOOD[TICKET] and GOOD["remote_block_ids"] == [3, 4, 5]
    assert side.get_num_new_matched_tokens(request, 8) == (32, True)
    assert side.get_num_new_matched_tokens(request, 8) == (32, True)  # asked again: cached
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[10, 11, 12]])
    side.update_state_after_alloc(request, blocks, 32)
    planned = side.meta.recv["cmpl-9"]
    assert planned["rid"] == "cmpl-1" and planned["src"] == [3, 4, 5] and planned["tokens"] == 40
    assert side.remotes == {}


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"remote_port": "abc"}, "do not parse"),
        ({"remote_block_ids": ["x"]}, "do not parse"),
        ({"tp_size": "two"}, "do not parse"),
        ({"remote_port": 70000}, "remote_port 70000"),
        ({"remote_request_id": "r" * 300}, "remote_request_id has 300 characters"),
        # past what msgpack packs: the engine's schedule stopped on an OverflowError
        ({"remote_block_ids": [2**64]}, "remote_block_ids holds 18446744073709551616"),
        ({"remote_block_ids": [-1]}, "remote_block_ids holds -1"),
        ({"tp_size": 2**64}, "remote_port 5600, tp_size 18446744073709551616"),
    ],
)
def test_params_that_name_no_prefill_are_refused_and_computed_here(bad, why, caplog):
    side = _side("kv_consumer", "decode-0")
    request = _request("cmpl-9", {**GOOD, **bad})
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert "request cmpl-9: no remote prefill" in caplog.text and why in caplog.text
    with pytest.raises(BadRemoteParams, match=why.split()[0]):
        params.parse({**GOOD, **bad}, "cmpl-9")


def test_a_decode_request_id_longer_than_the_wire_carries_is_refused():
    side = _side("kv_consumer", "decode-0")
    request = _request("d" * (wire.MAX_REQUEST_ID + 1), GOOD)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    with pytest.raises(BadRemoteParams, match="request id has 257 characters"):
        params.parse(GOOD, "d" * 257)


FORGED = {
    "another request's id": {"remote_request_id": "cmpl-2"},
    "other blocks": {"remote_block_ids": [3, 4, 7]},
    "another port": {"remote_port": 5601},
    "another host": {"remote_host": "10.9.9.9"},
    "another engine": {"remote_engine_id": "prefill-1"},
    "another TP size": {"tp_size": 4},
    "a ticket cut short": {TICKET: GOOD[TICKET][:-2]},
    "a ticket not hex": {TICKET: "é" * 64},
    "a ticket of another request": {TICKET: _issued("cmpl-2")[TICKET]},
    "no ticket": {TICKET: None},
}


@pytest.mark.parametrize("change", list(FORGED), ids=list(FORGED))
@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-unchecked"])
def test_params_a_prefill_did_not_issue_load_nothing(monkeypatch, caplog, change, broken):
    """A client changes what the prefill issued (to name another request's KV, say): the
    decode computes the prompt itself. The broken mode (parameters taken as they parse,
    as before tickets) plans the load from whatever the client named."""
    if broken:
        monkeypatch.setattr(connector, "checked", lambda key, p, rid, ids: params.parse(p, rid))
    side = _side("kv_consumer", "decode-0")
    forged = {k: v for k, v in {**GOOD, **FORGED[change]}.items() if v is not None}
    request = _request("cmpl-9", forged)
    got = side.get_num_new_matched_tokens(request, 0)
    if broken:
        assert got == (40, True)
        return
    assert got == (0, False) and request.kv_transfer_params["do_remote_prefill"] is False
    assert "request cmpl-9: no remote prefill" in caplog.text
    assert TICKET in caplog.text


@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-unchecked"])
def test_a_ticket_binds_the_prompt_it_was_issued_for(monkeypatch, caplog, broken):
    """The ticket of a prompt, given with another prompt of the same length, loads nothing
    (that prompt's KV would be another's)."""
    if broken:
        monkeypatch.setattr(connector, "checked", lambda key, p, rid, ids: params.parse(p, rid))
    side = _side("kv_consumer", "decode-0")
    request = _request("cmpl-9", GOOD, prompt=OTHER_PROMPT)
    got = side.get_num_new_matched_tokens(request, 0)
    assert got == ((40, True) if broken else (0, False))
    if not broken:
        assert "the prompt is not the one the prefill computed" in caplog.text


def test_a_ticket_of_engines_with_another_secret_loads_nothing(monkeypatch):
    other = Settings(side_channel_port=5600)
    monkeypatch.setattr(Settings, "key", HandshakeKey.generate())  # the decode's own secret
    side = _side("kv_consumer", "decode-0", other)
    assert side.get_num_new_matched_tokens(_request("cmpl-9", GOOD), 0) == (0, False)


@pytest.mark.parametrize("broken", [False, True], ids=["checked", "broken-unchecked"])
def test_a_rejected_request_tells_only_its_tickets_prefill_to_free(monkeypatch, broken):
    """A decode request finished before any block was allocated tells the prefill to free
    the request its ticket names, and no request a client named: else a client could make
    a prefill drop another request's KV."""
    if broken:
        monkeypatch.setattr(connector, "checked", lambda key, p, rid, ids: params.parse(p, rid))
    side = _side("kv_consumer", "decode-0")
    forged = {**GOOD, "remote_request_id": "cmpl-2"}
    assert side.request_finished(_request("cmpl-8", forged), ([],)) == (False, None)
    assert ("cmpl-8" in side.meta.refuse) is broken
    assert side.request_finished(_request("cmpl-9", GOOD), ([],)) == (False, None)
    assert side.meta.refuse["cmpl-9"]["rid"] == "cmpl-1"
    assert side.remotes == {}


def test_a_prompt_without_token_ids_is_not_sent_to_a_decode(caplog):
    prefill = _side("kv_producer", "prefill-0")
    request = SimpleNamespace(
        request_id="cmpl-e",
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        prompt_token_ids=None,
    )
    assert prefill.request_finished(request, ([3],)) == (False, None)
    assert "cmpl-e: not sent to a decode: the prompt has no token ids" in caplog.text
    assert not prefill.holding


@pytest.mark.parametrize(
    "groups, num_external, why",
    [
        ([[10, 11, 12], [20, 21, 22]], 32, "2 KV cache groups"),
        ([[11, 12]], 16, "for 16 external tokens where 32 were matched"),
    ],
    ids=["two-groups", "fewer-external-tokens"],
)
def test_a_load_kvferry_cannot_place_fails_without_stopping_the_engine(
    groups, num_external, why, caplog
):
    """Blocks vLLM allocated that the prompt's KV would not fit at its positions (more
    than one KV cache group; fewer external tokens than matched): the load is staged as
    refused, the worker fails it at once and the prefill is told to free, where before an
    exception stopped the engine inside its schedule."""
    side = _side("kv_consumer", "decode-0")
    request = _request("cmpl-9", GOOD)
    assert side.get_num_new_matched_tokens(request, 8) == (32, True)
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: groups)
    side.update_state_after_alloc(request, blocks, num_external)
    assert why in side.meta.recv["cmpl-9"]["refused"] and "remote prefill refused" in caplog.text
    assert side.meta.refuse["cmpl-9"]["rid"] == "cmpl-1"
    assert side.matched == {}
