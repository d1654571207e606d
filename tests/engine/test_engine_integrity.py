import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine import (
    Canary,
    CanaryTable,
    PageAllocator,
    TransferLengthError,
    check_transferred_length,
    expected_canaries,
    page_checksums,
    request_id_hash,
    verify_pages,
)
from kvferry.engine.integrity import MODULUS, page_checksums_reference


def _pool(dtype=torch.bfloat16, pages=6):
    return torch.randn(pages, 2, 2, 2, 4, 8, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_checksum_is_deterministic_and_per_page():
    kv = _pool()
    sums = page_checksums(kv, [0, 1, 2, 3, 4, 5])
    assert sums.dtype == torch.int64 and sums.shape == (6,)
    assert torch.equal(sums, page_checksums(kv.clone(), range(6)))
    assert torch.equal(page_checksums(kv, [4, 1]), sums[[4, 1]])
    assert len(set(sums.tolist())) == 6


def test_checksum_matches_a_plain_python_reference():
    kv = _pool(torch.float32, pages=2)
    words = kv[1].reshape(-1).view(torch.int16).tolist()
    s1 = sum(w & 0xFFFF for w in words) % MODULUS
    s2 = sum((i + 1) * (w & 0xFFFF) for i, w in enumerate(words)) % MODULUS
    assert page_checksums(kv, [1]).item() == s1 * (1 << 31) + s2


def _words32_changed_by(kv: torch.Tensor, page: int, index: int, delta: int) -> torch.Tensor:
    """``kv`` with 32-bit word ``index`` of ``page`` moved by ``delta`` (mod 2^32)."""
    out = kv.clone()
    words = out[page].reshape(-1).view(torch.int32)
    value = (int(words[index]) & 0xFFFFFFFF) + delta
    words[index] = ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2 * 2 * 2 * 4 * 8 - 1),
    st.one_of(
        st.sampled_from([MODULUS, -MODULUS, 2 * MODULUS, 1 << 16, -(1 << 16), 0xFFFF]),
        st.integers(1, (1 << 32) - 1),
    ),
)
def test_any_change_to_one_32_bit_value_is_caught(index, delta):
    """Any one fp32 value changed, by any amount: among them the changes of a multiple of
    P = 2^31 - 1 (1.0 into -0.99999994), which a sum of 32-bit words mod P cannot see."""
    kv = _pool(torch.float32)
    changed = _words32_changed_by(kv, 3, index, delta)
    for checksum in (page_checksums, page_checksums_reference):
        assert checksum(changed, [3]).item() != checksum(kv, [3]).item()


def test_broken_32_bit_words_miss_a_change_of_p():
    """The broken mode: the function over 32-bit words (the earlier one) gives one value
    for a page and the page with one word moved by P, which the test above would catch."""

    def words32(kv: torch.Tensor, page: int) -> int:
        words = [w & 0xFFFFFFFF for w in kv[page].reshape(-1).view(torch.int32).tolist()]
        s1 = sum(words) % MODULUS
        s2 = sum((i + 1) * w for i, w in enumerate(words)) % MODULUS
        return s1 * (1 << 31) + s2

    kv = _pool(torch.float32)
    kv[3].reshape(-1)[5] = 1.0
    changed = _words32_changed_by(kv, 3, 5, MODULUS)
    assert float(changed[3].reshape(-1)[5]) == pytest.approx(-0.99999994)
    assert words32(changed, 3) == words32(kv, 3)
    assert page_checksums(changed, [3]).item() != page_checksums(kv, [3]).item()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 6 * 2 * 2 * 2 * 4 * 8 - 1), st.integers(0, 15))
def test_any_single_bit_flip_is_caught(index, bit):
    kv = _pool(torch.float32)
    before = page_checksums(kv, range(6))
    raw = kv.view(-1).view(torch.int32)
    raw[index] ^= 1 << bit
    bad = verify_pages(kv, list(range(6)), expected_checksums=before)
    assert bad == [index // kv[0].numel()]


def test_swapped_words_are_caught():
    kv = _pool(torch.float32, pages=1)
    before = page_checksums(kv, [0])
    flat = kv.view(-1)
    flat[[3, 7]] = flat[[7, 3]].clone()
    assert verify_pages(kv, [0], expected_checksums=before) == [0]


def test_canaries_catch_foreign_stale_and_misplaced_pages():
    alloc = PageAllocator(8)
    table = CanaryTable(8)
    old = alloc.allocate("old", 3)
    table.stamp([g.page for g in old], expected_canaries("old", old))
    alloc.free("old")
    new = alloc.allocate("new", 3)
    pages = [g.page for g in new]
    want = expected_canaries("new", new)
    assert table.mismatched(pages, want) == pages  # still the old request's tags
    table.stamp(pages[:2], want[:2])  # the writer wrote only two pages
    assert table.mismatched(pages, want) == [pages[2]]
    table.stamp(pages[:2], [want[1], want[0]])  # right request, wrong places
    assert table.mismatched(pages, want) == pages[:2] + [pages[2]]
    assert table.get(pages[2]) == Canary(request_id_hash("old"), old[2].generation, 2)


def test_canary_rows_travel():
    table, other = CanaryTable(4), CanaryTable(4)
    table.stamp([1, 3], [Canary(5, 6, 0), Canary(5, 6, 1)])
    other.load([0, 2], table.rows([1, 3]))
    assert other.get(2) == Canary(5, 6, 1) and other.get(1) is None


def test_request_id_hash_is_stable():
    assert request_id_hash("abc") == request_id_hash("abc") != request_id_hash("abd")
    assert 0 <= request_id_hash("abc") < 2**63


def test_transferred_length():
    check_transferred_length("r", 100, 100)
    with pytest.raises(TransferLengthError) as err:
        check_transferred_length("r", 100, 1)
    assert (err.value.request_id, err.value.expected_tokens, err.value.received_tokens) == (
        "r",
        100,
        1,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksum_identical_on_gpu():
    kv = _pool()
    assert torch.equal(page_checksums(kv.cuda(), range(6)).cpu(), page_checksums(kv, range(6)))
