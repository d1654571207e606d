"""A vLLM block's checksum read in place (``reshape.block_checksums``) is the page checksum
of the block's bytes gathered (``page_checksums(regions.block_bytes_of(...))``), for every
layout, buffer split, row width and block list; and a checksum that puts the runs
together in another order is caught."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.reshape import block_checksums
from kvferry.engine.integrity import page_checksums


def caches(
    layout: str,
    blocks: int,
    block: int,
    heads: int,
    width: int,
    dtype: torch.dtype,
    layers: int,
    split: bool,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Per layer a ``[blocks, heads, block, width]`` view, random bytes: over one raw
    buffer, or (``split``) one buffer per layer, as an engine allocating layers apart."""
    page = heads * block * width
    n = 1 if split else layers
    gen = torch.Generator().manual_seed(seed)
    raws = [
        torch.randint(
            0,
            256,
            ((n * blocks * page) * torch.tensor([], dtype=dtype).element_size(),),
            generator=gen,
            dtype=torch.uint8,
        ).view(dtype)
        for _ in range(layers if split else 1)
    ]
    out = {}
    for layer in range(layers):
        raw = raws[layer] if split else raws[0]
        at = 0 if split else layer
        if layout == "HND":
            base, sb, sh, sn = at * blocks * page, page, block * width, width
        elif layout == "NHD":
            base, sb, sh, sn = at * blocks * page, page, width, heads * width
        else:  # BNHD: a block holds every layer of its buffer
            base, sb, sh, sn = at * page, n * page, width, heads * width
        out[f"layer.{layer}"] = raw.as_strided((blocks, heads, block, width), (sb, sh, sn, 1), base)
    return out


def gathered(regions: KVRegions, blocks: list[int]) -> np.ndarray:
    if not blocks:
        return np.zeros(0, dtype=np.int64)
    return page_checksums(regions.block_bytes_of(blocks), list(range(len(blocks)))).numpy()


@settings(max_examples=120, deadline=None)
@given(
    layout=st.sampled_from(["HND", "NHD", "BNHD"]),
    block=st.sampled_from([1, 2, 16]),
    heads=st.integers(1, 3),
    width=st.integers(1, 5),
    dtype=st.sampled_from([torch.float16, torch.uint8, torch.float32]),
    layers=st.integers(1, 3),
    split=st.booleans(),
    seed=st.integers(0, 1 << 16),
    pick=st.lists(st.integers(0, 7), min_size=0, max_size=12),
)
def test_property_block_checksums_read_in_place_equal_the_gathered_ones(
    layout, block, heads, width, dtype, layers, split, seed, pick
):
    regions = KVRegions.from_kv_caches(
        caches(layout, 8, block, heads, width, dtype, layers, split, seed), 8, layout
    )
    assert np.array_equal(block_checksums(regions, pick), gathered(regions, pick))


def test_a_flipped_byte_changes_its_blocks_checksum_only():
    regions = KVRegions.from_kv_caches(
        caches("NHD", 8, 16, 2, 8, torch.float16, 2, True, 1), 8, "NHD"
    )
    before = block_checksums(regions, list(range(8)))
    offset, _ = regions.buffers[1].block_runs([5])[0]
    regions.buffers[1].tensor[int(offset) + 3] ^= 0x10
    after = block_checksums(regions, list(range(8)))
    assert np.flatnonzero(before != after).tolist() == [5]


def test_broken_mode_runs_put_together_in_another_order_is_caught():
    """Broken mode: the buffers' runs put together last buffer first (each buffer's
    bytes right, their order in the block wrong): the comparison above catches it."""
    regions = KVRegions.from_kv_caches(
        caches("HND", 8, 16, 2, 8, torch.float16, 3, True, 2), 8, "HND"
    )
    assert len(regions.buffers) == 3
    blocks = [3, 1, 6]
    assert np.array_equal(block_checksums(regions, blocks), gathered(regions, blocks))
    backwards = replace(regions, buffers=regions.buffers[::-1])
    assert not np.array_equal(block_checksums(backwards, blocks), gathered(regions, blocks))
