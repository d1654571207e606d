"""The Triton kernels under Triton's interpreter (CPU) against the torch references.

Decode attention: random pools and tables, fp16 and bf16, head dims 64/128, page sizes
16/32/64, one split and several, empty sequences, a pool whose element offsets pass 2^31.
Bounds: fp32 queries give an fp32 output, so kernel and reference differ only in
summation order (under the interpreter every operand is fp32): atol = rtol = 2e-5. Queries
in the pool dtype add the output's cast, which the interpreter truncates (the GPU rounds):
one ulp of that dtype, 1e-2 for bf16 and 2e-3 for fp16.

Ownership: every kind (foreign request, stale generation, swapped entry, page id out of
the pool, sequence past its table) gives the torch reference's flags and first bad page,
and a clean run is bit-identical with the check on and off.

Checksums: exactly the reference's values. Each case is sized near 64 programs x 4 steps.
"""

from __future__ import annotations

import importlib
import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def _interpreted(name: str):
    """Import a kernel module with TRITON_INTERPRET=1 (read when its kernels are defined),
    leaving the variable as it was for the rest of the process."""
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


td = _interpreted("kvferry.engine.kernels.triton_decode")
tc = _interpreted("kvferry.engine.kernels.triton_checksum")

from kvferry.engine.allocator import PageGrant  # noqa: E402
from kvferry.engine.attention import paged_decode_attention as reference  # noqa: E402
from kvferry.engine.integrity import CanaryTable, expected_canaries, page_checksums  # noqa: E402
from kvferry.engine.kernels import (  # noqa: E402
    BEYOND_TABLE,
    FOREIGN_REQUEST,
    NO_BAD_PAGE,
    OUT_OF_POOL,
    STALE_GENERATION,
    WRONG_INDEX,
    PageOwnership,
    check_ownership_reference,
)

if not td.interpreted():
    pytest.fail(
        "kernel modules were imported before TRITON_INTERPRET=1 could take effect", pytrace=False
    )

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_case(
    seed: int,
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    seq_lens: list[int],
    kv_heads: int = 2,
    group: int = 4,
    layers: int = 2,
    spare_pages: int = 3,
):
    """Random pool ``[pages, layers, 2, kv_heads, page_size, head_dim]`` (stale slots NaN),
    a shuffled table ``[batch, width]`` int32 (padding -1), queries ``[batch, q_heads, d]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page_size) for n in seq_lens))
    num_pages = width * len(seq_lens) + spare_pages
    kv = torch.randn(num_pages, layers, 2, kv_heads, page_size, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        table[b, :used] = perm[b * width : b * width + used].to(torch.int32)
        if n % page_size:  # slots past the sequence's end hold garbage the kernel must not read
            kv[int(table[b, used - 1]), :, :, :, n % page_size :] = float("nan")
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen)
    return kv, table, torch.tensor(seq_lens, dtype=torch.int32), q


@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_matches_reference(dtype, head_dim, page_size):
    """fp32 queries through three splits (tight bound), pool-dtype queries unsplit."""
    seed = zlib.crc32(f"{dtype} {head_dim} {page_size}".encode())  # stable across runs
    lens = [
        int(torch.randint(1, 256, (1,), generator=torch.Generator().manual_seed(seed)).item()),
        0,
        256,
        37,
    ]
    kv, table, seq_lens, q = make_case(seed, dtype, head_dim, page_size, lens)
    layer = 1
    want = reference(q, kv, layer, table, seq_lens)  # fp32 queries: fp32 output
    got = td.paged_decode_attention(
        q, kv, layer, table, seq_lens, num_splits=3, out=torch.full_like(q, float("nan"))
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    q16 = q.to(dtype)
    got16 = td.paged_decode_attention(
        q16, kv, layer, table, seq_lens, num_splits=1, out=torch.full_like(q16, float("nan"))
    )
    assert got16.dtype == dtype
    torch.testing.assert_close(
        got16.float(),
        reference(q16, kv, layer, table, seq_lens).float(),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )
    assert bool((got16[1] == 0).all()) and bool((got[1] == 0).all()), "an empty sequence gets zeros"


def test_all_sequences_empty():
    kv, table, seq_lens, q = make_case(1, torch.bfloat16, 64, 16, [0, 0])
    for splits in (1, 2):
        got = td.paged_decode_attention(
            q, kv, 0, table, seq_lens, num_splits=splits, out=torch.full_like(q, float("nan"))
        )
        assert bool((got == 0).all())


def test_gqa_groups_and_default_splits():
    """Groups 1 and 8 (the query tile pads to 16 rows); the split heuristic's own choice."""
    for group in (1, 8):
        kv, table, seq_lens, q = make_case(
            group, torch.float16, 64, 16, [300, 5], kv_heads=2, group=group, layers=1
        )
        got = td.paged_decode_attention(q, kv, 0, table, seq_lens)
        torch.testing.assert_close(got, reference(q, kv, 0, table, seq_lens), atol=2e-5, rtol=2e-5)


