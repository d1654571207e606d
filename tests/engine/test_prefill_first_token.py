"""The prefill returns the answer's first token: what decode's first step would read from
the pages, computed while the prompt's K/V are written (no second pass over them)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine import KVPool, LlamaConfig, LlamaModel, ReplayConfig, ReplayModel
from kvferry.engine.replay import FirstRead
from kvferry.engine.stepwise import TAIL_BYTES, TAIL_DIVISOR, chunk_bounds
from kvferry.engine.tokenizer import CONFLICT


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _first_step(model, pool, prompt, row) -> int:
    """Decode's first step over the pages: the last prompt token at ``len - 1``."""
    n = len(prompt)
    table = torch.tensor([row], dtype=torch.int32)
    out = model.decode_step(
        pool.kv, table, torch.tensor([n - 1]), torch.tensor([prompt[-1]]), torch.tensor([n])
    )
    return int(out[0])


@pytest.mark.parametrize("chunk", [3, 16, 1 << 16])
@pytest.mark.parametrize("heads", [None, (0, 2), (2, 4)])
def test_the_replay_prefill_returns_what_the_first_step_reads(chunk, heads):
    model = ReplayModel(
        ReplayConfig(
            layers=2, kv_heads=4, head_dim=32, max_positions=4096, prefill_chunk_tokens=chunk
        )
    )
    prompt = _prompt(45, seed=chunk)
    pool = KVPool(model.pool_config(page_size=16, num_pages=8))
    row = [5, 1, 7, 2]
    first = model.prefill(pool.kv, prompt, row, head_range=heads)
    assert first == prompt[0]
    if heads is None:  # the pages hold every head: decode's first step reads the same
        assert _first_step(model, pool, prompt, row) == first


def test_an_empty_prefill_reads_no_token():
    model = ReplayModel(ReplayConfig(head_dim=32, max_positions=4096))
    pool = KVPool(model.pool_config(page_size=16, num_pages=2))
    assert model.prefill(pool.kv, [], [0]) == CONFLICT


def test_the_llama_prefill_returns_the_greedy_token_of_its_last_logits():
    model = LlamaModel(
        LlamaConfig(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, vocab_size=300)
    )
    prompt = _prompt(37, seed=3)
    pool = KVPool(model.pool_config(page_size=8, num_pages=6))
    row = [4, 0, 5, 1, 2]
    first = model.prefill(pool.kv, prompt, row)
    assert first == int(model.prefill_logits(pool.kv, prompt, row).argmax())
    assert first == _first_step(model, pool, prompt, row)


def _dense(query, keys, values, scale):
    weights = torch.softmax((keys @ query) * scale, dim=0)
    return weights @ values


class _Forgetful(FirstRead):
    """Broken mode: each chunk's softmax starts afresh (what was summed is dropped)."""

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.top = self.weight = self.acc = None
        super().add(keys, values)


@pytest.mark.parametrize("read_class", [FirstRead, _Forgetful], ids=["online", "broken-forgetful"])
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    cuts=st.lists(st.integers(1, 199), max_size=6),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.5, 8.0),
)
def test_the_online_read_equals_one_softmax_over_every_key(read_class, n, cuts, seed, scale):
    """Keys and values in chunks cut anywhere: the running maximum, weight and sum give
    the softmax over all of them. Broken mode (a read that drops what earlier chunks
    summed) is caught whenever those chunks hold a share of the softmax."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(8, generator=gen)
    keys, values = torch.randn(n, 8, generator=gen), torch.randn(n, 8, generator=gen)
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    read = read_class(query, scale)
    for lo, hi in itertools.pairwise(bounds):
        read.add(keys[lo:hi], values[lo:hi])
    assert read.weight is not None and read.acc is not None
    got = read.acc / read.weight
    want = _dense(query, keys, values, scale)
    assert math.isfinite(float(read.weight))
    earlier = float(torch.softmax((keys @ query) * scale, dim=0)[: bounds[-2]].sum())
    if read_class is FirstRead:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    elif earlier > 0.05:
        assert not torch.allclose(got, want, atol=1e-5, rtol=1e-4)  # the test catches it


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 5000),
    chunk=st.integers(1, 700),
    token_bytes=st.sampled_from([0, 512, 32 << 10, TAIL_BYTES // 3, TAIL_BYTES * 2]),
)
def test_prefill_pieces_cover_the_prompt_and_end_small(n, chunk, token_bytes):
    """Pieces in order, none empty (but the one of an empty prompt), none over a chunk;
    the last at most ``chunk // TAIL_DIVISOR`` tokens and at most ``TAIL_BYTES`` of KV
    (but a single token's): what the owner checks after the last byte landed; for a
    handful more pieces than whole chunks."""
    pieces = chunk_bounds(n, chunk, token_bytes)
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert all(0 < hi - lo <= chunk for lo, hi in pieces) or pieces == [(0, 0)]
    least = max(1, chunk // TAIL_DIVISOR)
    if token_bytes:
        least = max(1, min(least, TAIL_BYTES // token_bytes))
    if n:
        assert pieces[-1][1] - pieces[-1][0] <= least
        tail = (pieces[-1][1] - pieces[-1][0]) * token_bytes
        assert tail <= max(TAIL_BYTES, token_bytes)
    assert len(pieces) <= -(-n // chunk) + chunk.bit_length() + 1
    if not token_bytes:
        assert len(pieces) <= -(-n // chunk) + TAIL_DIVISOR.bit_length() + 1
