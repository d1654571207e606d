"""A small versioned msgpack codec with explicit schemas for control messages.

A :class:`Codec` has a protocol name, a version and a size limit; message kinds are
declared on it with typed, bounded fields. On the wire a message is the msgpack array
``[protocol, version, kind, {field: value}]``. :meth:`Codec.decode` rejects anything
malformed, of another protocol or version, of unknown kind, with missing, extra,
mistyped or oversized fields, or bigger than the codec's limit, by raising
:class:`WireError`; it never raises anything else, so a receiving worker keeps running.

Example::

    codec = Codec("kvf.cluster", version=1, max_bytes=64 << 10)
    ABORT = codec.kind("ABORT", request_id=Field(FieldType.STR, max_len=128),
                       seq=Field(FieldType.UINT64))
    data = codec.encode(ABORT.make(request_id="r1", seq=3))
    msg = codec.decode(data)          # Message(kind="ABORT", fields={...})
    msg.request_id, msg["seq"]

Long lists of integers (a plan's pages, a notice's checksums) are ``INT64_ARRAY`` fields:
little-endian int64 bytes on the wire, a numpy array of the message's own once decoded.
They decode without a Python object per item, so a 65,536-page notice costs about a
millisecond, not the tens of milliseconds an ``INT_LIST`` of the same length takes to
check and unpack.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .errors import WireError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1


EnumClass = type[enum.Enum]  # a name for it inside Field, whose own `type` shadows type


class FieldType(enum.Enum):
    INT = "int"  # signed 64-bit
    UINT64 = "uint64"  # unsigned 64-bit (incarnations, sequence numbers)
    BOOL = "bool"
    FLOAT = "float"  # finite float
    STR = "str"  # max_len in characters
    BYTES = "bytes"  # max_len in bytes
    INT_LIST = "int_list"  # list of signed 64-bit ints, max_len items
    STR_LIST = "str_list"  # list of str (each at most 1024 chars), max_len items
    INT64_ARRAY = "int64_array"  # numpy int64, max_len items; little-endian bytes on the wire


_DEFAULT_MAX_LEN = {
    FieldType.STR: 1024,
    FieldType.BYTES: 64 << 10,
    FieldType.INT_LIST: 1 << 16,
    FieldType.STR_LIST: 1024,
    FieldType.INT64_ARRAY: 1 << 16,
}

_INT64 = np.dtype("<i8")


@dataclass(frozen=True)
class Field:
    """One typed field. ``max_len`` bounds str/bytes/list sizes; ``optional`` fields may be
    absent or None (decoded as None). ``choices``, for a STR field, is the enum of a
    protocol word: a value must be one of its members' values and decodes to the member
    (a ``str`` enum compares equal to its value)."""

    type: FieldType
    max_len: int | None = None
    optional: bool = False
    choices: EnumClass | None = None

    def limit(self) -> int:
        return self.max_len if self.max_len is not None else _DEFAULT_MAX_LEN.get(self.type, 0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_value(kind: str, name: str, spec: Field, value: Any) -> None:
    """Raise WireError unless value fits spec exactly."""
    t = spec.type

    def bad(why: str) -> WireError:
        return WireError(f"{kind}.{name}: {why}")

    if t is FieldType.INT:
        if not _is_int(value) or not INT64_MIN <= value <= INT64_MAX:
            raise bad(f"expected int64, got {type(value).__name__}")
    elif t is FieldType.UINT64:
        if not _is_int(value) or not 0 <= value <= UINT64_MAX:
            raise bad(f"expected uint64, got {type(value).__name__} {value!r:.40}")
    elif t is FieldType.BOOL:
        if not isinstance(value, bool):
            raise bad(f"expected bool, got {type(value).__name__}")
    elif t is FieldType.FLOAT:
        if not isinstance(value, float) or not math.isfinite(value):
            raise bad(f"expected finite float, got {type(value).__name__}")
    elif t is FieldType.STR:
        if not isinstance(value, str):
            raise bad(f"expected str, got {type(value).__name__}")
        if len(value) > spec.limit():
            raise bad(f"{len(value)} characters exceed the limit {spec.limit()}")
    elif t is FieldType.BYTES:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise bad(f"expected bytes, got {type(value).__name__}")
        if len(value) > spec.limit():
            raise bad(f"{len(value)} bytes exceed the limit {spec.limit()}")
    elif t is FieldType.INT_LIST:
        if not isinstance(value, (list, tuple)):
            raise bad(f"expected a list of int, got {type(value).__name__}")
        if len(value) > spec.limit():
            raise bad(f"{len(value)} items exceed the limit {spec.limit()}")
        # exact type int excludes bool; the type set and min/max run in C, not per item
        if value and not (
            set(map(type, value)) == {int} and INT64_MIN <= min(value) and max(value) <= INT64_MAX
        ):
            raise bad("expected every item to be an int64")
    elif t is FieldType.INT64_ARRAY:
        _int64_array(kind, name, spec, value)
    elif t is FieldType.STR_LIST:
        if not isinstance(value, (list, tuple)):
            raise bad(f"expected a list of str, got {type(value).__name__}")
        if len(value) > spec.limit():
            raise bad(f"{len(value)} items exceed the limit {spec.limit()}")
        if not all(isinstance(v, str) and len(v) <= 1024 for v in value):
            raise bad("expected every item to be a str of at most 1024 characters")
    else:  # pragma: no cover - the enum is closed
        raise bad(f"unsupported field type {t}")


def _int64_array(kind: str, name: str, spec: Field, value: Any, wire: bool = False) -> np.ndarray:
    """``value`` as a 1-D int64 array of its own: from the wire's bytes (a multiple of 8,
    at most ``max_len`` items; the only form ``wire`` accepts), a list or tuple of ints
    (not bools), or an integer array whose values fit int64. Raises WireError otherwise."""
    lim = spec.limit()

    def bad(why: str) -> WireError:
        return WireError(f"{kind}.{name}: {why}")

    if wire and not isinstance(value, bytes):
        raise bad(f"expected an int64 array's bytes, got {type(value).__name__}")

    if isinstance(value, (bytes, bytearray, memoryview)):
        n = len(value)
        if n % _INT64.itemsize:
            raise bad(f"{n} bytes are not a whole number of int64 items")
        if n // _INT64.itemsize > lim:
            raise bad(f"{n // _INT64.itemsize} items exceed the limit {lim}")
        return np.frombuffer(value, dtype=_INT64).copy()
    if isinstance(value, (list, tuple)):
        if len(value) > lim:
            raise bad(f"{len(value)} items exceed the limit {lim}")
        types = set(map(type, value))  # in C, not per item
        if not all(issubclass(t, (int, np.integer)) and not issubclass(t, bool) for t in types):
            raise bad("expected every item to be an int64")
        try:
            array = np.array(value, dtype=_INT64)
        except OverflowError:
            raise bad("expected every item to be an int64") from None
    elif isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise bad(f"expected a 1-D integer array, got {value.dtype} of {value.ndim} dims")
        if len(value) > lim:
            raise bad(f"{len(value)} items exceed the limit {lim}")
        if value.dtype.kind == "u" and value.size and int(value.max()) > INT64_MAX:
            raise bad("expected every item to be an int64")
        array = value.astype(_INT64, copy=True)
    else:
        raise bad(f"expected an int64 array, got {type(value).__name__}")
    return array


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def _packed(value: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: an INT64_ARRAY's bytes."""
    if isinstance(value, np.ndarray):
        return value.astype(_INT64, copy=False).tobytes()
    raise TypeError(f"cannot pack {type(value).__name__}")


