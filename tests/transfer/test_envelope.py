"""The binary message envelope: the native parser (the receive hot path) agrees with the
reference codec in kvferry.transfer.envelope on every input (hypothesis), the native
encoder produces the reference bytes, and a message whose envelope is malformed is counted
and never delivered (checked against an injected corrupting sender)."""

from __future__ import annotations

import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.transfer import TransferConfig, TransferEngine, WireError
from kvferry.transfer import engine as engine_module
from kvferry.transfer._native import ENVELOPE_FLAG_FLUSHED, MSG_FLAG_NOTICE, ffi, lib
from kvferry.transfer.envelope import HEADER_BYTES, Envelope, EnvelopeError, check, decode, encode
from kvferry.transfer.protocol import ADDRESS, CODEC, MAX_UCX_ADDRESS

MAX_SENDER, MAX_PAYLOAD = 512, 4096

envelopes = st.builds(
    Envelope,
    incarnation=st.integers(0, 2**64 - 1),
    seq=st.integers(0, 2**64 - 1),
    flushed=st.booleans(),
    sender=st.binary(min_size=1, max_size=MAX_SENDER),
    payload=st.binary(max_size=MAX_PAYLOAD),
)


def native_parse(data: bytes) -> tuple[int, object]:
    out = ffi.new("kvf_envelope_t *")
    buf = ffi.from_buffer(data)
    err = lib.kvf_envelope_parse(buf, len(data), MAX_SENDER, MAX_PAYLOAD, out)
    assert err == out.error
    if err:
        return err, None
    return err, Envelope(
        out.incarnation,
        out.seq,
        bool(out.flags & ENVELOPE_FLAG_FLUSHED),
        ffi.unpack(out.sender, out.sender_length),
        ffi.unpack(out.payload, out.payload_length),
    )


def native_encode(env: Envelope) -> bytes:
    cap = HEADER_BYTES + len(env.sender) + len(env.payload)
    out = ffi.new("char[]", cap)
    sender, payload = ffi.from_buffer(env.sender), ffi.from_buffer(env.payload)
    msg = ffi.new(
        "kvf_msg_param_t *",
        {
            "flags": MSG_FLAG_NOTICE if env.flushed else 0,
            "incarnation": env.incarnation,
            "seq": env.seq,
            "sender": sender,
            "sender_length": len(env.sender),
            "payload": payload,
            "payload_length": len(env.payload),
        },
    )
    n = lib.kvf_envelope_encode(msg, out, cap)
    return ffi.unpack(out, n)


def test_refusal_reasons_match_the_native_enum():
    """envelope.py's reference codec numbers its refusals as kvf_envelope_error_t."""
    for reason in EnvelopeError:
        name = "VERSION_MISMATCH" if reason.name == "VERSION" else reason.name
        assert getattr(lib, f"KVF_ENVELOPE_{name}") == reason.value, reason


@given(envelopes)
def test_round_trip_native_and_reference(env):
    data = encode(env)
    assert native_encode(env) == data
    assert decode(data, MAX_SENDER, MAX_PAYLOAD) == env
    assert native_parse(data) == (0, env)


@given(st.binary(max_size=HEADER_BYTES + 64))
def test_random_bytes_same_verdict(data):
    err, env = native_parse(data)
    assert EnvelopeError(err) is check(data, MAX_SENDER, MAX_PAYLOAD)
    if err:
        with pytest.raises(WireError):
            decode(data, MAX_SENDER, MAX_PAYLOAD)
    else:
        assert decode(data, MAX_SENDER, MAX_PAYLOAD) == env


@given(envelopes, st.data())
def test_mutated_envelopes_same_verdict(env, data):
    raw = bytearray(encode(env))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    mutated = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    err, parsed = native_parse(mutated)
    assert EnvelopeError(err) is check(mutated, MAX_SENDER, MAX_PAYLOAD)
    if not err:
        assert parsed == decode(mutated, MAX_SENDER, MAX_PAYLOAD)