def test_split_boundaries_inside_a_sequence():
    """Many splits of one block each: every split boundary falls inside the sequence."""
    kv, table, seq_lens, q = make_case(
        7, torch.bfloat16, 64, 16, [64 * 5 + 3], kv_heads=1, layers=1
    )
    want = reference(q, kv, 0, table, seq_lens)
    for splits in (2, 5, 6, 20):
        torch.testing.assert_close(
            td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=splits),
            want,
            atol=2e-5,
            rtol=2e-5,
        )


def test_strided_pool_view_is_read_in_place():
    """A pool that is a view (every other page of a larger allocation) is read without a copy."""
    kv, table, seq_lens, q = make_case(3, torch.float16, 64, 32, [100, 64], layers=1)
    big = torch.zeros((kv.shape[0] * 2,) + tuple(kv.shape[1:]), dtype=kv.dtype)
    big[::2] = kv
    view = big[::2]
    assert not view.is_contiguous()
    torch.testing.assert_close(
        td.paged_decode_attention(q, view, 0, table, seq_lens, num_splits=2),
        reference(q, kv, 0, table, seq_lens),
        atol=2e-5,
        rtol=2e-5,
    )


def test_token_major_pool_view_is_read_in_place():
    """An NHD pool as KVPool shows it (token-major storage viewed heads-major: the slot
    stride is all heads, the head stride one head) is read through its strides."""
    kv, table, seq_lens, q = make_case(4, torch.float16, 64, 16, [100, 37], layers=2)
    view = kv.transpose(3, 4).contiguous().transpose(3, 4)
    assert not view[0].is_contiguous() and view.stride(4) == kv.shape[3] * kv.shape[5]
    torch.testing.assert_close(
        td.paged_decode_attention(q, view, 1, table, seq_lens, num_splits=2),
        reference(q, kv, 1, table, seq_lens),
        atol=2e-5,
        rtol=2e-5,
    )