@dataclass(frozen=True, eq=False)
class Message:
    """A decoded (or to-be-encoded) message: its kind and its field values. ``checked`` is
    set by :meth:`MessageKind.make` and by decoding, so encoding does not check twice.
    Two messages are equal when their kinds and fields are (arrays item by item)."""

    kind: str
    fields: Mapping[str, Any]
    checked: bool = field(default=False, compare=False, repr=False)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        if self.kind != other.kind or self.fields.keys() != other.fields.keys():
            return False
        return all(_equal(v, other.fields[k]) for k, v in self.fields.items())

    __hash__ = None  # type: ignore[assignment]  # fields are mutable

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


_INT_ONLY = {int}


def _fast_check(spec: Field) -> Callable[[Any], bool]:
    """A predicate that accepts the common exact-type values of ``spec`` cheaply. What it
    does not accept goes through :func:`_check_value`, which accepts the rest (int
    subclasses, bytearrays, tuples) or raises with the reason."""
    t, lim = spec.type, spec.limit()
    if t is FieldType.INT:
        return lambda v: type(v) is int and INT64_MIN <= v <= INT64_MAX
    if t is FieldType.UINT64:
        return lambda v: type(v) is int and 0 <= v <= UINT64_MAX
    if t is FieldType.BOOL:
        return lambda v: v is True or v is False
    if t is FieldType.FLOAT:
        return lambda v: type(v) is float and math.isfinite(v)
    if t is FieldType.STR:
        return lambda v: type(v) is str and len(v) <= lim
    if t is FieldType.BYTES:
        return lambda v: type(v) is bytes and len(v) <= lim
    if t is FieldType.INT_LIST:
        # the type set, min and max run in C, not per item; exact type int excludes bool
        return lambda v: (
            type(v) is list
            and len(v) <= lim
            and (
                not v
                or (set(map(type, v)) == _INT_ONLY and INT64_MIN <= min(v) and max(v) <= INT64_MAX)
            )
        )
    if t is FieldType.INT64_ARRAY:
        # an int64 array is copied (the message keeps its own); the rest converts
        return lambda v: (
            type(v) is np.ndarray and v.dtype == _INT64 and v.ndim == 1 and len(v) <= lim
        )
    return lambda v: False  # str lists: always the full check


