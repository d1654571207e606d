"""The three page checksums give the same values, bit for bit: the torch reference
(``integrity.page_checksums_reference``), the native one (``kvferry.transfer._checksum``,
what ``integrity.page_checksums`` runs on CPU pools), and the Triton kernel under Triton's
interpreter (few, small examples: it is slow).

Cases: random bytes viewed as float32, bfloat16, float16, int8 and uint8; page sizes that
hit the word path and the byte path (byte counts not a multiple of 4), the native
blocks' edges (16-word groups, 4096-word blocks) and their tails; page lists with repeats;
pools that are views with any page stride, offsets that leave words unaligned, and pages
that are not dense inside (a writer's share of the heads, a transposed page), which the
public function checksums natively on a dense copy of the listed pages.

The comparison is shown to work: a reference with one bit of its word mask dropped, and
a native call that leaves out a page's last word, are each caught by the same strategy
and the same comparison. And the checksum catches what integrity must: a torn page, a
page of another request, a short write, any single flipped bit.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st


def _interpreted(name: str):
    """Import a kernel module with TRITON_INTERPRET=1 (read when its kernels are defined),
    leaving the variable as it was for the rest of the process (as
    test_kernels_interpret.py does; whichever of the two runs first imports it)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module


@pytest.fixture(autouse=True, scope="module")
def _interpreter_on():
    """The interpreter reads the variable at run time too; set only while these tests run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


tc = _interpreted("kvferry.engine.kernels.triton_checksum")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvferry.engine import integrity  # noqa: E402
from kvferry.engine.integrity import (  # noqa: E402
    page_checksums,
    page_checksums_native,
    page_checksums_reference,
    verify_pages,
)
from kvferry.engine.kernels import dispatch  # noqa: E402

if not isinstance(tc._checksum_kernel, InterpretedFunction):
    pytest.fail(
        "triton_checksum was imported before TRITON_INTERPRET=1 could take effect", pytrace=False
    )

Impl = Callable[[torch.Tensor, Any], torch.Tensor]
IMPLS: dict[str, Impl] = {
    "native": page_checksums_native,
    "public": page_checksums,
    "triton": tc.page_checksums,
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8]


def test_the_native_module_is_built_and_used_on_cpu():
    kv = torch.zeros(4, 2, 8)
    assert integrity.native_supports(kv)
    assert not integrity.native_supports(kv.transpose(1, 2))  # pages not dense inside
    assert not integrity.native_supports(kv[:0])


# --- cases ---------------------------------------------------------------------------
def make_pool(
    seed: int,
    dtype: torch.dtype,
    pool_pages: int,
    page_elements: int,
    pad: int,
    offset: int,
    fill: str,
) -> torch.Tensor:
    """``[pool_pages, page_elements]`` of dtype, a view into rows of ``page_elements + pad``
    elements starting ``offset`` elements in: the page stride is any element count and the
    pool's first byte need not be 4-byte aligned. Bytes are random (every bit pattern,
    NaNs included), all 0xFF (the largest words: the sums' bounds) or zero."""
    size = torch.empty(0, dtype=dtype).element_size()
    row = page_elements + pad
    if fill == "random":
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (pool_pages, row * size), generator=gen, dtype=torch.uint8)
    else:
        raw = torch.full((pool_pages, row * size), 0xFF if fill == "ones" else 0, dtype=torch.uint8)
    return raw.view(dtype)[:, offset : offset + page_elements]


# Element counts near the native code's edges (groups of 16 words, blocks of 4096) and
# small ones; with 1- and 2-byte dtypes an odd count takes the byte path.
page_elements_st = st.one_of(
    st.integers(1, 70),
    st.integers(4080, 4112),
    st.integers(8190, 8210),
    st.integers(16380, 16400),
)


