"""Page addresses from vLLM's own KV views (create_kv_cache_views), per layout."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
import torch

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
