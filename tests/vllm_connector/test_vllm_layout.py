"""Page addresses from vLLM's own KV views (create_kv_cache_views), per layout."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
import torch

from kvferry.cluster.vllm import reshape
from kvferry.cluster.vllm.layout import KVRegions, LayoutError


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_block_runs_cover_exactly_the_block(layout):
    kcc = h.kv_cache_config(8)
    caches = h.kv_caches(kcc, layout)
    regions = KVRegions.from_kv_caches(caches, 8, layout)
    assert len(regions.buffers) == 1  # every layer in one buffer: one registration
    views = {n: v.view(torch.uint8) if v.dtype != torch.uint8 else v for n, v in caches.items()}
    data = torch.randint(1, 256, (1, regions.block_bytes), dtype=torch.uint8)
    regions.write_block_bytes([3], data)
    for v in views.values():
        assert bool((v[3] != 0).all()), layout  # every byte of block 3, in every layer
        assert int(v[2].count_nonzero()) == 0 and int(v[4].count_nonzero()) == 0
    assert bool((regions.block_bytes_of([3]) == data).all())


def test_unsupported_layout_is_named():
    kcc = h.kv_cache_config(8)
    caches = h.kv_caches(kcc, "LBNHC")
    bad = {n: v.transpose(2, 3) for n, v in caches.items()}  # K|V not contiguous
    with pytest.raises(LayoutError, match="LBNHC"):
        KVRegions.from_kv_caches(bad, 8, "LBNHC")


# ------------------------------------------------------- blocks that only look alike
LAYERS, WIDTH, NB = 2, 4, 4
STALE = -5  # what the prefill's block held before the prompt: another request's KV


def _views(layout: str, heads: int, ratio: int, block: int = 16) -> dict[str, torch.Tensor]:
    """Layer views of one engine's KV (int16 rows of WIDTH), each scheduler block of
    ``block`` tokens in ``ratio`` kernel blocks, every row STALE at first."""
    kt, kb = block // ratio, NB * ratio
    page = heads * kt * WIDTH
    raw = torch.full((LAYERS * kb * page,), STALE, dtype=torch.int16)
    out = {}
    for layer in range(LAYERS):
        if layout == "HND":
            base, sb, sh, sn = layer * kb * page, page, kt * WIDTH, WIDTH
        else:  # BNHD: a kernel block holds every layer
            base, sb, sh, sn = layer * page, LAYERS * page, WIDTH, heads * WIDTH
        out[f"layer.{layer}"] = raw.as_strided((kb, heads, kt, WIDTH), (sb, sh, sn, 1), base)
    return out


def _row(views: dict[str, torch.Tensor], block: int, t: int, h: int, layer: int):
    v = list(views.values())[layer]
    kb, _, kt, _ = v.shape
    return v[block * (kb // NB) + t // kt, h, t % kt]


def _same_blocks_by_size(a: KVRegions, b: KVRegions) -> bool:
    """BROKEN: blocks alike by layout, runs, block size, heads and row alone."""

    def rows(r: KVRegions) -> list[tuple[int, int, int]]:
        return [(x.block_tokens, x.heads, x.row_bytes) for x in r.layers]

    return a.layout == b.layout and a.signature() == b.signature() and rows(a) == rows(b)


@pytest.mark.parametrize("layout, heads", [("HND", 2), ("BNHD", 1)])
@pytest.mark.parametrize("broken", [False, True], ids=["by-geometry", "broken-by-size"])
def test_blocks_split_into_other_kernel_blocks_move_as_rows(monkeypatch, layout, heads, broken):
    """One TP size and block size (16) on both sides, the prefill's blocks one kernel
    block of 16 tokens, the decode's two of 8 (another attention backend): the same runs
    and block size, the rows in another order. They move as rows, and the decode reads
    every row of the prompt's. Broken mode: taken for alike by block size, moved whole;
    the decode reads other rows, past the prompt's 5 tokens the block's stale ones."""
    if broken:
        monkeypatch.setattr(reshape, "same_blocks", _same_blocks_by_size)
    tokens, src_block, dst_block = 5, 2, 1
    pre, dec = _views(layout, heads, ratio=1), _views(layout, heads, ratio=2)
    for layer in range(LAYERS):
        for h_ in range(heads):
            for t in range(tokens):
                _row(pre, src_block, t, h_, layer)[:] = 100 * layer + 10 * h_ + t
    theirs = KVRegions.from_kv_caches(pre, NB, layout)
    mine = KVRegions.from_kv_caches(dec, NB, layout)
    mine_wire = KVRegions.from_wire(mine.to_wire())
    if reshape.whole_blocks(theirs, mine_wire):  # writer_host's choice: whole blocks
        assert broken and not reshape.turned_pair(theirs, mine_wire)
        for i in range(len(theirs.buffers)):
            for so, do, n in theirs.triples(i, [src_block], mine_wire, [dst_block]).tolist():
                mine.buffers[i].tensor[do : do + n] = theirs.buffers[i].tensor[so : so + n]
    else:  # rows, planned once (plan_pair), as both sides plan them
        assert not broken
        runs = reshape.plan_pair(theirs, mine, range(heads), 0, 0, [src_block], [dst_block], 5)
        for src, dst, rows in runs.batches(1 << 20):
            for so, do, n in rows.tolist():
                mine.buffers[dst].tensor[do : do + n] = theirs.buffers[src].tensor[so : so + n]
    wrong = [
        (layer, h_, t)
        for layer in range(LAYERS)
        for h_ in range(heads)
        for t in range(tokens)
        if int(_row(dec, dst_block, t, h_, layer)[0]) != 100 * layer + 10 * h_ + t
    ]
    assert bool(wrong) is broken, wrong
