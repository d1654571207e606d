"""A decode request's ``kv_transfer_params`` are a client's input: what does not name a
prefill kvferry can load from (values that do not parse, request ids longer than the wire
carries) is refused with the request id and why, and the prompt is computed at the
decode; nothing raises into vLLM's scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from kvferry.cluster.vllm import wire
from kvferry.cluster.vllm.connector import BadRemoteParams, _remote, _SchedulerSide
from kvferry.cluster.vllm.settings import Settings

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [3, 4, 5],
    "tp_size": 2,
}


def _decode_side() -> _SchedulerSide:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="decode-0", kv_role="kv_consumer"),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return _SchedulerSide(config, Settings())


def _request(rid: str, params: dict) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=dict(params), prompt_token_ids=[1] * 40
    )


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"remote_port": "abc"}, "do not parse"),
        ({"remote_block_ids": ["x"]}, "do not parse"),
        ({"tp_size": "two"}, "do not parse"),
        ({"remote_port": 70000}, "remote_port 70000"),
        ({"remote_request_id": "r" * 300}, "remote_request_id has 300 characters"),
    ],
)
def test_params_that_name_no_prefill_are_refused_and_computed_here(bad, why, caplog):
    side = _decode_side()
    request = _request("cmpl-9", {**GOOD, **bad})
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert "request cmpl-9: no remote prefill" in caplog.text and why in caplog.text
    with pytest.raises(BadRemoteParams, match=why.split()[0]):
        _remote({**GOOD, **bad}, "cmpl-9")


def test_a_decode_request_id_longer_than_the_wire_carries_is_refused():
    side = _decode_side()
    request = _request("d" * (wire.MAX_REQUEST_ID + 1), GOOD)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    with pytest.raises(BadRemoteParams, match="request id has 257 characters"):
        _remote(GOOD, "d" * 257)


def test_good_params_load_from_the_prefill():
    side = _decode_side()
    assert side.get_num_new_matched_tokens(_request("cmpl-9", GOOD), 8) == (32, True)
    assert _remote(GOOD, "cmpl-9")["src"] == [3, 4, 5]
