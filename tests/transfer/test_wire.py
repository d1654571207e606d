"""The versioned msgpack codec: round trips, and decode refusing malformed, unknown,
wrong-version, mistyped or oversized input with WireError only (hypothesis fuzz)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.transfer import SegmentDescriptor, WireError
from kvferry.transfer.protocol import CODEC as TRANSFER_CODEC
from kvferry.transfer.wire import Codec, Field, FieldType, Message, _check_value, _fast_check

codec = Codec("kvf.test", version=3, max_bytes=4096)
NOTICE = codec.kind(
    "NOTICE",
    request_id=Field(FieldType.STR, max_len=64),
    seq=Field(FieldType.UINT64),
    pages=Field(FieldType.INT_LIST, max_len=32),
    ok=Field(FieldType.BOOL),
    score=Field(FieldType.FLOAT, optional=True),
    blob=Field(FieldType.BYTES, max_len=256),
    delta=Field(FieldType.INT),
    tags=Field(FieldType.STR_LIST, max_len=4),
)

notices = st.builds(
    lambda **kw: NOTICE.make(**kw),
    request_id=st.text(max_size=64),
    seq=st.integers(0, 2**64 - 1),
    pages=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=32),
    ok=st.booleans(),
    score=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    blob=st.binary(max_size=256),
    delta=st.integers(-(2**63), 2**63 - 1),
    tags=st.lists(st.text(max_size=20), max_size=4),
)


def _only_wire_errors(data: bytes, c: Codec = codec) -> None:
    try:
        msg = c.decode(data)
    except WireError:
        return
    assert isinstance(msg, Message) and msg.kind in c.kinds


@given(notices)
def test_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes_never_crash(data):
    _only_wire_errors(data)
    _only_wire_errors(data, TRANSFER_CODEC)


@settings(max_examples=300)
@given(notices, st.data())
def test_mutated_messages_never_crash(msg, data):
    raw = bytearray(codec.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _only_wire_errors(bytes(raw[:cut]))
    _only_wire_errors(bytes(raw))


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300)
@given(json_like)
def test_arbitrary_msgpack_values_never_crash(obj):
    _only_wire_errors(msgpack.packb(obj, use_bin_type=True))
    _only_wire_errors(msgpack.packb(["kvf.test", 3, "NOTICE", obj], use_bin_type=True))


def _valid() -> dict:
    return dict(
        request_id="r", seq=1, pages=[1, 2], ok=True, score=None, blob=b"", delta=-1, tags=[]
    )


@pytest.mark.parametrize(
    "envelope,why",
    [
        (["kvf.other", 3, "NOTICE", _valid()], "protocol"),
        (["kvf.test", 2, "NOTICE", _valid()], "version"),
        (["kvf.test", 3, "ABORT", _valid()], "unknown kind"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "extra": 1}], "unknown field"),
        (["kvf.test", 3, "NOTICE", {k: v for k, v in _valid().items() if k != "seq"}], "missing"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "seq": -1}], "uint64"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "seq": True}], "uint64"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "ok": 1}], "bool"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "request_id": b"r"}], "str"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "request_id": "x" * 65}], "limit"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "pages": list(range(33))}], "limit"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "pages": [1, "2"]}], "int64"),
        (["kvf.test", 3, "NOTICE", {**_valid(), "blob": b"x" * 257}], "limit"),
        (["kvf.test", 3, "NOTICE"], "4-item"),
        ({"kind": "NOTICE"}, "4-item"),
    ],
)
def test_refusals_name_the_problem(envelope, why):
    with pytest.raises(WireError, match=why):
        codec.decode(msgpack.packb(envelope, use_bin_type=True))


def test_oversized_input_refused_before_parsing():
    with pytest.raises(WireError, match="exceed the limit"):
        codec.decode(b"\x90" * 5000)


def test_encode_validates():
    with pytest.raises(WireError):
        codec.encode(Message("NOTICE", {**_valid(), "seq": "1"}))
    with pytest.raises(WireError, match="unknown kind"):
        codec.encode(Message("NOPE", {}))
    with pytest.raises(ValueError):
        codec.kind("NOTICE")


@given(
    st.integers(0, 2**64 - 1),
    st.integers(1, 2**40),
    st.binary(max_size=200),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
def test_segment_descriptor_round_trip(base, length, rkey, inc, allocated):
    """A descriptor within the native layer's int64 offsets comes back as it went; one
    past them is malformed."""
    d = SegmentDescriptor(base, length, rkey, inc, allocated)
    if base + length > 2**63 - 1:
        with pytest.raises(WireError, match="passes 2"):
            SegmentDescriptor.unpack(d.pack())
        return
    assert SegmentDescriptor.unpack(d.pack()) == d


@given(st.lists(st.integers(-(2**64), 2**64) | st.booleans(), max_size=40))
def test_int_list_fast_check_agrees_with_full_check(values):
    """The fast path for int lists accepts exactly what the full check accepts (bool
    items, values past int64 and lists over max_len refused by both)."""
    spec = NOTICE.fields["pages"]
    try:
        _check_value("NOTICE", "pages", spec, values)
        accepted = True
    except WireError:
        accepted = False
    assert _fast_check(spec)(values) is accepted


def test_decoded_lists_are_the_decoders_own_and_made_ones_are_copied():
    pages = [1, 2, 3]
    msg = NOTICE.make(**{**_valid(), "pages": pages})
    pages.append(4)
    assert msg.pages == [1, 2, 3]
    assert codec.decode(codec.encode(msg)).pages == [1, 2, 3]


def test_a_protocol_word_outside_its_enum_is_refused_and_a_good_one_decodes_to_the_member():
    """``Field(choices=Enum)``: the codec refuses a value its enum does not name (bad
    input never reaches the protocol logic) and decodes a good one to the member. Broken
    mode: the same field without ``choices`` lets the bad word through."""
    import enum

    class Word(enum.StrEnum):
        FREED = "freed"
        ACKED = "acked"

    checked = Codec("t", 1)
    loose = Codec("t", 1)
    kc = checked.kind("K", how=Field(FieldType.STR, max_len=16, choices=Word))
    kl = loose.kind("K", how=Field(FieldType.STR, max_len=16))
    good = checked.decode(checked.encode(kc.make(how="acked")))
    assert good.how is Word.ACKED
    bad = loose.encode(kl.make(how="gone"))  # the same bytes a peer could send
    with pytest.raises(WireError, match="not one of freed, acked"):
        checked.decode(bad)
    assert loose.decode(bad).how == "gone"  # the test catches a field left unchecked


# ---------------------------------------------------------------- int64 arrays
import numpy as np  # noqa: E402

arrays = Codec("kvf.test.arrays", version=1, max_bytes=4096)
PLAN = arrays.kind(
    "PLAN",
    pages=Field(FieldType.INT64_ARRAY, max_len=32),
    sums=Field(FieldType.INT64_ARRAY, max_len=4),
)
int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=32)


@given(int64s, st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4), st.booleans())
def test_int64_arrays_round_trip_from_lists_and_arrays(pages, sums, as_array):
    made = PLAN.make(
        pages=np.array(pages, dtype=np.int64) if as_array else pages,
        sums=tuple(sums),
    )
    back = arrays.decode(arrays.encode(made))
    assert back == made
    assert back.pages.dtype == np.int64 and back.pages.tolist() == pages
    assert back.sums.tolist() == sums


def test_an_int64_array_made_or_decoded_is_the_messages_own():
    source = np.array([1, 2, 3], dtype=np.int64)
    made = PLAN.make(pages=source, sums=[])
    source[0] = 99
    assert made.pages.tolist() == [1, 2, 3]
    back = arrays.decode(arrays.encode(made))
    back.pages[0] = 7  # writable, and nobody else's
    assert made.pages.tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "value, why",
    [
        ([True, 1], "int64"),
        ([2**63], "int64"),
        ([1.5], "int64"),
        (["1"], "int64"),
        (list(range(33)), "33 items exceed the limit 32"),
        (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
        (np.zeros(3, dtype=np.float64), "1-D integer array"),
        (np.array([2**64 - 1], dtype=np.uint64), "int64"),
        (np.zeros(33, dtype=np.int64), "33 items exceed the limit 32"),
        ("123", "expected an int64 array"),
    ],
)
def test_an_int64_array_field_refuses_what_is_not_int64s(value, why):
    with pytest.raises(WireError, match=why):
        PLAN.make(pages=value, sums=[])


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\x00" * 7, "not a whole number of int64 items"),
        (b"\x00" * 8 * 33, "33 items exceed the limit 32"),
        ([1, 2], "int64 array"),  # a list on the wire is not this field's form
        ("x" * 8, "int64 array"),
    ],
)
def test_decoding_an_int64_array_refuses_bad_bytes(raw, why):
    data = msgpack.packb(["kvf.test.arrays", 1, "PLAN", {"pages": raw, "sums": b""}])
    with pytest.raises(WireError, match=why):
        arrays.decode(data)


@settings(max_examples=300)
@given(int64s, st.data())
def test_mutated_array_messages_never_crash(pages, data):
    raw = bytearray(arrays.encode(PLAN.make(pages=pages, sums=[1])))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _only_wire_errors(bytes(raw[:cut]), arrays)
    _only_wire_errors(bytes(raw), arrays)
