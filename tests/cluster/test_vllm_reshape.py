"""Runs between unlike vLLM engines (cluster/vllm/reshape.py), on CPU views laid out as
vLLM 0.33 lays them ([blocks, heads, tokens, K|V] per layer over one raw buffer): every
(TP, block size, layout) pair moves exactly the rows it must, and the owner's region
checksums of what landed equal the writer's of its source."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.reshape import (
    EngineShape,
    owners_of,
    pairs,
    part_ranges,
    plan_pair,
    region_checksums,
    source_blocks,
    writers_of,
)

LAYERS, HEADS, ROW = 2, 4, 16  # K|V row: 2 x head size 4 x fp16


def views(
    layout: str, blocks: int, block: int, heads: int, ratio: int = 1
) -> dict[str, torch.Tensor]:
    """Per layer a ``[blocks * ratio, heads, block // ratio, ROW // 2]`` fp16 view over one
    raw buffer: ``HND``/``NHD`` layer-outermost, ``BNHD`` block-outermost (cross-layer)."""
    kt = block // ratio
    kb = blocks * ratio
    width = ROW // 2
    page = heads * kt * width  # elements of one kernel block of one layer
    raw = torch.zeros(LAYERS * kb * page, dtype=torch.float16)
    out = {}
    for layer in range(LAYERS):
        if layout == "HND":
            base, sb, sh, sn = layer * kb * page, page, kt * width, width
        elif layout == "NHD":
            base, sb, sh, sn = layer * kb * page, page, width, heads * width
        else:  # BNHD: a kernel block holds every layer
            base, sb, sh, sn = layer * page, LAYERS * page, width, heads * width
        out[f"layer.{layer}"] = raw.as_strided((kb, heads, kt, width), (sb, sh, sn, 1), base)
    return out


_BLOCKS = 12


def expected_row(seed: int, layer: int, head: int, t: int, width: int) -> torch.Tensor:
    return torch.arange(width, dtype=torch.float16) + float(
        (seed * 7 + layer * 131 + head * 17 + t * 3) % 1000
    )


def copy_runs(src: KVRegions, dst: KVRegions, plan) -> None:
    for (sbuf, dbuf), (so, do, n) in zip(
        zip(plan.src_buffer, plan.dst_buffer, strict=True), plan.runs, strict=True
    ):
        s, d = src.buffers[int(sbuf)].tensor, dst.buffers[int(dbuf)].tensor
        d[int(do) : int(do) + int(n)] = s[int(so) : int(so) + int(n)]


def read_row(caches, blocks, first, t, h, layer) -> torch.Tensor:
    v = list(caches.values())[layer]
    kb, _, kt, _ = v.shape
    r = kb // _BLOCKS
    p = kt * r
    b = blocks[(t - first) // p]
    return v[b * r + (t % p) // kt, h, t % kt]


def engines(
    pre: EngineShape,
    dec: EngineShape,
    side_p: tuple[str, int],
    side_d: tuple[str, int],
    src_blocks: list[int],
    tokens: int,
    seed: int,
    ratio: int = 1,
):
    """Both engines' workers, each side a (layout, block size): the prefill's caches hold
    ``expected_row`` of every global head they hold in ``src_blocks``, the decode's are
    zeros; (prefill caches, decode caches, prefill regions, decode regions) by rank."""
    caches_p, caches_d = {}, {}
    for p in range(pre.tp):
        lo, hi = pre.heads_of(p)
        caches_p[p] = views(side_p[0], _BLOCKS, side_p[1], hi - lo, ratio)
        for li in range(LAYERS):
            for t in range(tokens):
                for h in range(hi - lo):
                    read_row(caches_p[p], src_blocks, 0, t, h, li)[:] = expected_row(
                        seed, li, lo + h, t, ROW // 2
                    )
    for d in range(dec.tp):
        lo, hi = dec.heads_of(d)
        caches_d[d] = views(side_d[0], _BLOCKS, side_d[1], hi - lo, ratio)
    regions_p = {p: KVRegions.from_kv_caches(c, _BLOCKS, side_p[0]) for p, c in caches_p.items()}
    regions_d = {d: KVRegions.from_kv_caches(c, _BLOCKS, side_d[0]) for d, c in caches_d.items()}
    return caches_p, caches_d, regions_p, regions_d


SHAPES = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (4, 4)]


@pytest.mark.parametrize(
    "tp_p,tp_d,heads,bs_p,bs_d,lay_p,lay_d",
    [
        (1, 1, 4, 16, 16, "NHD", "HND"),
        (1, 1, 4, 16, 32, "HND", "HND"),
        (1, 1, 4, 32, 16, "NHD", "NHD"),
        (2, 1, 4, 16, 16, "HND", "HND"),
        (1, 2, 4, 16, 64, "HND", "NHD"),
        (2, 4, 4, 64, 16, "NHD", "BNHD"),
        (4, 2, 2, 16, 32, "BNHD", "HND"),  # replicated GQA at the prefill
        (1, 4, 2, 32, 16, "HND", "NHD"),  # replicated GQA at the decode
    ],
)
def test_every_row_lands_where_the_decode_reads_it(tp_p, tp_d, heads, bs_p, bs_d, lay_p, lay_d):
    tokens, seed = 70, 5
    pre, dec = EngineShape(heads, tp_p), EngineShape(heads, tp_d)
    src_blocks = list(range(11, 11 - (-(-tokens // bs_p)), -1))  # any order of blocks
    dst_blocks = [3, 0, 7, 9, 1][: -(-tokens // bs_d)]
    _, caches_d, regions_p, regions_d = engines(
        pre, dec, (lay_p, bs_p), (lay_d, bs_d), src_blocks, tokens, seed
    )
    for (p, d), hs in pairs(pre, dec).items():
        plan = plan_pair(
            regions_p[p],
            regions_d[d],
            hs,
            pre.heads_of(p)[0],
            dec.heads_of(d)[0],
            src_blocks,
            dst_blocks,
            tokens,
        )
        assert plan.bytes == len(hs) * tokens * LAYERS * ROW
        copy_runs(regions_p[p], regions_d[d], plan)
        n = len(dst_blocks)
        assert np.array_equal(
            region_checksums(regions_p[p], plan, 0, n), region_checksums(regions_d[d], plan, 1, n)
        )
    for d in range(tp_d):
        lo, hi = dec.heads_of(d)
        for li in range(LAYERS):
            for t in range(tokens):
                for h in range(hi - lo):
                    got = read_row(caches_d[d], dst_blocks, 0, t, h, li)
                    assert torch.equal(got, expected_row(seed, li, lo + h, t, ROW // 2)), (
                        d,
                        li,
                        t,
                        h,
                    )


def test_every_decode_head_has_one_writer_and_every_prefill_rank_a_role():
    for tp_p, tp_d in itertools.product((1, 2, 4), repeat=2):
        for heads in (1, 2, 4, 8):
            pre, dec = EngineShape(heads, tp_p), EngineShape(heads, tp_d)
            got = pairs(pre, dec)
            for d in range(tp_d):
                lo, hi = dec.heads_of(d)
                written = sorted(h for (_, o), hs in got.items() if o == d for h in hs)
                assert written == list(range(lo, hi))
                assert writers_of(pre, dec, d)
            for p in range(tp_p):
                lo, hi = pre.heads_of(p)
                for d in owners_of(pre, dec, p):
                    assert set(got[(p, d)]) <= set(range(lo, hi))


def test_a_suffix_plan_skips_the_tokens_the_decode_holds():
    pre, dec = EngineShape(4, 1), EngineShape(4, 1)
    rp = KVRegions.from_kv_caches(views("HND", _BLOCKS, 16, 4), _BLOCKS, "HND")
    rd = KVRegions.from_kv_caches(views("NHD", _BLOCKS, 32, 4), _BLOCKS, "NHD")
    whole = plan_pair(rp, rd, [0, 1, 2, 3], 0, 0, list(range(7)), [0, 1, 2, 3], 100)
    tail = plan_pair(rp, rd, [0, 1, 2, 3], 0, 0, list(range(7)), [2, 3], 100)
    assert tail.bytes == (100 - 64) * 4 * LAYERS * ROW
    assert whole.bytes == 100 * 4 * LAYERS * ROW
    assert set(tail.block.tolist()) == {0, 1}
    assert pairs(pre, dec) == {(0, 0): (0, 1, 2, 3)}


def test_a_torn_row_is_caught_in_its_block_only():
    rp = KVRegions.from_kv_caches(views("NHD", _BLOCKS, 16, 4), _BLOCKS, "NHD")
    rd = KVRegions.from_kv_caches(views("HND", _BLOCKS, 32, 4), _BLOCKS, "HND")
    g = torch.Generator().manual_seed(1)
    rp.buffers[0].tensor[:] = torch.randint(
        0, 256, rp.buffers[0].tensor.shape, generator=g, dtype=torch.uint8
    )
    plan = plan_pair(rp, rd, [1, 2], 0, 0, list(range(6)), [4, 5, 6], 90)
    copy_runs(rp, rd, plan)
    want = region_checksums(rp, plan, 0, 3)
    assert np.array_equal(region_checksums(rd, plan, 1, 3), want)
    _so, do, _n = plan.runs[len(plan.runs) // 2]
    rd.buffers[0].tensor[int(do) + 3] ^= 0x40
    got = region_checksums(rd, plan, 1, 3)
    assert (got != want).sum() == 1 and got[plan.block[len(plan.runs) // 2]] != want[
        plan.block[len(plan.runs) // 2]
    ]


def test_a_broken_planner_that_ignores_the_block_size_is_caught():
    """Broken mode: the decode's rows addressed with the prefill's block size."""
    from dataclasses import replace

    rp = KVRegions.from_kv_caches(views("HND", _BLOCKS, 16, 4), _BLOCKS, "HND")
    rd = KVRegions.from_kv_caches(views("HND", _BLOCKS, 32, 4), _BLOCKS, "HND")
    lying = replace(rd, layers=[replace(r, kernel_tokens=16) for r in rd.layers])
    rp.buffers[0].tensor[:] = 7
    plan = plan_pair(rp, lying, [0, 1, 2, 3], 0, 0, list(range(6)), [0, 1, 2], 80)
    copy_runs(rp, rd, plan)
    right = plan_pair(rp, rd, [0, 1, 2, 3], 0, 0, list(range(6)), [0, 1, 2], 80)
    assert not np.array_equal(region_checksums(rp, right, 0, 3), region_checksums(rd, right, 1, 3))


@settings(max_examples=25, deadline=None)
@given(
    tp_p=st.sampled_from([1, 2, 4]),
    tp_d=st.sampled_from([1, 2, 4]),
    heads=st.sampled_from([1, 2, 4]),
    bs_p=st.sampled_from([16, 32, 64]),
    bs_d=st.sampled_from([16, 32, 64]),
    lay_p=st.sampled_from(["HND", "NHD", "BNHD"]),
    lay_d=st.sampled_from(["HND", "NHD", "BNHD"]),
    ratio_d=st.sampled_from([1, 2]),
    tokens=st.integers(1, 150),
    skip=st.integers(0, 3),
)
def test_property_runs_cover_each_owner_row_once(
    tp_p, tp_d, heads, bs_p, bs_d, lay_p, lay_d, ratio_d, tokens, skip
):
    """Every (layer, head, token) row of each owner's planned blocks is written exactly
    once, by one writer, and nothing outside them."""
    pre, dec = EngineShape(heads, tp_p), EngineShape(heads, tp_d)
    need_d = -(-tokens // bs_d)
    skip = min(skip, need_d - 1)
    src_blocks = list(range(-(-tokens // bs_p)))
    dst_blocks = list(range(skip, need_d))[::-1]
    for d in range(tp_d):
        lo, hi = dec.heads_of(d)
        rd = KVRegions.from_kv_caches(views(lay_d, 64, bs_d, hi - lo, ratio_d), 64, lay_d)
        hits = np.zeros(rd.buffers[0].nbytes, dtype=np.int64)
        for p in writers_of(pre, dec, d):
            plo, phi = pre.heads_of(p)
            rp = KVRegions.from_kv_caches(views(lay_p, 64, bs_p, phi - plo), 64, lay_p)
            plan = plan_pair(
                rp, rd, pairs(pre, dec)[(p, d)], plo, lo, src_blocks, dst_blocks, tokens
            )
            assert plan.block.min() >= 0 and plan.block.max() < len(dst_blocks)
            for do, n in plan.runs[:, 1:].tolist():
                hits[do : do + n] += 1
        assert hits.max() == 1
        assert hits.sum() == (tokens - skip * bs_d) * (hi - lo) * LAYERS * ROW


@settings(max_examples=60, deadline=None)
@given(
    bs_p=st.sampled_from([16, 32, 64]),
    bs_d=st.sampled_from([16, 32, 64]),
    lay_p=st.sampled_from(["HND", "NHD", "BNHD"]),
    lay_d=st.sampled_from(["HND", "NHD"]),
    tokens=st.integers(1, 300),
    skip=st.integers(0, 3),
    cut=st.data(),
)
def test_property_a_parts_source_blocks_are_the_ones_its_runs_read(
    bs_p, bs_d, lay_p, lay_d, tokens, skip, cut
):
    """``source_blocks`` of decode blocks [lo, hi) names exactly the writer's blocks the
    part's runs read from (the writer checks those against vLLM's hand-over before it
    posts the part)."""
    need_d = -(-tokens // bs_d)
    skip = min(skip, need_d - 1)
    src_blocks = list(range(-(-tokens // bs_p)))[::-1]
    dst_blocks = list(range(skip, need_d))
    rp = KVRegions.from_kv_caches(views(lay_p, 64, bs_p, 2), 64, lay_p)
    rd = KVRegions.from_kv_caches(views(lay_d, 64, bs_d, 2), 64, lay_d)
    plan = plan_pair(rp, rd, [0, 1], 0, 0, src_blocks, dst_blocks, tokens)
    lo = cut.draw(st.integers(0, len(dst_blocks) - 1))
    hi = cut.draw(st.integers(lo + 1, len(dst_blocks)))
    keep = np.zeros(len(dst_blocks), dtype=bool)
    keep[lo:hi] = True
    part = plan.within(keep)
    a, b = source_blocks(rp, rd, len(dst_blocks), tokens, lo, hi)
    runs = rp.buffers[0].block_runs(list(range(64))).reshape(64, -1, 2)
    read = set()
    for so, n in part.runs[:, [0, 2]].tolist():
        inside = (runs[:, :, 0] <= so) & (so + n <= runs[:, :, 0] + runs[:, :, 1])
        read.add(int(np.flatnonzero(inside.any(axis=1))[0]))
    assert read == set(src_blocks[a:b])


def test_engines_of_another_model_are_refused_with_both_sides_named():
    from kvferry.cluster.vllm.layout import LayoutError

    with pytest.raises(LayoutError, match="prefill engine holds 4 KV heads, the decode 8"):
        pairs(EngineShape(4, 2), EngineShape(8, 2))
    rp = KVRegions.from_kv_caches(views("HND", _BLOCKS, 16, 4), _BLOCKS, "HND")
    other = {
        k: torch.zeros(v.shape[:-1] + (v.shape[-1] * 2,), dtype=v.dtype)
        for k, v in views("HND", _BLOCKS, 16, 4).items()
    }
    rd = KVRegions.from_kv_caches(other, _BLOCKS, "HND")
    with pytest.raises(LayoutError, match="row of 16 bytes at the prefill, 32 at the decode"):
        plan_pair(rp, rd, [0], 0, 0, list(range(6)), [0], 10)
    fewer = KVRegions.from_kv_caches(
        dict(list(views("HND", _BLOCKS, 16, 4).items())[:1]), _BLOCKS, "HND"
    )
    with pytest.raises(LayoutError, match="2 KV layers, the decode 1"):
        plan_pair(rp, fewer, [0], 0, 0, list(range(6)), [0], 10)


@pytest.mark.parametrize("lengths,max_bytes", [([5, 5, 5], 8), ([16] * 7, 40), ([3, 9, 1, 9], 9)])
def test_batches_never_exceed_their_bound_and_keep_every_run(lengths, max_bytes):
    """A batch carries at most ``max_bytes`` (a run longer than that alone), every run
    once, in plan order; the bucketing by cumulative bytes it replaced put 10 bytes in
    a batch of 8 for runs of 5, 5, 5."""
    from kvferry.cluster.vllm.reshape import PairRuns

    n = len(lengths)
    ln = np.array(lengths, dtype=np.int64)
    runs = np.stack([np.cumsum(ln) - ln, np.cumsum(ln) - ln, ln], axis=1)
    zero = np.zeros(n, dtype=np.int64)
    plan = PairRuns(runs, zero, zero, zero, 4)
    out = plan.batches(max_bytes)
    assert all(int(t[:, 2].sum()) <= max(max_bytes, int(t[:, 2].max())) for _, _, t in out)
    assert all(int(t[:, 2].sum()) <= max_bytes or len(t) == 1 for _, _, t in out)
    assert np.array_equal(np.concatenate([t for _, _, t in out]), runs)


@pytest.mark.parametrize("lay_p, lay_d", [("NHD", "HND"), ("HND", "NHD")])
@pytest.mark.parametrize("ratio, piece_bytes", [(1, 512 << 10), (2, 512 << 10), (2, 1)])
def test_a_layout_change_alone_moves_whole_blocks_and_the_owner_turns_them(
    lay_p, lay_d, ratio, piece_bytes, monkeypatch
):
    """Same TP, blocks and heads, layouts HND against NHD: whole blocks move as they lie
    at the writer (the writer's page checksums equal the owner's of what landed), and the
    owner's turn puts every row where its layout reads it. Broken mode: an owner that
    never turns them reads other rows."""
    from kvferry.cluster.vllm.reshape import same_blocks, turn_blocks, turnable_blocks, whole_blocks
    from kvferry.engine import pool

    monkeypatch.setattr(pool, "RELAYOUT_PIECE_BYTES", piece_bytes)  # 1: a span per piece

    tokens, seed, block = 70, 3, 16
    src_blocks, dst_blocks = [9, 2, 5, 0, 7], [4, 10, 1, 6, 3]
    caches_p = views(lay_p, _BLOCKS, block, HEADS, ratio)
    caches_d = views(lay_d, _BLOCKS, block, HEADS, ratio)
    for li in range(LAYERS):
        for t in range(tokens):
            for h in range(HEADS):
                read_row(caches_p, src_blocks, 0, t, h, li)[:] = expected_row(
                    seed, li, h, t, ROW // 2
                )
    src = KVRegions.from_kv_caches(caches_p, _BLOCKS, lay_p)
    dst = KVRegions.from_kv_caches(caches_d, _BLOCKS, lay_d)
    assert not same_blocks(src, dst) and turnable_blocks(src, dst) and turnable_blocks(dst, src)
    assert whole_blocks(src, dst)
    for i in range(len(src.buffers)):
        for so, do, n in src.triples(i, src_blocks, dst, dst_blocks).tolist():
            dst.buffers[i].tensor[do : do + n] = src.buffers[i].tensor[so : so + n]
    assert torch.equal(src.block_bytes_of(src_blocks), dst.block_bytes_of(dst_blocks))

    def reads_right() -> bool:
        return all(
            torch.equal(
                read_row(caches_d, dst_blocks, 0, t, h, li), expected_row(seed, li, h, t, ROW // 2)
            )
            for li in range(LAYERS)
            for t in range(tokens)
            for h in range(HEADS)
        )

    assert not reads_right()  # the broken mode: landed, never turned
    untouched = dst.block_bytes_of([8]).clone()
    turn_blocks(dst, src, dst_blocks)
    assert reads_right()
    assert torch.equal(dst.block_bytes_of([8]), untouched)  # no other block moved


def test_layouts_that_differ_in_more_than_the_order_inside_a_layer_are_not_turned():
    from kvferry.cluster.vllm.reshape import turnable_blocks

    nhd = KVRegions.from_kv_caches(views("NHD", _BLOCKS, 16, HEADS), _BLOCKS, "NHD")
    cross = KVRegions.from_kv_caches(views("BNHD", _BLOCKS, 16, HEADS), _BLOCKS, "BNHD")
    bigger = KVRegions.from_kv_caches(views("HND", _BLOCKS, 32, HEADS), _BLOCKS, "HND")
    fewer = KVRegions.from_kv_caches(views("HND", _BLOCKS, 16, 2), _BLOCKS, "HND")
    assert not any(turnable_blocks(nhd, other) for other in (cross, bigger, fewer))


FAN_IN = [
    (2, 1, "NHD", "NHD"),
    (4, 2, "NHD", "NHD"),
    (2, 1, "HND", "NHD"),
    (4, 1, "HND", "NHD"),
    (2, 1, "NHD", "HND"),
    (4, 2, "HND", "HND"),
]


@pytest.mark.parametrize("tp_p, tp_d, lay_p, lay_d", FAN_IN)
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("bs_d, held", [(16, 0), (32, 0), (64, 0), (32, 1)])
def test_a_fan_in_goes_by_slots_and_the_owner_turns_it(tp_p, tp_d, lay_p, lay_d, ratio, bs_d, held):
    """Prefill TP a multiple of the decode's, decode blocks as large as the prefill's or a
    whole number of them: each writer moves its blocks' spans whole into its slots of the
    owner's (one run per layer, kernel block of the prefill and block; none for a kernel
    block past the prompt), the region checksums of what landed equal the writers', and
    the owner's turn puts every row where its layout reads it; ``held``: the owner holds
    the prompt's first blocks already and plans the rest. Broken mode: an owner that never
    turns reads other rows (but heads-major on both sides with blocks alike, where the
    slots are its order)."""
    from kvferry.cluster.vllm.reshape import plan_slots, slot_of, turn_blocks

    tokens, seed, block = 70, 3, 16
    src_blocks = [9, 2, 5, 0, 7]
    need = -(-tokens // bs_d)
    dst_blocks = [4, 10, 1, 6, 3][held:need]
    first = held * bs_d
    pre, dec = EngineShape(HEADS, tp_p), EngineShape(HEADS, tp_d)
    _, caches_d, regions_p, regions_d = engines(
        pre, dec, (lay_p, block), (lay_d, bs_d), src_blocks, tokens, seed, ratio
    )
    k = tp_p // tp_d
    q = bs_d // block
    for (p, d), _heads in pairs(pre, dec).items():
        slot = slot_of(regions_p[p], regions_d[d], pre, dec, p, d)
        assert slot == p % k
        plan = plan_slots(regions_p[p], regions_d[d], slot, src_blocks, dst_blocks, tokens)
        spans = -(-(tokens - first) // (block // ratio))  # the prefill kernel blocks it reads
        assert len(plan.runs) <= LAYERS * spans
        copy_runs(regions_p[p], regions_d[d], plan)
        n = len(dst_blocks)
        assert np.array_equal(
            region_checksums(regions_p[p], plan, 0, n), region_checksums(regions_d[d], plan, 1, n)
        )

    def reads_right(d: int) -> bool:
        lo, hi = dec.heads_of(d)
        return all(
            torch.equal(
                read_row(caches_d[d], dst_blocks, first, t, h, li),
                expected_row(seed, li, lo + h, t, ROW // 2),
            )
            for li in range(LAYERS)
            for t in range(first, tokens)
            for h in range(hi - lo)
        )

    for d in range(tp_d):
        # the broken mode: never turned (heads-major both sides land in order when the
        # decode's blocks hold one of the prefill's or each writer holds one head)
        assert reads_right(d) == (lay_p == lay_d == "HND" and (q == 1 or HEADS // tp_p == 1))
        untouched = regions_d[d].block_bytes_of([8]).clone()
        turn_blocks(regions_d[d], regions_p[d * k], dst_blocks, writers=k)
        assert reads_right(d)
        assert torch.equal(regions_d[d].block_bytes_of([8]), untouched)  # no other block


def test_what_does_not_go_by_slots():
    """A fan-out, one TP size, heads held by two prefill workers, two block sizes and a
    cross-layer layout take the rows (or the whole blocks) as before."""
    from kvferry.cluster.vllm.reshape import slot_of

    def regions(layout: str, heads: int, block: int = 16) -> KVRegions:
        return KVRegions.from_kv_caches(views(layout, _BLOCKS, block, heads), _BLOCKS, layout)

    two, four = EngineShape(HEADS, 2), EngineShape(HEADS, 4)
    assert slot_of(regions("NHD", 2), regions("NHD", 4), two, EngineShape(HEADS, 1), 1, 0) == 1
    assert slot_of(regions("NHD", 4), regions("NHD", 2), EngineShape(HEADS, 1), two, 0, 0) is None
    assert slot_of(regions("NHD", 2), regions("HND", 2), two, two, 0, 0) is None
    assert slot_of(regions("NHD", 1), regions("NHD", 2), four, two, 1, 0) == 1
    assert slot_of(regions("NHD", 1), regions("NHD", 2), four, two, 2, 0) is None  # not its
    gqa = EngineShape(2, 4)  # two heads over four workers: each held twice
    assert slot_of(regions("NHD", 1), regions("NHD", 2), gqa, EngineShape(2, 1), 0, 0) is None
    # the decode's blocks smaller than the prefill's: rows
    assert (
        slot_of(regions("NHD", 2, 32), regions("NHD", 4), two, EngineShape(HEADS, 1), 0, 0) is None
    )
    # larger by a whole number of the prefill's: slots; by another number: rows
    assert slot_of(regions("NHD", 2), regions("NHD", 4, 64), two, EngineShape(HEADS, 1), 1, 0) == 1
    assert (
        slot_of(regions("NHD", 2, 32), regions("NHD", 4, 48), two, EngineShape(HEADS, 1), 0, 0)
        is None
    )
    assert slot_of(regions("BNHD", 2), regions("NHD", 4), two, EngineShape(HEADS, 1), 0, 0) is None


def test_a_decode_worker_takes_slots_from_all_its_writers_or_from_none():
    """One turn covers every slot of a span: writers that would land some in slots and
    some as rows, or two in one slot, are refused (the owner fails the load before any
    plan goes out). Broken mode: a rule that takes any slot at all accepts the mix."""
    from kvferry.cluster.vllm.reshape import slots_agree

    assert slots_agree([0, 1]) and slots_agree([None, None]) and slots_agree([1, 0, 3, 2])
    assert not slots_agree([0, None]) and not slots_agree([1, 1])

    def broken(slots) -> bool:
        return any(s is not None for s in slots) or all(s is None for s in slots)

    assert broken([0, None])  # the mix the real rule refuses


def test_writers_of_one_span_in_unlike_layouts_are_refused():
    """Two writers of one decode worker, one heads-major and one token-major (workers of
    one engine never differ; a handshake that lies could), each get a slot and
    slots_agree accepts them, but their places in the span would overlap: the owner's
    turn orders every slot by one geometry. slotted_alike refuses them, and accepts
    writers alike. Broken mode: without it, the two plans write the same bytes."""
    from kvferry.cluster.vllm.reshape import plan_slots, slot_of, slots_agree, slotted_alike

    pre, dec = EngineShape(4, 2), EngineShape(4, 1)
    heads_major = KVRegions.from_kv_caches(views("HND", 8, 4, 2), 8, "HND")
    token_major = KVRegions.from_kv_caches(views("NHD", 8, 4, 2), 8, "NHD")
    decode = KVRegions.from_kv_caches(views("NHD", 8, 8, 4), 8, "NHD")  # q = 2
    s0 = slot_of(heads_major, decode, pre, dec, 0, 0)
    s1 = slot_of(token_major, decode, pre, dec, 1, 0)
    assert (s0, s1) == (0, 1) and slots_agree([s0, s1])
    assert not slotted_alike([heads_major, token_major])
    assert slotted_alike([token_major, KVRegions.from_kv_caches(views("NHD", 8, 4, 2), 8, "NHD")])
    assert s0 is not None and s1 is not None
    spans = [
        {
            b
            for _, at, n in plan_slots(regions, decode, slot, [0, 1], [5], 8).runs
            for b in range(int(at), int(at + n))
        }
        for regions, slot in ((heads_major, s0), (token_major, s1))
    ]
    assert spans[0] & spans[1]  # what the refusal prevents


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 1 << 16),
    st.integers(-1, 1 << 26),
)
def test_parts_cover_the_plan_in_order_each_within_its_bound(blocks, block_bytes, part_bytes):
    """Every planned block is in exactly one part, in plan order; a part holds whole
    blocks, at most ``part_bytes`` of them unless one block is more, and no part but the
    last is short; ``part_bytes`` <= 0 is one part."""
    ranges = part_ranges(blocks, blocks * block_bytes, part_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [hi - lo for lo, hi in ranges]
    step = blocks if part_bytes <= 0 else max(1, part_bytes // block_bytes)
    assert all(0 < n <= step for n in sizes) and all(n == step for n in sizes[:-1])
    if part_bytes <= 0:
        assert ranges == [(0, blocks)]
