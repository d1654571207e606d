"""The streamed CPU decode attention against the reference, chunk by chunk.

Same function, other summation order: fp32 pools agree within atol = rtol = 2e-5,
bf16/fp16 pools read the same rounded K/V (the output's cast adds one rounding of
q's dtype, the tests keep q in fp32). Chunks as small as one page cross every page
boundary; stale slots past a sequence hold NaN, which must never reach the result. Pools
lie heads-major or token-major in memory (NHD, viewed heads-major as KVPool shows it).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.attention import paged_decode_attention as reference
from kvferry.engine.kernels import cpu_decode, dispatch

ATOL = RTOL = 2e-5


@st.composite
def streamed_case(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8, 32]))
    page_size = draw(st.sampled_from([1, 4, 16]))
    layers = draw(st.integers(1, 2))
    seq_lens = draw(st.lists(st.integers(0, 90), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    chunk_pages = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    token_major = draw(st.booleans())
    return (
        kv_heads, group, head_dim, page_size, layers, seq_lens, dtype, chunk_pages, seed,
        token_major,
    )  # fmt: skip


def _pool_and_table(kv_heads, head_dim, page_size, layers, seq_lens, dtype, gen, token_major):
    """A pool whose pages past each sequence's end are NaN, a shuffled page table;
    ``token_major``: the same values laid out NHD in memory, viewed HND."""
    max_pages = max(1, -(-max(seq_lens) // page_size))
    num_pages = max_pages * len(seq_lens) + 2
    kv = torch.randn(num_pages, layers, 2, kv_heads, page_size, head_dim, generator=gen)
    kv = kv.to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        pages = perm[b * max_pages : b * max_pages + used]
        table[b, :used] = pages.to(torch.int32)
        if n % page_size:
            kv[pages[-1], :, :, :, n % page_size :] = float("nan")  # stale slots
    if token_major:
        kv = kv.transpose(3, 4).contiguous().transpose(3, 4)  # one head or slot: alike
    return kv, table


def _streamed_and_reference(case):
    kv_heads, group, head_dim, page_size, layers, seq_lens, dtype, chunk_pages, seed, nhd = case
    gen = torch.Generator().manual_seed(seed)
    kv, table = _pool_and_table(kv_heads, head_dim, page_size, layers, seq_lens, dtype, gen, nhd)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    layer = layers - 1
    streamed = cpu_decode.paged_decode_attention(q, kv, layer, table, lens, chunk_pages=chunk_pages)
    return streamed, reference(q, kv, layer, table, lens)


@settings(max_examples=80, deadline=None)
@given(streamed_case())
def test_streamed_matches_reference(case):
    streamed, expected = _streamed_and_reference(case)
    assert streamed.shape == expected.shape and streamed.dtype == expected.dtype
    assert not bool(streamed.isnan().any())
    torch.testing.assert_close(streamed, expected, atol=ATOL, rtol=RTOL)


def test_broken_rescale_is_caught(monkeypatch):
    """The broken mode: sums of earlier chunks kept at their old max. The comparison above
    must fail on a context spread over several chunks."""
    monkeypatch.setattr(cpu_decode, "_rescale", lambda old, new: torch.ones_like(new))
    case = (2, 2, 8, 4, 1, [50, 33], torch.float32, 2, 7, False)
    streamed, expected = _streamed_and_reference(case)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(streamed, expected, atol=ATOL, rtol=RTOL)


def test_errors_name_the_numbers():
    kv = torch.zeros(4, 1, 2, 1, 4, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        cpu_decode.paged_decode_attention(q, kv, 0, torch.tensor([[9]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="seq_len 9 needs 3 pages, page table has 1"):
        cpu_decode.paged_decode_attention(q, kv, 0, torch.tensor([[0]]), torch.tensor([9]))


def test_dispatch_streams_long_contexts_on_cpu(monkeypatch):
    """A context of STREAM_FROM_TOKENS goes to the streamed path, a shorter one to the
    reference, and KVFERRY_KERNELS=torch keeps the reference everywhere."""
    calls: list[str] = []
    real = cpu_decode.paged_decode_attention

    def spy(*args, **kwargs):
        calls.append("streamed")
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "paged_decode_attention", spy)
    monkeypatch.setattr(cpu_decode, "STREAM_FROM_TOKENS", 64)
    monkeypatch.delenv("KVFERRY_KERNELS", raising=False)
    gen = torch.Generator().manual_seed(3)
    kv, table = _pool_and_table(2, 8, 4, 1, [64, 10], torch.float32, gen, False)
    q = torch.randn(2, 2, 8, generator=gen)
    long_lens, short_lens = torch.tensor([64, 10]), torch.tensor([63, 10])
    out = dispatch.paged_decode_attention(q, kv, 0, table, long_lens)
    assert calls == ["streamed"]
    torch.testing.assert_close(out, reference(q, kv, 0, table, long_lens), atol=ATOL, rtol=RTOL)
    dispatch.paged_decode_attention(q, kv, 0, table, short_lens)
    monkeypatch.setenv("KVFERRY_KERNELS", "torch")
    dispatch.paged_decode_attention(q, kv, 0, table, long_lens)
    assert calls == ["streamed"]


def test_a_token_major_pool_streams_and_matches_the_reference():
    """An NHD pool (KVPool's view of token-major storage) takes the streamed path too,
    reading its pages as stored; the result is the reference's. Broken mode: the pages
    put in position order as if they were heads-major, which the comparison catches."""
    case = (2, 2, 8, 4, 2, [50, 33], torch.float32, 3, 11, True)
    gen = torch.Generator().manual_seed(11)
    kv, _ = _pool_and_table(2, 8, 4, 2, [50, 33], torch.float32, gen, True)
    assert cpu_decode.wants_streaming(kv, torch.tensor([cpu_decode.STREAM_FROM_TOKENS]))
    streamed, expected = _streamed_and_reference(case)
    torch.testing.assert_close(streamed, expected, atol=ATOL, rtol=RTOL)
    real = cpu_decode._stored
    try:
        cpu_decode._stored = lambda kv: (real(kv)[0], False)  # type: ignore[assignment]
        broken, _ = _streamed_and_reference(case)
    finally:
        cpu_decode._stored = real
    with pytest.raises(AssertionError):
        torch.testing.assert_close(broken, expected, atol=ATOL, rtol=RTOL)