def _choose(kind: str, name: str, spec: Field, value: Any) -> enum.Enum:
    """The member of ``spec.choices`` that ``value`` names; raises WireError otherwise."""
    assert spec.choices is not None
    if isinstance(value, spec.choices):
        return value
    _check_value(kind, name, spec, value)
    try:
        return spec.choices(value)
    except ValueError:
        known = ", ".join(str(c.value) for c in spec.choices)
        raise WireError(f"{kind}.{name}: {str(value)[:40]!r} is not one of {known}") from None


_CONVERT: dict[FieldType, Callable[[Any], Any]] = {
    FieldType.BYTES: bytes,
    FieldType.INT_LIST: list,
    FieldType.STR_LIST: list,
    FieldType.INT64_ARRAY: np.copy,
}


# (field name, fast predicate, spec, conversion) for each field of a kind
_PlanStep = tuple[str, Callable[[Any], bool], Field, Callable[[Any], Any] | None]


@dataclass(frozen=True)
class MessageKind:
    """A declared message kind of one codec. Its fields' checks are compiled once into a
    plan (name, fast predicate, spec, conversion), since every message sent and received
    runs them."""

    name: str
    fields: Mapping[str, Field]
    _plan: tuple[_PlanStep, ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plan = tuple((n, _fast_check(f), f, _CONVERT.get(f.type)) for n, f in self.fields.items())
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_names", frozenset(self.fields))

    def validate(self, values: Mapping[str, Any], owned: bool = False) -> dict[str, Any]:
        """The checked fields; raises WireError. Lists are copied, so that the message
        keeps its own, unless ``owned`` (the decoder's fresh values); tuples and
        bytearrays become lists and bytes."""
        if not values.keys() <= self._names:
            extra = set(values) - set(self.fields)
            raise WireError(f"{self.name}: unknown field(s) {sorted(map(str, extra))[:5]}")
        out: dict[str, Any] = {}
        for name, fast, spec, convert in self._plan:
            value = values.get(name)
            if value is None:
                if not spec.optional:
                    raise WireError(f"{self.name}.{name}: required field missing")
                out[name] = None
                continue
            if spec.choices is not None:
                out[name] = _choose(self.name, name, spec, value)
                continue
            if fast(value):
                out[name] = value if convert is None or owned else convert(value)
                continue
            if spec.type is FieldType.INT64_ARRAY:  # owned: the decoder's, bytes only
                out[name] = _int64_array(self.name, name, spec, value, wire=owned)
                continue
            _check_value(self.name, name, spec, value)
            out[name] = value if convert is None else convert(value)
        return out

    def make(self, /, **values: Any) -> Message:
        return Message(self.name, self.validate(values), checked=True)


@dataclass
class Codec:
    """A protocol: a name, a version, a size limit and its declared kinds."""

    protocol: str
    version: int
    max_bytes: int = 1 << 20
    max_items: int = 1 << 16  # the longest list a decoded message may hold
    kinds: dict[str, MessageKind] = field(default_factory=dict)

    def kind(self, kind_name: str, /, **fields: Field) -> MessageKind:
        if kind_name in self.kinds:
            raise ValueError(f"message kind {kind_name!r} already declared in {self.protocol}")
        mk = MessageKind(kind_name, dict(fields))
        self.kinds[kind_name] = mk
        return mk

    def encode(self, msg: Message) -> bytes:
        mk = self.kinds.get(msg.kind)
        if mk is None:
            raise WireError(f"{self.protocol}: cannot encode unknown kind {msg.kind!r}")
        values = msg.fields if msg.checked else mk.validate(msg.fields)
        data: bytes = msgpack.packb(
            [self.protocol, self.version, msg.kind, values], use_bin_type=True, default=_packed
        )
        if len(data) > self.max_bytes:
            raise WireError(
                f"{self.protocol}.{msg.kind}: {len(data)} bytes exceed the limit {self.max_bytes}"
            )
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        try:
            return self._decode(data)
        except WireError:
            raise
        except Exception as exc:  # any decoder failure becomes a WireError
            raise WireError(
                f"{self.protocol}: undecodable message ({type(exc).__name__}: {str(exc)[:120]})"
            ) from None

    def _decode(self, data: bytes | bytearray | memoryview) -> Message:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"{self.protocol}: expected bytes, got {type(data).__name__}")
        n = len(data)
        if n > self.max_bytes:
            raise WireError(f"{self.protocol}: {n} bytes exceed the limit {self.max_bytes}")
        try:
            obj = msgpack.unpackb(
                bytes(data),
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_bin_len=self.max_bytes,
                max_str_len=self.max_bytes,
                max_array_len=self.max_items,
                max_map_len=256,
                max_ext_len=0,
            )
        except Exception as exc:
            raise WireError(f"{self.protocol}: malformed msgpack ({type(exc).__name__})") from None
        if not isinstance(obj, list) or len(obj) != 4:
            raise WireError(f"{self.protocol}: expected a 4-item envelope")
        protocol, version, kind, values = obj
        if protocol != self.protocol:
            raise WireError(f"{self.protocol}: message of protocol {str(protocol)[:40]!r}")
        if not _is_int(version) or version != self.version:
            raise WireError(f"{self.protocol}: version {str(version)[:20]} is not {self.version}")
        if not isinstance(kind, str) or kind not in self.kinds:
            raise WireError(f"{self.protocol}: unknown kind {str(kind)[:40]!r}")
        if not isinstance(values, dict):
            raise WireError(f"{self.protocol}.{kind}: fields must be a map")
        # strict_map_key admits only str and bytes keys; a bytes key is no field name, so
        # validate() refuses it as unknown
        return Message(kind, self.kinds[kind].validate(values, owned=True), checked=True)
