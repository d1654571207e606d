"""An owner's I5 check sees any one value of a landed page that differs from what its
writer checksummed, by any amount: among them a 32-bit value moved by 2^31 - 1 (1.0 landed
as -0.99999994), which a checksum over 32-bit words mod 2^31 - 1 cannot tell apart. The
request fails before it decodes, logged with its id. Broken mode: the owner checks with the
32-bit-word function, and the request decodes over the wrong value."""

from __future__ import annotations

import pytest
import torch
from test_protocol_units import _assign_and_notice_fields, _owner

from kvferry.cluster import decode_path
from kvferry.cluster import messages as m
from kvferry.engine.integrity import MODULUS


def _sums_over_32_bit_words(kv: torch.Tensor, pages) -> torch.Tensor:
    """BROKEN: the page checksum over 32-bit words, as kvferry took it before."""
    out = []
    for p in [int(x) for x in pages]:
        words = [w & 0xFFFFFFFF for w in kv[p].reshape(-1).view(torch.int32).tolist()]
        s1 = sum(words) % MODULUS
        s2 = sum((i + 1) * w for i, w in enumerate(words)) % MODULUS
        out.append(s1 * (1 << 31) + s2)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("words", [16, 32], ids=["16-bit-words", "broken-32-bit-words"])
def test_one_value_moved_by_p_fails_the_request(monkeypatch, words):
    if words == 32:
        monkeypatch.setattr(decode_path, "page_checksums", _sums_over_32_bit_words)
        sums_of = _sums_over_32_bit_words
    else:
        sums_of = decode_path.page_checksums
    owner, rt = _owner(integrity=True)
    notice = _assign_and_notice_fields(owner, rt, "r", checksums=False)
    pages = notice["pages"]
    kv = owner.pool.kv
    notice["first_token"] = owner.path.model.prefill(kv, list(range(3, 43)), pages)
    value = kv[pages[2]].reshape(-1)
    value[3] = 1.0
    notice["checksums"] = sums_of(kv, pages).tolist()  # the writer's, of what it wrote
    as_word = value.view(torch.int32)
    as_word[3] = as_word[3] + MODULUS  # 0x3f800000 -> 0xbf7fffff: what landed
    assert value[3].item() == pytest.approx(-0.99999994)
    rt.deliver(m.NOTICE, src=1, **notice)
    rt.pump()
    done = [f for _, k, f in rt.sent if k == "DONE" and f["rid"] == "r"]
    tokens = [f for _, k, f in rt.sent if k == "TOKENS" and f["rid"] == "r"]
    if words == 32:
        assert tokens and not done  # decoding over the wrong value: what the check prevents
        return
    assert not tokens
    assert done and done[0]["outcome"] == "failed" and "checksum mismatch" in done[0]["error"]