def test_pool_offsets_past_2_31():
    """Pages past element 2^31 of the pool: int32 offsets would wrap and read other pages.
    The pool is allocated, not touched (the OS maps only the pages written)."""
    page_size, head_dim = 16, 64
    per_page = page_size * head_dim * 2  # layers 1, kv_heads 1
    num_pages = (1 << 31) // per_page + 64  # the last 64 pages start past 2^31 elements
    kv = torch.empty(num_pages, 1, 2, 1, page_size, head_dim, dtype=torch.bfloat16)
    pages = torch.tensor(
        [num_pages - 1, 3, num_pages - 40, num_pages - 2, 17, num_pages - 64], dtype=torch.int32
    )
    gen = torch.Generator().manual_seed(5)
    for p in pages.tolist():
        kv[p] = torch.randn(1, 2, 1, page_size, head_dim, generator=gen).to(torch.bfloat16)
    assert int(pages.max()) * kv.stride(0) > 2**31
    table = pages.view(2, 3)
    seq_lens = torch.tensor([40, 48], dtype=torch.int32)
    q = torch.randn(2, 4, head_dim, generator=gen)
    want = reference(q, kv, 0, table, seq_lens)
    for splits in (1, 2):
        torch.testing.assert_close(
            td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=splits),
            want,
            atol=2e-5,
            rtol=2e-5,
        )
    canaries = torch.zeros(num_pages, 3, dtype=torch.int64)
    for b in range(2):
        for j in range(3):
            canaries[int(table[b, j])] = torch.tensor([100 + b, 7, j])
    own = PageOwnership.create(canaries, torch.tensor([100, 101]), torch.full((2, 3), 7))
    got = td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=2, ownership=own)
    assert own.failures() == []
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# --- ownership --------------------------------------------------------------------------
def owned_case(seed: int = 11, page_size: int = 16, lens=(70, 33, 0, 100)):
    """A batch whose pages are all correctly stamped: kv, table, seq_lens, q, canary table
    and per-sequence (request id, grants)."""
    kv, table, seq_lens, q = make_case(
        seed, torch.bfloat16, 64, page_size, list(lens), kv_heads=1, layers=1, spare_pages=6
    )
    canaries = CanaryTable(kv.shape[0])
    rids = [f"req-{seed}-{b}" for b in range(len(lens))]
    grants = []
    for b, n in enumerate(lens):
        row = [PageGrant(int(table[b, j]), 1000 + 10 * b + j) for j in range(-(-n // page_size))]
        canaries.stamp([g.page for g in row], expected_canaries(rids[b], row))
        grants.append(row)
    return kv, table, seq_lens, q, canaries, rids, grants


def run_both(kv, table, seq_lens, q, canaries, rids, grants, splits=2, placement="pages"):
    """The kernel's and the reference's ownership results, and the kernel's output."""
    own = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    ref = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    out = td.paged_decode_attention(
        q, kv, 0, table, seq_lens, num_splits=splits, ownership=own, check_placement=placement
    )
    check_ownership_reference(table, seq_lens, kv.shape[4], kv.shape[0], ref)
    assert torch.equal(own.errors, ref.errors) and torch.equal(own.first_bad, ref.first_bad)
    return own, out


@pytest.mark.parametrize("placement", td.CHECK_PLACEMENTS)
@pytest.mark.parametrize("splits", [1, 3])
def test_clean_run_is_bit_identical_with_check_on_and_off(splits, placement):
    kv, table, seq_lens, q, canaries, rids, grants = owned_case()
    own, checked = run_both(kv, table, seq_lens, q, canaries, rids, grants, splits, placement)
    assert own.failures() == []
    assert bool((own.first_bad == NO_BAD_PAGE).all())
    plain = td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=splits)
    assert torch.equal(checked, plain)
    torch.testing.assert_close(plain, reference(q, kv, 0, table, seq_lens), atol=2e-5, rtol=2e-5)


def corrupt(kind: str, table, canaries: CanaryTable, num_pages: int):
    """Apply one corruption to sequence 0 (70 positions: logical pages 0-4) or 3 (100
    positions: pages 0-6); returns (sequence, bits, first bad page)."""
    if kind == "foreign":
        page = int(table[0, 2])
        row = canaries.get(page)
        canaries.stamp([page], [type(row)(row.request_id_hash ^ 1, row.generation, row.page_index)])
        return 0, FOREIGN_REQUEST, 2
    if kind == "last_page":  # the last page, partly filled (positions 64-69)
        page = int(table[0, 4])
        row = canaries.get(page)
        canaries.stamp([page], [type(row)(row.request_id_hash ^ 1, row.generation, row.page_index)])
        return 0, FOREIGN_REQUEST, 4
    if kind == "stale":
        page = int(table[0, 2])
        row = canaries.get(page)
        canaries.stamp([page], [type(row)(row.request_id_hash, row.generation - 1, row.page_index)])
        return 0, STALE_GENERATION, 2
    if kind == "swapped":
        table[0, 1], table[0, 3] = int(table[0, 3]), int(table[0, 1])
        return 0, STALE_GENERATION | WRONG_INDEX, 1
    if kind == "out_of_pool_high":
        table[3, 5] = num_pages + 5
        return 3, OUT_OF_POOL, 5
    if kind == "out_of_pool_negative":
        table[3, 0] = -7
        return 3, OUT_OF_POOL, 0
    if kind == "never_stamped":
        spare = sorted(set(range(num_pages)) - set(table.flatten().tolist()))[0]
        table[0, 2] = spare
        return 0, FOREIGN_REQUEST | STALE_GENERATION | WRONG_INDEX, 2
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind, splits",
    [
        ("foreign", 3),
        ("last_page", 1),
        ("last_page", 3),
        ("stale", 1),
        ("swapped", 3),
        ("out_of_pool_high", 1),
        ("out_of_pool_negative", 3),
        ("never_stamped", 1),
    ],
)
@pytest.mark.parametrize("placement", td.CHECK_PLACEMENTS)
def test_each_mismatch_kind_is_flagged(kind, splits, placement):
    kv, table, seq_lens, q, canaries, rids, grants = owned_case()
    clean = reference(q, kv, 0, table, seq_lens)
    seq, bits, first = corrupt(kind, table, canaries, kv.shape[0])
    own, out = run_both(kv, table, seq_lens, q, canaries, rids, grants, splits, placement)
    assert own.failures() == [(seq, bits, first)]
    assert bool(torch.isfinite(out).all()), "a corrupt table still reads inside the pool"
    others = [b for b in range(len(rids)) if b != seq]
    torch.testing.assert_close(
        out[others], clean[others], atol=2e-5, rtol=2e-5
    )  # other sequences untouched
    with pytest.raises(Exception, match=rids[seq]):
        own.raise_if_bad(rids, table)


def test_swapped_generations_equal_is_a_wrong_index():
    """A swap inside one allocation (same generation on both pages) shows as a wrong index only."""
    kv, table, seq_lens, q, canaries, rids, grants = owned_case()
    grants[0] = [PageGrant(g.page, 5) for g in grants[0]]
    canaries.stamp([g.page for g in grants[0]], expected_canaries(rids[0], grants[0]))
    table[0, 1], table[0, 3] = int(table[0, 3]), int(table[0, 1])
    own, _ = run_both(kv, table, seq_lens, q, canaries, rids, grants)
    assert own.failures() == [(0, WRONG_INDEX, 1)]


@pytest.mark.parametrize("placement", td.CHECK_PLACEMENTS)
def test_pages_past_the_sequence_are_not_checked_and_longer_than_table_is(placement):
    kv, table, seq_lens, q, canaries, rids, grants = owned_case()
    table[1, 3] = kv.shape[0] + 100  # sequence 1 has 33 positions: 3 pages; column 3 is padding
    own, _ = run_both(kv, table, seq_lens, q, canaries, rids, grants, placement=placement)
    assert own.failures() == []
    seq_lens[2] = table.shape[1] * 16 + 1  # the empty sequence now claims more than its row holds
    own, _ = run_both(kv, table, seq_lens, q, canaries, rids, grants, placement=placement)
    assert own.failures() == [(2, OUT_OF_POOL | BEYOND_TABLE, 0)]  # its row is padding (-1)


def test_flags_accumulate_across_layers():
    kv, table, seq_lens, q, canaries, rids, grants = owned_case()
    corrupt("stale", table, canaries, kv.shape[0])
    own = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=2, ownership=own)
    corrupt("out_of_pool_high", table, canaries, kv.shape[0])
    table[0, 1] = -1
    td.paged_decode_attention(q, kv, 0, table, seq_lens, num_splits=2, ownership=own)
    assert own.failures() == [(0, STALE_GENERATION | OUT_OF_POOL, 1), (3, OUT_OF_POOL, 5)]
    own.reset()
    assert own.failures() == []


