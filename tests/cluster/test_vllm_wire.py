"""The vLLM connector's messages (kvferry.cluster.vllm.wire) on the project's one codec:
kinds are the core's words, abort sources its enum, every field checked on receipt; bad
input raises MalformedMessage and nothing else. No vLLM needed."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster import messages as rank_messages
from kvferry.cluster.vllm import wire
from kvferry.engine.protocol.words import AbortSource, Kind

REGIONS = {"layout": "NHD", "num_blocks": 8, "buffers": [{"nbytes": 64, "groups": [[8, [0, 8]]]}]}
CASES = {
    Kind.PLAN: dict(
        rid="d-1",
        orid="p-1",
        blocks=[3, 4],
        gens=[1, 1],
        tokens=20,
        regions=REGIONS,
        descs=[b"\x01\x02", b"\x03"],
        tp_rank=0,
        tp_size=2,
        kv_heads=4,
        heads=[0, 1],
    ),
    Kind.NOTICE_PART: dict(rid="d-1", orid="p-1", offset=2, blocks=[5], gens=[1], checksums=[9]),
    Kind.NOTICE: dict(
        rid="d-1", orid="p-1", tokens=20, blocks=[3, 4], gens=[1, 1], checksums=[7, 8], bytes=128
    ),
    Kind.ABORT: dict(
        rid="d-1", orid="p-1", source="client", reason="gone", tp_rank=1, tp_size=2, kv_heads=4
    ),
    Kind.ABORT_ACK: dict(rid="d-1", orid="p-1"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_kind_round_trips_with_the_cores_words(kind):
    m = wire.decode(wire.encode(kind, **dict(CASES[kind])))
    assert m["k"] is kind and {k: v for k, v in m.items() if k != "k"} == CASES[kind]
    if kind is Kind.ABORT:
        assert m["source"] is AbortSource.CLIENT


@pytest.mark.parametrize(
    "payload",
    [
        b"junk",
        msgpack.packb(["kvf.vllm", 1, "PLAN", {}]),  # the old version
        msgpack.packb(["kvf.vllm", 2, "PLAN", {}]),  # the version before heads
        msgpack.packb(["kvf.vllm", 3, "NOTICE_PART", {}]),  # the version before parts
        msgpack.packb(["kvf.vllm", 4, "NOTICE", {}]),  # the version of 32-bit checksum words
        msgpack.packb(
            ["kvf.vllm", 5, "ABORT_ACK", {"rid": "a", "orid": "b"}]
        ),  # before seq numbers
        msgpack.packb(["kvf.vllm", 6, "SHUTDOWN", {}]),  # no such kind here
        msgpack.packb(["kvf.vllm", 6, "ABORT", {"rid": "a", "orid": "b", "reason": "x"}]),
        msgpack.packb(
            [
                "kvf.vllm",
                6,
                "ABORT",
                {
                    "rid": "a",
                    "orid": "b",
                    "source": "nobody",
                    "reason": "",
                    "tp_rank": 0,
                    "tp_size": 1,
                    "kv_heads": 1,
                },
            ]
        ),
    ],
    ids=[
        "garbage",
        "old-version",
        "version-2",
        "version-3",
        "version-4",
        "version-5",
        "unknown-kind",
        "missing-field",
        "unknown-source",
    ],
)
def test_bad_input_is_refused(payload):
    with pytest.raises(wire.MalformedMessage):
        wire.decode(payload)


def test_a_rank_message_is_not_a_connector_message():
    data = rank_messages.CODEC.encode(rank_messages.ABORT_ACK.make(src=1, inc=2, seq=3, rid="r"))
    with pytest.raises(wire.MalformedMessage, match="protocol"):
        wire.decode(data)


def test_a_plan_whose_descriptors_are_not_bytes_is_refused():
    fields = dict(CASES[Kind.PLAN])
    data = wire.CODEC.encode(
        wire.CODEC.kinds[Kind.PLAN].make(
            **{**fields, "regions": msgpack.packb(REGIONS), "descs": msgpack.packb([1, 2])}
        )
    )
    with pytest.raises(wire.MalformedMessage, match="descs"):
        wire.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_malformed(data):
    try:
        wire.decode(data)
    except wire.MalformedMessage:
        pass


def test_a_million_token_loads_messages_fit_the_connectors_engine():
    """A NOTICE and a PLAN of a 1,048,576-token prompt at block size 16 (65,536 blocks,
    each with a 64-bit checksum and a generation) fit the connector's engine
    (wire.MESSAGE_BYTES, within the transport's largest message); at the engine's
    default of 256 KiB the NOTICE would not (the load would fail after every byte had
    moved: "the notice could not be sent")."""
    from kvferry.transfer import TransferConfig
    from kvferry.transfer.protocol import MAX_PAYLOAD

    blocks = list(range(1 << 16))
    rng = random.Random(0)
    notice = wire.encode(
        wire.NOTICE,
        rid="cmpl-" + "x" * 40,
        orid="cmpl-" + "y" * 40,
        tokens=1 << 20,
        blocks=blocks,
        gens=[rng.randrange(1 << 20) for _ in blocks],
        checksums=[rng.randrange(-(1 << 63), 1 << 63) for _ in blocks],
        bytes=1 << 36,
    )
    plan = wire.encode(
        wire.PLAN,
        rid="cmpl-" + "x" * 40,
        orid="cmpl-" + "y" * 40,
        blocks=blocks,
        gens=[rng.randrange(1 << 20) for _ in blocks],
        tokens=1 << 20,
        regions={"layers": [{"name": f"model.layers.{i}.attn"} for i in range(80)]},
        descs=[b"d" * 200] * 4,
        tp_rank=0,
        tp_size=8,
        kv_heads=8,
        heads=[0],
    )
    assert wire.MESSAGE_BYTES == MAX_PAYLOAD
    assert len(notice) <= wire.MESSAGE_BYTES and len(plan) <= wire.MESSAGE_BYTES
    assert len(notice) > TransferConfig().max_message_bytes  # the default would refuse it