@pytest.mark.parametrize(
    "why,data",
    [
        (EnvelopeError.SHORT, b"KVFE"),
        (EnvelopeError.MAGIC, b"KVFX" + bytes(28) + b"s"),
        (EnvelopeError.VERSION, b"KVFE\x01" + bytes(27) + b"s"),
        (EnvelopeError.FLAGS, b"KVFE\x02\x02" + bytes(26) + b"s"),
        (EnvelopeError.SENDER_SIZE, struct.pack("<4sBBHQQII", b"KVFE", 2, 0, 0, 1, 1, 0, 0)),
        (
            EnvelopeError.PAYLOAD_SIZE,
            struct.pack("<4sBBHQQII", b"KVFE", 2, 0, 0, 1, 1, 1, MAX_PAYLOAD + 1) + b"s",
        ),
        (EnvelopeError.LENGTH, struct.pack("<4sBBHQQII", b"KVFE", 2, 0, 0, 1, 1, 1, 2) + b"sp"),
    ],
)
def test_each_refusal_is_named(why, data):
    assert native_parse(data)[0] == why
    with pytest.raises(WireError, match="refused"):
        decode(data, MAX_SENDER, MAX_PAYLOAD)


@pytest.mark.parametrize("corrupt", [False, True])
def test_malformed_envelope_never_delivered(corrupt):
    """Sends real notices between two engines; with the injected corruption (a flipped
    magic byte) the receiver must count every one as malformed and deliver none."""
    with (
        TransferEngine(TransferConfig(transports="shm", name="a")) as a,
        TransferEngine(TransferConfig(transports="shm", name="b")) as b,
    ):
        got: list = []
        b.set_message_handler(lambda sender, payload: got.append((sender, payload)))
        peer = a.connect(b.address)
        batches = []
        for i in range(5):
            payload = b"notice %d" % i
            if corrupt:
                raw = bytearray(encode(Envelope(a.incarnation, i, True, a.address, payload)))
                raw[0] ^= 0xFF
                batches.append(a._send_raw(peer, bytes(raw), flushed=True))
            else:
                batches.append(a.notify(peer, payload))
        want = 0 if corrupt else 5
        deadline = time.monotonic() + 10.0  # both engines live in this thread: drive both
        while (
            len(got) + b.counters.malformed_messages < 5 or not all(bt.done() for bt in batches)
        ) and time.monotonic() < deadline:
            a.progress(0)
            b.progress(0.001)
        assert len(got) == want
        assert b.counters.malformed_messages == 5 - want
        assert all(sender == a.address for sender, _ in got)
        assert sorted(p for _, p in got) == [b"notice %d" % i for i in range(want)]


def _claim(engine: TransferEngine, address: bytes) -> None:
    """``engine``'s next messages name ``address`` as their sender (what a stranger's own
    build of the envelope can do: nothing in it is authenticated)."""
    engine._sender = ffi.from_buffer(address)
    engine._msg_param.sender = engine._sender
    engine._msg_param.sender_length = len(address)


def _made_up_address(i: int, incarnation: int) -> bytes:
    return CODEC.encode(
        ADDRESS.make(
            ucx=i.to_bytes(8, "little") + bytes(MAX_UCX_ADDRESS - 8),
            incarnation=incarnation,
            name="stranger",
            host="h",
            boot_id="b",
            pidns=1,
            pid=1,
        )
    )


@pytest.mark.parametrize("bounded", [True, False], ids=["in-bytes", "broken-entries-only"])
def test_made_up_sender_addresses_pin_a_bounded_amount(monkeypatch, bounded):
    """A peer sends one tiny message per made-up 64 KiB sender address: what the receiver
    keeps of them (decoded before any MAC can be checked) stays within
    SENDER_CACHE_BYTES. Broken mode: bounded by entries alone (4,096 of them would pin
    half a GiB)."""
    n, limit = 200, 8 << 20
    monkeypatch.setattr(engine_module, "SENDER_CACHE_BYTES", limit if bounded else 1 << 40)
    with (
        TransferEngine(TransferConfig(transports="shm", name="stranger")) as a,
        TransferEngine(TransferConfig(transports="shm", name="rank")) as b,
    ):
        got: list[int] = []
        b.set_message_handler(lambda sender, payload: got.append(len(payload)))
        peer = a.connect(b.address)
        for i in range(n):
            _claim(a, _made_up_address(i, a.incarnation))
            a.send(peer, b"x" * 17)
            deadline = time.monotonic() + 30
            while len(got) <= i:
                assert time.monotonic() < deadline, "not delivered"
                a.progress(0)
                b.progress(0)
        held = sum(len(k) + len(v.ucx) for k, v in b._senders.items())
        assert (held <= limit) is bounded, held