# --- checksums --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_checksum_equals_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(12, 2, 2, 2, 16, 64, generator=gen).to(dtype)
    kv.view(torch.uint8)[5] = 0xFF  # words with the high bit set (negative as int32)
    kv[6] = 0
    pages = [5, 0, 11, 6, 5, 3]
    assert torch.equal(tc.page_checksums(kv, pages), page_checksums(kv, pages))


@pytest.mark.parametrize("block, steps", [(512, 32), (2048, 4), (4096, 1), (32, 200)])
def test_checksum_launch_shape_changes_no_value(block, steps):
    """Words a step and steps a program shape the launch only (the running sums' weights
    follow them, and past 128 steps they are kept in int64): values equal the reference's."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randint(-(2**31), 2**31 - 1, (5, 9_000), generator=gen, dtype=torch.int64)
    words = big.to(torch.int32)
    got = tc.page_checksums(words, [4, 0, 2], block=block, steps=steps, num_warps=4)
    assert torch.equal(got, page_checksums(words, [4, 0, 2]))


def test_checksum_multi_chunk_pages_and_strided_pool():
    """Pages of several programs' chunks, in a pool that is a view (pages at a stride)."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randint(-(2**31), 2**31 - 1, (8, 40_000), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    view = big[::2]  # [4, 40000], page stride 80000 words
    assert torch.equal(tc.page_checksums(view, [3, 1, 0]), page_checksums(view, [3, 1, 0]))