@st.composite
def cases(draw, max_elements: int | None = None, max_pages: int = 8):
    dtype = draw(st.sampled_from(DTYPES))
    elements = draw(page_elements_st)
    if max_elements is not None:
        elements = min(elements, max_elements)
    pool_pages = draw(st.integers(1, max_pages))
    pad = draw(st.integers(0, 5))
    offset = draw(st.integers(0, pad))
    fill = draw(st.sampled_from(["random", "random", "random", "ones", "zeros"]))
    seed = draw(st.integers(0, 2**32 - 1))
    pages = draw(st.lists(st.integers(0, pool_pages - 1), min_size=0, max_size=12))
    kv = make_pool(seed, dtype, pool_pages, elements, pad, offset, fill)
    shape = draw(st.sampled_from(["flat", "rows"]))
    if shape == "rows" and elements % 2 == 0:  # [pool, 2, elements / 2], pages still dense
        kv = torch.as_strided(kv, (pool_pages, 2, elements // 2), (kv.stride(0), elements // 2, 1))
    return kv, pages


def mismatches(
    kv: torch.Tensor, pages: Sequence[int], impls: dict[str, Impl], reference: Impl
) -> list[str]:
    """The implementations whose values differ from the reference's anywhere."""
    want = reference(kv, pages)
    assert want.dtype == torch.int64 and want.shape == (len(pages),)
    bad = []
    for name, impl in impls.items():
        got = impl(kv, pages)
        if got.dtype != torch.int64 or not torch.equal(got, want):
            bad.append(name)
    return bad


def without_triton() -> dict[str, Impl]:
    return {k: v for k, v in IMPLS.items() if k != "triton"}


# --- agreement -----------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(cases())
def test_native_and_public_equal_the_reference(case):
    kv, pages = case
    assert mismatches(kv, pages, without_triton(), page_checksums_reference) == []


@settings(max_examples=12, deadline=None)
@given(cases(max_elements=4200, max_pages=4))
def test_all_three_agree(case):
    kv, pages = case
    assert mismatches(kv, pages[:4], IMPLS, page_checksums_reference) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_all_three_agree_on_each_dtype_and_both_paths(dtype):
    """Per dtype: a word-path page and, where the dtype allows it, a byte-path page, at an
    odd page stride and an unaligned start."""
    for elements in (1030, 1031):
        kv = make_pool(7, dtype, 3, elements, 3, 1, "random")
        assert mismatches(kv, [2, 0, 2], IMPLS, page_checksums_reference) == []


def test_largest_words_over_many_blocks():
    """All-0xFF pages of several native blocks and a tail: the sums' bounds."""
    kv = make_pool(0, torch.int32, 2, 3 * 4096 + 17, 0, 0, "ones")
    assert mismatches(kv, [1, 0], without_triton(), page_checksums_reference) == []
    big = make_pool(0, torch.uint8, 1, (1 << 20) + 3, 0, 0, "ones")  # byte path, 1 MiB
    assert mismatches(big, [0], without_triton(), page_checksums_reference) == []


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.integers(1, 3),  # layers
    st.integers(1, 5),  # heads
    st.sampled_from([1, 3, 16]),  # page size
    st.sampled_from([1, 5, 32]),  # head dim
    st.data(),
)
def test_a_share_of_the_heads_is_checksummed_natively_on_a_dense_copy(
    dtype, layers, heads, page, dim, data
):
    """A writer's heads ``pool[:, :, :, lo:hi]``: pages not dense inside, so the public
    function copies the listed pages dense (in chunks) and runs the native checksum; the
    values are the reference's."""
    lo = data.draw(st.integers(0, heads - 1))
    hi = data.draw(st.integers(lo + 1, heads))
    size = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    raw = torch.randint(0, 256, (6, layers, 2, heads, page, dim * size), generator=gen)
    view = raw.to(torch.uint8).view(dtype)[:, :, :, lo:hi]
    pages = data.draw(st.lists(st.integers(0, 5), max_size=10))
    impls = {"gathered": integrity.page_checksums_gathered, "public": page_checksums}
    assert mismatches(view, pages, impls, page_checksums_reference) == []


def test_the_gathered_checksum_across_chunks_and_its_broken_mode_is_caught(monkeypatch):
    """Chunks of one page each give the same values; a gather that loses the pages'
    order (sorted, repeats dropped) is caught by the same comparison."""
    pool = make_pool(5, torch.float32, 6, 2 * 2 * 3 * 4 * 8, 0, 0, "random")
    view = pool.reshape(6, 2, 2, 3, 4, 8)[:, :, :, 1:3]
    pages = [4, 0, 4, 2]
    monkeypatch.setattr(integrity, "GATHER_BYTES", 1)
    impls = {"gathered": integrity.page_checksums_gathered, "public": page_checksums}
    assert mismatches(view, pages, impls, page_checksums_reference) == []
    real = integrity.page_checksums_gathered

    def broken(kv, listed):
        return real(kv, sorted(set(listed)) + [0] * (len(listed) - len(set(listed))))

    assert mismatches(view, pages, {"broken": broken}, page_checksums_reference) == ["broken"]


def test_pages_not_dense_inside_are_checksummed_on_a_dense_copy():
    kv = make_pool(3, torch.float32, 4, 48, 0, 0, "random").reshape(4, 6, 8).transpose(1, 2)
    assert not integrity.native_supports(kv)
    assert torch.equal(page_checksums(kv, [3, 3, 1]), page_checksums_reference(kv, [3, 3, 1]))
    with pytest.raises(ValueError, match="dense inside"):
        page_checksums_native(kv, [0])


def test_dispatch_runs_native_on_cpu_and_the_reference_when_forced(monkeypatch):
    kv = make_pool(4, torch.bfloat16, 5, 300, 1, 1, "random")
    want = page_checksums_reference(kv, [4, 0])
    calls: list[str] = []

    def spy(name: str, fn: Impl) -> Impl:
        def wrapped(kv: torch.Tensor, pages: Any) -> torch.Tensor:
            calls.append(name)
            return fn(kv, pages)

        return wrapped

    monkeypatch.setattr(integrity, "page_checksums_native", spy("native", page_checksums_native))
    ref = spy("reference", page_checksums_reference)
    monkeypatch.setattr(integrity, "page_checksums_reference", ref)
    monkeypatch.delenv("KVFERRY_KERNELS", raising=False)
    assert torch.equal(dispatch.page_checksums(kv, [4, 0]), want) and calls == ["native"]
    monkeypatch.setenv("KVFERRY_KERNELS", "torch")
    assert torch.equal(dispatch.page_checksums(kv, [4, 0]), want) and calls[-1] == "reference"


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_pages_outside_the_pool_raise(impl):
    fn = page_checksums_reference if impl == "reference" else IMPLS[impl]
    kv = make_pool(5, torch.float32, 3, 16, 0, 0, "random")
    for bad in ([3], [0, -1]):
        with pytest.raises(IndexError):
            fn(kv, bad)
    assert fn(kv, []).numel() == 0


def test_native_releases_the_gil():
    """This thread keeps running Python while another makes one long native call (a
    quarter-megabyte page read over and over, sized to take about 0.3 s): the longest
    pause between its steps stays well below the call's length. Held, the GIL would stop
    it for the whole call."""
    kv = make_pool(6, torch.uint8, 1, 1 << 18, 0, 0, "random")
    page_checksums_native(kv, [0])  # the module imported (that holds the GIL) beforehand
    start = time.perf_counter()
    page_checksums_native(kv, torch.zeros(512, dtype=torch.int64))
    per_page = (time.perf_counter() - start) / 512
    pages = torch.zeros(min(1 << 17, max(512, int(0.3 / per_page))), dtype=torch.int64)
    done = threading.Event()
    span: list[float] = []

    def work() -> None:
        start = time.perf_counter()
        page_checksums_native(kv, pages)
        span.append(time.perf_counter() - start)
        done.set()

    worker = threading.Thread(target=work)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    assert longest < span[0] / 2, (longest, span)


# --- the comparison catches a broken implementation ----------------------------------
def test_a_reference_with_one_mask_bit_dropped_is_caught(monkeypatch):
    """One bit of the reference's word mask dropped (the top bit of each word ignored):
    the same strategy and comparison find a case that exposes it."""
    monkeypatch.setattr(integrity, "_WORD_MASK", (1 << 31) - 1)
    found = find(
        cases(),
        lambda case: (
            mismatches(*case, {"native": page_checksums_native}, page_checksums_reference) != []
        ),
        settings=settings(max_examples=200, deadline=None, database=None),
    )
    assert mismatches(*found, {"native": page_checksums_native}, page_checksums_reference) == [
        "native"
    ]


class _ShortLib:
    """The native lib with every page one word short: a one-off bug in the length."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def kvf_page_checksums(self, base: Any, stride: int, page_bytes: int, *rest: Any) -> int:
        return self._lib.kvf_page_checksums(base, stride, max(0, page_bytes - 4), *rest)


def test_a_native_call_one_word_short_is_caught(monkeypatch):
    native = integrity._native()
    assert native is not None
    ffi, lib = native
    monkeypatch.setattr(integrity, "_native", lambda: (ffi, _ShortLib(lib)))
    found = find(
        cases(),
        lambda case: (
            mismatches(*case, {"native": page_checksums_native}, page_checksums_reference) != []
        ),
        settings=settings(max_examples=200, deadline=None, database=None),
    )
    assert len(found[1]) > 0


# --- what integrity must catch -------------------------------------------------------
def kv_pool(pages: int = 6, seed: int = 11) -> torch.Tensor:
    """A small paged KV pool ``[pages, layers, 2, kv_heads, page_size, head_dim]``, bf16."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 2, 2, 2, 16, 32, generator=gen).to(torch.bfloat16)


CHECKERS = {"reference": page_checksums_reference, **IMPLS}


@pytest.mark.parametrize("impl", list(CHECKERS))
def test_catches_torn_foreign_and_short_pages(impl):
    fn = CHECKERS[impl]
    kv = kv_pool()
    pages = list(range(kv.shape[0]))
    before = fn(kv, pages)
    bytes_ = kv.view(kv.shape[0], -1).view(torch.uint8)  # [pages, page bytes], same memory
    half = bytes_.shape[1] // 2
    bytes_[1, half:] = bytes_[2, half:].clone()  # torn: the second half from another page
    bytes_[3] = bytes_[4].clone()  # a page of another request, whole
    bytes_[5, 1000:] = 0  # a short write: zeros from some point on
    after = fn(kv, pages)
    assert [p for p in pages if before[p] != after[p]] == [1, 3, 5]


def test_verify_pages_flags_a_page_of_another_request():
    """Request a's pages 0-2, b's 3-5: a's page 1 overwritten by b's page 4 in transit."""
    kv = kv_pool()
    expected = page_checksums(kv, [0, 1, 2])
    kv[1] = kv[4]
    assert verify_pages(kv, [0, 1, 2], expected_checksums=expected) == [1]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_bit_is_caught(data):
    """Every bit of every byte, in pools of word and byte pages (native, through
    verify_pages); s1 alone changes by 2^b mod P, never 0."""
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.uint8]))
    elements = data.draw(st.sampled_from([4096 + 5, 4096 + 6]))
    kv = make_pool(data.draw(st.integers(0, 100)), dtype, 3, elements, 1, 1, "random")
    before = page_checksums(kv, [0, 1, 2])
    raw = kv.view(torch.uint8)  # [pages, page bytes], the same memory
    page = data.draw(st.integers(0, 2))
    byte = data.draw(st.integers(0, raw.shape[1] - 1))
    raw[page, byte] ^= 1 << data.draw(st.integers(0, 7))
    assert verify_pages(kv, [0, 1, 2], expected_checksums=before) == [page]
    assert not torch.equal(page_checksums_reference(kv, [page]), before[page : page + 1])
