"""copy_tensor_runs: byte runs between two tensors of one device, by torch (the CUDA
staging's gather, here on CPU tensors), checked against both before anything is copied,
writes what the native copy_runs writes. Skipped where torch is not installed (the
transfer package's own tests run without it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="copy_tensor_runs copies torch tensors")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvferry.transfer import (  # noqa: E402
    SegmentBoundsError,
    TransferConfig,
    TransferEngine,
    copy_runs,
    copy_tensor_runs,
)
from kvferry.transfer import local_copy as local_copy_module  # noqa: E402
from kvferry.transfer.local_copy import copy_unit, copy_word  # noqa: E402


@st.composite
def run_lists(draw):
    """Runs between a source of ``n`` bytes and a destination of ``m``, the destination's
    disjoint (as a gather's are), on a grain of 1-64 bytes."""
    grain = draw(st.sampled_from([1, 2, 4, 8, 16, 64]))
    n = grain * draw(st.integers(1, 256))
    m = grain * draw(st.integers(1, 256))
    runs, at = [], 0
    for _ in range(draw(st.integers(0, 12))):
        at += grain * draw(st.integers(0, 8))
        length = grain * draw(st.integers(1, 16))
        if at + length > m or length > n:
            break
        src_at = grain * draw(st.integers(0, (n - length) // grain))
        runs.append((src_at, at, length))
        at += length
    order = draw(st.permutations(range(len(runs))))
    return n, m, np.array([runs[i] for i in order], dtype=np.int64).reshape(-1, 3)


def _expected(src: np.ndarray, dst: np.ndarray, runs: np.ndarray) -> np.ndarray:
    out = dst.copy()
    for s, d, n in runs:
        out[d : d + n] = src[s : s + n]
    return out


def _at(data: np.ndarray, shift: int) -> torch.Tensor:
    """``data`` as a uint8 tensor whose first byte lies ``shift`` bytes past an 8-byte
    boundary (a view into a larger buffer, as a region inside a pool is)."""
    whole = torch.zeros(len(data) + 8, dtype=torch.uint8)
    start = (8 - whole.data_ptr() % 8) % 8 + shift
    view = whole[start : start + len(data)]
    view.copy_(torch.from_numpy(data))
    return view


@settings(max_examples=200, deadline=None)
@given(run_lists(), st.integers(0, 2**31 - 1), st.integers(0, 7), st.integers(0, 7))
def test_the_torch_copy_moves_what_the_native_copy_moves(case, seed, src_shift, dst_shift):
    """copy_tensor_runs and copy_runs write the same bytes, and exactly the runs' (every
    other byte of the destination as it was), with either tensor at any address."""
    n, m, runs = case
    rng = np.random.default_rng(seed)
    src_bytes = rng.integers(0, 256, n, dtype=np.uint8)
    before = rng.integers(0, 256, m, dtype=np.uint8)
    want = _expected(src_bytes, before, runs)
    src, by_torch = _at(src_bytes, src_shift), _at(before, dst_shift)
    assert copy_tensor_runs(by_torch, src, runs) == int(runs[:, 2].sum())
    assert np.array_equal(by_torch.numpy(), want)
    assert np.array_equal(src.numpy(), src_bytes)
    a = TransferEngine(TransferConfig(transports="shm", name="copy-native"))
    try:
        native = torch.from_numpy(before.copy())
        copy_runs(a.register(native), a.register(torch.from_numpy(src_bytes)), runs)
        assert np.array_equal(native.numpy(), want)
    finally:
        a.shutdown()


def test_the_word_follows_the_unit_and_both_addresses():
    aligned = _at(np.zeros(64, dtype=np.uint8), 0)
    assert copy_word(16, aligned, aligned) == 8
    assert copy_word(4, aligned, aligned) == 4
    assert copy_word(16, aligned, _at(np.zeros(64, dtype=np.uint8), 2)) == 2
    assert copy_word(16, _at(np.zeros(64, dtype=np.uint8), 3), aligned) == 1


def test_a_too_wide_copy_unit_is_caught(monkeypatch):
    """BROKEN MODE: a unit taken from the offsets alone (not the lengths) moves whole
    units only and drops each run's tail; the comparison above catches it."""
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    runs = np.array([[64, 0, 48], [128, 64, 16]], dtype=np.int64)
    want = _expected(src.numpy(), np.zeros(256, dtype=np.uint8), runs)
    assert copy_unit(runs) == 16
    good = torch.zeros(256, dtype=torch.uint8)
    copy_tensor_runs(good, src, runs)
    assert np.array_equal(good.numpy(), want)

    def offsets_only(r: np.ndarray) -> int:
        g = int(np.gcd.reduce(r[:, :2].reshape(-1)))
        return min(64, g & -g)

    monkeypatch.setattr(local_copy_module, "copy_unit", offsets_only)
    broken = torch.zeros(256, dtype=torch.uint8)
    copy_tensor_runs(broken, src, runs)
    assert not np.array_equal(broken.numpy(), want)


def test_a_word_wider_than_an_address_allows_is_caught(monkeypatch):
    """BROKEN MODE: words of 8 bytes whatever the tensors' addresses: torch refuses to
    view a tensor 2 bytes past a boundary as int64, so nothing is copied wrong, but the
    copy fails where the real word (2) succeeds."""
    src = _at(np.arange(64, dtype=np.uint8), 2)
    runs = np.array([[16, 0, 16]], dtype=np.int64)
    good = torch.zeros(64, dtype=torch.uint8)
    copy_tensor_runs(good, src, runs)
    assert np.array_equal(good.numpy()[:16], np.arange(16, 32, dtype=np.uint8))
    monkeypatch.setattr(local_copy_module, "copy_word", lambda unit, *tensors: 8)
    with pytest.raises(RuntimeError):
        copy_tensor_runs(torch.zeros(64, dtype=torch.uint8), src, runs)


def test_the_torch_copy_refuses_runs_outside_either_tensor():
    src, dst = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(SegmentBoundsError, match="40"):
        copy_tensor_runs(dst, src, np.array([[40, 0, 32]], dtype=np.int64))
    with pytest.raises(SegmentBoundsError):
        copy_tensor_runs(dst, src, np.array([[0, 16, 32]], dtype=np.int64))
    assert torch.count_nonzero(dst) == 0


def test_the_torch_copy_refuses_other_dtypes_or_devices():
    src = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(TypeError, match="int32"):
        copy_tensor_runs(torch.zeros(16, dtype=torch.int32), src, np.array([[0, 0, 8]]))
