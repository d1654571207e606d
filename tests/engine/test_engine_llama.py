"""The random Llama-style model: paged prefill and decode against a dense forward pass.

Tolerance: fp32 pages, 1e-4 absolute on logits; bf16 pages against a dense pass that
rounds K/V to bf16 the same way, 1e-3 (only summation order differs).
"""

import pytest
import torch

from kvferry.engine import KVPool, LlamaConfig, LlamaModel, MonolithicEngine

CONFIG = LlamaConfig(
    hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, intermediate=128, seed=7
)


def _tokens(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kv_dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_paged_decode_matches_dense(kv_dtype, atol):
    model = LlamaModel(CONFIG)
    tokens = _tokens(40)
    dense = model.forward_dense(tokens, kv_dtype=kv_dtype)
    pool = KVPool(model.pool_config(page_size=8, num_pages=12, dtype=kv_dtype))
    row = [11, 3, 7, 0, 5, 9]  # scattered pages
    last = model.prefill_logits(pool.kv, tokens[:25], row)
    torch.testing.assert_close(last, dense[24], atol=atol, rtol=0)
    assert model.prefill(pool.kv, tokens[:25], row) == int(last.argmax())  # the first token
    table = torch.tensor([row], dtype=torch.int32)
    for position in range(24, 40):  # first step rewrites the last prompt position
        logits = model.decode_logits(
            pool.kv, table, torch.tensor([position]), torch.tensor([tokens[position]])
        )
        torch.testing.assert_close(logits[0], dense[position], atol=atol, rtol=0)


def test_decode_reads_pages_not_hidden_state():
    """Corrupting the pages changes decode: it has no other copy of the context."""
    model = LlamaModel(CONFIG)
    tokens = _tokens(20)
    pool = KVPool(model.pool_config(page_size=8, num_pages=4))
    model.prefill(pool.kv, tokens, [0, 1, 2])
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    before = model.decode_logits(pool.kv, table, torch.tensor([19]), torch.tensor([tokens[19]]))
    pool.kv[0] = torch.randn_like(pool.kv[0])
    after = model.decode_logits(pool.kv, table, torch.tensor([19]), torch.tensor([tokens[19]]))
    assert (before - after).abs().max() > 1e-3


def test_tensor_parallel_prefill_composes():
    model = LlamaModel(CONFIG)
    tokens = _tokens(17)
    full = KVPool(model.pool_config(page_size=8, num_pages=3), zero=True)
    sharded = KVPool(model.pool_config(page_size=8, num_pages=3), zero=True)
    model.prefill(full.kv, tokens, [0, 1, 2])
    model.prefill(sharded.kv, tokens, [0, 1, 2], head_range=(0, 1))
    assert bool((sharded.kv[:, :, :, 1] == 0).all())
    model.prefill(sharded.kv, tokens, [0, 1, 2], head_range=(1, 2))
    assert torch.equal(full.kv, sharded.kv)


@pytest.mark.parametrize(
    "kv_heads, spans", [(3, [(0, 1), (1, 3)]), (3, [(0, 1), (1, 2), (2, 3)])], ids=["1+2", "1+1+1"]
)
def test_uneven_tensor_parallel_prefill_composes(kv_heads, spans):
    """Shards of unequal size (a group that does not divide the heads) write exactly the
    whole prefill's KV between them."""
    model = LlamaModel(LlamaConfig(layers=2, q_heads=2 * kv_heads, kv_heads=kv_heads, head_dim=8))
    tokens = _tokens(17)
    full = KVPool(model.pool_config(page_size=8, num_pages=3), zero=True)
    sharded = KVPool(model.pool_config(page_size=8, num_pages=3), zero=True)
    model.prefill(full.kv, tokens, [0, 1, 2])
    for span in spans:
        model.prefill(sharded.kv, tokens, [0, 1, 2], head_range=span)
    assert torch.equal(full.kv, sharded.kv)


def test_batched_decode_matches_single():
    model = LlamaModel(CONFIG)
    prompts = [_tokens(9, 1), _tokens(30, 2), _tokens(17, 3)]

    def run(batch):
        pool = KVPool(model.pool_config(page_size=8, num_pages=40))
        engine = MonolithicEngine(model, pool, context_length=320, max_batch=batch)
        return engine.generate([(f"r{i}", p, 12) for i, p in enumerate(prompts)])

    together, alone = run(3), run(1)
    assert all(r.ok for r in together + alone)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert all(len(r.tokens) >= 1 for r in together)


def test_a_token_major_pool_answers_as_a_heads_major_one():
    """The llama model over NHD storage (through the pool's HND view): the same prefill
    KV and the same tokens as over HND storage, bit for bit."""
    import dataclasses

    from kvferry.engine.reshard import Order

    model = LlamaModel(CONFIG)
    prompts = [_tokens(9, 1), _tokens(30, 2)]

    def run(order):
        config = dataclasses.replace(model.pool_config(page_size=8, num_pages=40), order=order)
        engine = MonolithicEngine(model, KVPool(config), context_length=320, max_batch=2)
        results = engine.generate([(f"r{i}", p, 8) for i, p in enumerate(prompts)])
        assert all(r.ok for r in results), [r.error for r in results]
        return [r.tokens for r in results]

    assert run(Order.NHD) == run(Order.HND)
