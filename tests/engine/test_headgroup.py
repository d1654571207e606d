"""A llama decode step put together from members that each hold a share of the KV heads
(:mod:`kvferry.engine.headgroup`) gives the logits of one pool holding every head, bit
for bit: splits even, uneven and overlapping, through the torch reference and the
streaming CPU path; a combine that gives a member's heads another member's answer is
caught by the same comparison; a head held by nobody is refused with the heads named."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine.headgroup import HeldHeads, attend_held, combine
from kvferry.engine.kernels import cpu_decode
from kvferry.engine.models import LlamaConfig, LlamaModel

SPLITS = {
    "halves": (4, [(0, 2), (2, 4)]),
    "quarters": (4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    "uneven": (3, [(0, 1), (1, 3)]),
    "shared": (2, [(0, 1), (0, 1), (1, 2), (1, 2)]),
}


def _case(kv_heads: int):
    model = LlamaModel(LlamaConfig(layers=3, q_heads=2 * kv_heads, kv_heads=kv_heads))
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(24, 3, 2, kv_heads, 8, model.head_dim, generator=gen)
    table = torch.tensor([[3, 9, 1, 17, 5], [0, 2, 4, 6, 8]], dtype=torch.int32)
    positions = torch.tensor([33, 12])
    tokens = torch.tensor([5, 77])
    return model, kv, table, positions, tokens


def _split_step(model, kv, table, positions, tokens, parts, join=combine) -> torch.Tensor:
    held = [HeldHeads(lo, hi, model.q_heads // model.kv_heads) for lo, hi in parts]
    pools = [kv[:, :, :, lo:hi].clone() for lo, hi in parts]
    step = model.decode_layers(positions, tokens)
    query = next(step)
    while True:
        shares = [
            (h, attend_held(p, h.share(query), table, positions))
            for h, p in zip(held, pools, strict=True)
        ]
        try:
            query = step.send(join(shares, model.kv_heads))
        except StopIteration as end:
            return end.value


@pytest.mark.parametrize("split", SPLITS, ids=list(SPLITS))
@pytest.mark.parametrize("streaming", [False, True], ids=["reference", "streaming"])
def test_a_split_step_gives_the_whole_pools_logits_bit_for_bit(monkeypatch, split, streaming):
    if streaming:  # the CPU path a long context takes, a page per pass
        monkeypatch.setattr(cpu_decode, "wants_streaming", lambda kv, seq_lens: True)
        monkeypatch.setattr(cpu_decode, "CHUNK_BYTES", 1)
    kv_heads, parts = SPLITS[split]
    model, kv, table, positions, tokens = _case(kv_heads)
    whole = model.decode_logits(kv.clone(), table, positions, tokens)
    assert torch.equal(_split_step(model, kv, table, positions, tokens, parts), whole)


def test_broken_a_member_given_anothers_answer_is_caught():
    model, kv, table, positions, tokens = _case(4)
    whole = model.decode_logits(kv.clone(), table, positions, tokens)

    def swapped(shares, kv_heads):
        answers = [got for _, got in shares][::-1]
        return combine([(h, got) for (h, _), got in zip(shares, answers, strict=True)], kv_heads)

    got = _split_step(model, kv, table, positions, tokens, [(0, 2), (2, 4)], join=swapped)
    assert not torch.equal(got, whole)


def test_a_head_held_by_nobody_is_refused_with_its_number():
    share = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match=r"KV heads \[1, 3\] of 4 are held by no member"):
        combine([(HeldHeads(0, 1, 2), share), (HeldHeads(2, 3, 2), share)], 4)
    with pytest.raises(ValueError, match=r"is \(1, 2, 16\), not \(1, 4, 16\)"):
        combine([(HeldHeads(0, 2, 2), share)], 2)
