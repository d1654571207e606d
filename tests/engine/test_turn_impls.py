"""The two turns of rows between layouts give the same bytes: the torch reference
(``pool.turn_rows_reference``, on any device) and the native one
(``kvferry.transfer._turn``, what ``pool.turn_rows`` runs on CPU rows).

Cases (hypothesis): rows with any padding between them, viewed as any KV dtype; arrays
``[outer..., a, b, inner...]`` with 1-4 of each of a and b (1 is its own turn), vectors of
one element to several, the turned axes anywhere in the row; row lists in any order, with
repeats (a row listed twice is turned once, in both). Bytes outside the listed rows stay
as they were.

The comparison is shown to work: a native turn that leaves each array's second vector
unwritten, and one given the array's two axes the wrong way round, are each caught by the
same strategy and comparison.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from kvferry.engine import pool
from kvferry.engine.pool import turn_rows_native, turn_rows_reference

DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64]


@st.composite
def turn_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    dtype = draw(st.sampled_from(DTYPES))
    pre = draw(st.lists(st.integers(1, 3), max_size=2))
    post = draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))
    a, b = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    landed = (*pre, a, b, *post)
    row = math.prod(landed)
    n = draw(st.integers(1, 5))
    pad = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, ((row + pad) * n * _size(dtype),), generator=gen)
    memory = buf.to(torch.uint8).view(dtype)
    rows = memory.as_strided((n, row), (row + pad, 1))
    index = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=2 * n)))
    return rows, index.to(torch.int64), landed, len(pre)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mismatch(case: tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]) -> bool:
    """True when the native turn and the reference leave different bytes (padding
    included: the memory under the rows' view is compared whole)."""
    rows, index, landed, axis = case
    base = rows.as_strided((rows.untyped_storage().nbytes() // rows.element_size(),), (1,), 0)
    want_memory, got_memory = base.clone(), base.clone()
    for memory, turn in ((want_memory, turn_rows_reference), (got_memory, turn_rows_native)):
        view = memory.as_strided(rows.shape, rows.stride(), rows.storage_offset())
        turn(view, index, landed, axis)
    return not torch.equal(want_memory.view(torch.uint8), got_memory.view(torch.uint8))


def test_the_native_module_is_built_and_turn_rows_runs_it_on_cpu(monkeypatch):
    assert pool._native_turn() is not None
    called: list[str] = []
    monkeypatch.setattr(pool, "turn_rows_native", lambda *a: called.append("native"))
    monkeypatch.setattr(pool, "turn_rows_reference", lambda *a: called.append("reference"))
    rows = torch.zeros(3, 24)
    pool.turn_rows(rows, torch.tensor([2, 0]), (2, 3, 4), 0)
    pool.turn_rows(rows.t().contiguous().t(), torch.tensor([0]), (2, 3, 4), 0)  # not dense
    assert called == ["native", "reference"]


@given(turn_cases())
@settings(max_examples=300, deadline=None)
def test_native_and_reference_turn_the_same_bytes(case):
    assert not mismatch(case)


def test_a_listed_row_is_turned_and_the_others_are_left():
    rows = torch.arange(3 * 2 * 3 * 4, dtype=torch.float32).view(3, -1)
    before = rows.clone()
    turn_rows_native(rows, torch.tensor([2, 1]), (2, 3, 4), 0)
    assert torch.equal(rows[0], before[0])
    for r in (1, 2):
        assert torch.equal(rows[r].view(3, 2, 4), before[r].view(2, 3, 4).transpose(0, 1))


def test_a_row_outside_is_refused_before_any_is_turned():
    rows = torch.arange(3 * 12, dtype=torch.float32).view(3, 12)
    before = rows.clone()
    with pytest.raises(IndexError, match=r"row 3 outside \[0, 3\): nothing turned"):
        turn_rows_native(rows, torch.tensor([0, 3]), (3, 4, 1), 0)
    with pytest.raises(IndexError, match=r"row -1 outside"):
        turn_rows_native(rows, torch.tensor([-1]), (3, 4, 1), 0)
    assert torch.equal(rows, before)


class _SwappedAxes:
    """The native lib given the array's two axes the wrong way round."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def kvf_turn_rows(self, base: Any, stride: int, rows: int, index: Any, n: int, outer: int,
                      a: int, b: int, vec: int) -> int:  # fmt: skip
        return self._lib.kvf_turn_rows(base, stride, rows, index, n, outer, b, a, vec)


class _ShortScatter:
    """A native turn that writes back every vector but the array's second: that one keeps
    its landed bytes (the first and the last vector of a turn stay in place)."""

    def __init__(self, ffi: Any, lib: Any) -> None:
        self._ffi, self._lib = ffi, lib

    def kvf_turn_rows(self, base: Any, stride: int, rows: int, index: Any, n: int, outer: int,
                      a: int, b: int, vec: int) -> int:  # fmt: skip
        span = a * b * vec
        addr = int(self._ffi.cast("uintptr_t", base))
        rows_at = [int(index[i]) for i in range(n)]
        kept = [
            bytes(
                self._ffi.buffer(self._ffi.cast("char *", addr + r * stride + o * span + vec), vec)
            )
            for r in rows_at
            for o in range(outer)
        ]
        status = self._lib.kvf_turn_rows(base, stride, rows, index, n, outer, a, b, vec)
        k = 0
        for r in rows_at:
            for o in range(outer):
                at = self._ffi.cast("char *", addr + r * stride + o * span + vec)
                self._ffi.memmove(at, kept[k], vec)
                k += 1
        return status


@pytest.mark.parametrize("bug", ["short", "axes"])
def test_a_broken_native_turn_is_caught(monkeypatch, bug):
    native = pool._native_turn()
    assert native is not None
    ffi, lib = native
    broken = _ShortScatter(ffi, lib) if bug == "short" else _SwappedAxes(lib)
    monkeypatch.setattr(pool, "_native_turn", lambda: (ffi, broken))
    found = find(turn_cases(), mismatch, settings=settings(max_examples=300, database=None))
    _, index, landed, axis = found
    assert index.numel() > 0 and landed[axis] * landed[axis + 1] > 1
