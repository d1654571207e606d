import time

import pytest
import torch

from kvferry.engine import KVPool, MonolithicEngine, ReplayConfig, ReplayModel, tokenizer
from kvferry.engine.tokenizer import CONFLICT


def _text(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    words = [
        "kv",
        "page",
        "ferry",
        "decode",
        "prefill",
        "quarantine",
        "caf\u00e9",
        "\u00fcber",
        "42",
        "\n",
    ]
    out = []
    while len(tokenizer.encode(" ".join(out))) < n:
        out.append(words[int(torch.randint(len(words), (1,), generator=gen))])
    return tokenizer.encode(" ".join(out))[:n]


def test_tokenizer_roundtrip():
    text = "marker-\u00e9\u00e8-\u4e2d\u6587"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([104, 105, tokenizer.EOS], show_specials=False) == "hi"
    assert tokenizer.decode([tokenizer.CONFLICT]) == "<conflict>"


def test_replay_answers_a_4096_token_prompt_with_that_prompt():
    model = ReplayModel(ReplayConfig(head_dim=16, max_positions=8192))
    prompt = _text(4096)
    pool = KVPool(model.pool_config(page_size=256, num_pages=8192 // 256, dtype=torch.bfloat16))
    engine = MonolithicEngine(model, pool, context_length=8192)
    [result] = engine.generate([("r", prompt, 4096)])
    assert result.ok, result.error
    assert result.tokens == prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_replay_is_exact_in_every_pool_dtype(dtype):
    model = ReplayModel()
    prompt = _text(300, seed=5)
    engine = MonolithicEngine(model, KVPool(model.pool_config(16, 40, dtype)), context_length=640)
    [result] = engine.generate([("r", prompt, 300)])
    assert result.tokens == prompt


def test_longer_answers_cycle_through_the_prompt():
    model = ReplayModel(ReplayConfig(layers=2, kv_heads=2, q_per_kv=2))
    pool = KVPool(model.pool_config(page_size=4, num_pages=32, dtype=torch.bfloat16))
    engine = MonolithicEngine(model, pool, context_length=128)
    [result] = engine.generate([("r", "abcdefg", 20)])
    assert result.text == ("abcdefg" * 3)[:20]


def test_positions_stay_separable_at_64k():
    """Prefill a 64k context, then read a spread of positions through paged attention."""
    n = 65_536
    model = ReplayModel()
    prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3))
    page_size = 256
    pool = KVPool(
        model.pool_config(page_size=page_size, num_pages=n // page_size, dtype=torch.bfloat16)
    )
    row = torch.randperm(n // page_size, generator=torch.Generator().manual_seed(4))
    start = time.monotonic()
    model.prefill(pool.kv, prompt, row)
    targets = torch.tensor(
        [0, 1, 2, 255, 256, 32_767, 32_768, 65_534, 65_535, 12_345, 54_321, 40_000]
    )
    table = row[None, :].expand(len(targets), -1).to(torch.int32)
    lens = torch.full((len(targets),), n, dtype=torch.int32)
    got = model.read_positions(pool.kv, table, lens, targets)
    assert torch.equal(got, prompt[targets])
    assert (
        time.monotonic() - start < 120
    )  # a guard against a pathological slowdown, not a benchmark


def test_tensor_parallel_prefill_writes_only_its_heads():
    model = ReplayModel(ReplayConfig(kv_heads=4, q_per_kv=2))
    pool = KVPool(model.pool_config(page_size=4, num_pages=8), zero=True)
    prompt = tokenizer.encode("shard me")
    row = list(range(8))
    model.prefill(pool.kv, prompt, row, head_range=(0, 2))
    assert bool((pool.kv[:, :, :, 2:] == 0).all()) and bool((pool.kv[:2, :, :, :2] != 0).any())
    lens = torch.tensor([len(prompt)], dtype=torch.int32)
    table = torch.tensor([row], dtype=torch.int32)
    # half the heads missing: the answer is a visible conflict, not a plausible token
    assert model.read_positions(pool.kv, table, lens, torch.tensor([3])).item() == CONFLICT
    model.prefill(pool.kv, prompt, row, head_range=(2, 4))  # the other TP rank
    assert model.read_positions(pool.kv, table, lens, torch.tensor([3])).item() == prompt[3]


def test_foreign_kv_is_read_as_foreign_text():
    """The replay model's point: attending to another request's page shows its text."""
    model = ReplayModel()
    pool = KVPool(model.pool_config(page_size=8, num_pages=4))
    secret = tokenizer.encode("SECRET-ABCDEFGHI")
    model.prefill(pool.kv, secret, [0, 1])
    mine = tokenizer.encode("mine")
    model.prefill(pool.kv, mine, [0, 1])  # wrote 4 of the 16 positions it will attend over
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    got = [
        model.read_positions(
            pool.kv, table, torch.tensor([16], dtype=torch.int32), torch.tensor([t])
        ).item()
        for t in range(16)
    ]
    assert tokenizer.decode(got) == "mineET-ABCDEFGHI"
