"""Paged attention reference against dense attention over gathered KV.

Error bounds: fp32 pool and queries, atol = rtol = 2e-5 (both sides accumulate in fp32;
only summation order differs). bf16/fp16 pools: the paged path and the dense reference
read the same rounded K/V, so the same fp32 bound holds; the cast of the output to the
query dtype adds one rounding of that dtype.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine import (
    dense_attention,
    gather_kv,
    paged_decode_attention,
    write_kv_pages,
    write_kv_tokens,
)

ATOL = RTOL = 2e-5


@st.composite
def paged_case(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    page_size = draw(st.sampled_from([1, 4, 16]))
    layers = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(0, 70), min_size=batch, max_size=batch))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return kv_heads, group, head_dim, page_size, layers, seq_lens, dtype, seed


@settings(max_examples=60, deadline=None)
@given(paged_case())
def test_paged_matches_dense(case):
    kv_heads, group, head_dim, page_size, layers, seq_lens, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(1, -(-max(seq_lens) // page_size))
    num_pages = max_pages * len(seq_lens) + 3
    kv = torch.randn(num_pages, layers, 2, kv_heads, page_size, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), max_pages), -1, dtype=torch.int32)  # padding is never read
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        table[b, :used] = perm[b * max_pages : b * max_pages + used].to(torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen)
    layer = layers - 1
    out = paged_decode_attention(q, kv, layer, table, torch.tensor(seq_lens, dtype=torch.int32))
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert bool((out[b] == 0).all())
            continue
        k, v = gather_kv(kv, layer, table[b, : -(-n // page_size)], n)
        torch.testing.assert_close(out[b], dense_attention(q[b], k, v), atol=ATOL, rtol=RTOL)


def test_gqa_head_mapping():
    """Query head h reads KV head h // group: make heads distinguishable by their values."""
    kv = torch.zeros(1, 1, 2, 2, 4, 2)
    kv[0, 0, 1, 0] = 1.0
    kv[0, 0, 1, 1] = 2.0
    out = paged_decode_attention(
        torch.randn(1, 4, 2), kv, 0, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4])
    )
    assert torch.allclose(out[0, :2], torch.ones(2, 2)) and torch.allclose(
        out[0, 2:], torch.full((2, 2), 2.0)
    )


def test_positions_past_seq_len_are_masked():
    kv = torch.zeros(2, 1, 2, 1, 4, 2)
    kv[0, 0, 1, 0, :3] = 1.0
    kv[0, 0, :, 0, 3:] = float("nan")  # stale data past the sequence end
    kv[1] = float("nan")  # a page the table only pads with
    out = paged_decode_attention(
        torch.randn(1, 1, 2), kv, 0, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([3])
    )
    assert torch.allclose(out, torch.ones(1, 1, 2))


def test_write_then_gather_roundtrip_and_head_range():
    kv = torch.zeros(6, 2, 2, 4, 4, 8)
    row = [5, 2, 0]
    k, v = torch.randn(10, 4, 8), torch.randn(10, 4, 8)
    write_kv_pages(kv, 1, k, v, row, 0)
    gk, gv = gather_kv(kv, 1, row, 10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    kv.zero_()
    write_kv_pages(kv, 0, k[:, 1:3], v[:, 1:3], row, 0, head_lo=1)
    gk, _ = gather_kv(kv, 0, row, 10)
    assert torch.equal(gk[:, 1:3], k[:, 1:3]) and bool((gk[:, [0, 3]] == 0).all())
    with pytest.raises(ValueError):
        write_kv_pages(kv, 0, k, v, row[:2], 0)  # 10 positions need 3 pages


def test_write_kv_tokens_places_one_position_per_sequence():
    kv = torch.zeros(4, 1, 2, 2, 4, 3)
    k = torch.arange(12.0).view(2, 2, 3)
    write_kv_tokens(kv, 0, k, -k, torch.tensor([3, 1]), torch.tensor([2, 0]))
    assert torch.equal(kv[3, 0, 0, :, 2], k[0]) and torch.equal(kv[1, 0, 1, :, 0], -k[1])
    assert int(kv.count_nonzero()) == 2 * 2 * 2 * 3 - 2  # k[0][0][0] == 0


def test_page_table_outside_pool_is_an_error():
    kv = torch.zeros(2, 1, 2, 1, 4, 2)
    with pytest.raises(IndexError):
        paged_decode_attention(
            torch.randn(1, 1, 2), kv, 0, torch.tensor([[7]], dtype=torch.int32), torch.tensor([2])
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(16, 2, 2, 2, 16, 32, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, 8, 32, generator=gen)
    table = torch.randperm(16, generator=gen)[:15].view(3, 5).to(torch.int32)
    lens = torch.tensor([80, 33, 1], dtype=torch.int32)
    cpu = paged_decode_attention(q, kv, 1, table, lens)
    gpu = paged_decode_attention(q.cuda(), kv.cuda(), 1, table.cuda(), lens.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)