def test_checksum_odd_page_bytes_and_empty_list():
    gen = torch.Generator().manual_seed(4)
    kv = torch.randint(0, 256, (5, 3, 7), generator=gen, dtype=torch.uint8)  # 21 bytes a page
    assert torch.equal(tc.page_checksums(kv, [4, 0, 2]), page_checksums(kv, [4, 0, 2]))
    assert tc.page_checksums(kv, []).numel() == 0


def test_checksum_changes_with_one_word():
    kv = torch.zeros(3, 1024, dtype=torch.int32)
    before = tc.page_checksums(kv, [1])
    kv[1, 700] = 1
    assert not torch.equal(tc.page_checksums(kv, [1]), before)
    assert torch.equal(tc.page_checksums(kv, [1]), page_checksums(kv, [1]))


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.integers(0, 150), min_size=1, max_size=3),
    page_size=st.sampled_from([16, 32]),
    splits=st.integers(1, 3),
    edits=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 9),
            st.sampled_from(["rid", "gen", "idx", "table"]),
            st.integers(-6, 60),
        ),
        max_size=4,
    ),
)
def test_random_corruptions_flag_as_the_reference_does(lens, page_size, splits, edits):
    kv, table, seq_lens, q, canaries, rids, grants = owned_case(
        seed=len(edits), page_size=page_size, lens=tuple(lens)
    )
    for b, j, what, value in edits:
        b, j = b % table.shape[0], j % table.shape[1]
        page = min(max(int(table[b, j]), 0), kv.shape[0] - 1)
        if what == "table":
            table[b, j] = value
        else:
            canaries.table[page, ["rid", "gen", "idx"].index(what)] += 1
    run_both(kv, table, seq_lens, q, canaries, rids, grants, splits)


@pytest.mark.parametrize("name", ["n128-w4-s2-p2-m256", "n256-w8-s3-p4-m256", "n64-w8-s1-p8-m512"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_every_tile_of_the_sweep_matches_reference(name, page_size):
    """The tunings the device sweep times change the tile (``block_n``) and the split
    heuristic: each gives the reference's output with splits of one, several and its own
    choice, on sequences shorter than a tile, not a multiple of it and several tiles
    long; with the check on a clean run is bit-identical and a foreign page is flagged as
    the torch reference flags it."""
    from kvferry.engine.kernels.tuning import DecodeTuning

    tuning = DecodeTuning.parse(name)
    lens = (tuning.block_n * 3 + 7, 5, 0, 2 * tuning.block_n)
    kv, table, seq_lens, q, canaries, rids, grants = owned_case(
        zlib.crc32(name.encode()) % 1000, page_size, lens
    )
    want = reference(q, kv, 0, table, seq_lens)
    plain = None
    for splits in (1, 3, None):
        got = td.paged_decode_attention(
            q,
            kv,
            0,
            table,
            seq_lens,
            num_splits=splits,
            tuning=tuning,
            out=torch.full_like(q, float("nan")),
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        plain = got if splits is None else plain
    own = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    checked = td.paged_decode_attention(q, kv, 0, table, seq_lens, tuning=tuning, ownership=own)
    assert own.failures() == [] and torch.equal(checked, plain)
    seq, bits, first = corrupt("foreign", table, canaries, kv.shape[0])
    own = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    ref = PageOwnership.for_requests(canaries, rids, grants, width=table.shape[1])
    td.paged_decode_attention(q, kv, 0, table, seq_lens, tuning=tuning, ownership=own)
    check_ownership_reference(table, seq_lens, page_size, kv.shape[0], ref)
    assert own.failures() == ref.failures() == [(seq, bits, first)]
