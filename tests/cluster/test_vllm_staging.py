"""A prefill worker's staging memory (cluster/vllm/staging.py): rows scattered at the
source and gathered into staging land over the real transfer engine exactly as posted
as they lie, in fewer pieces; a slot is taken until it is given back (the writer's rule
for giving it back: tests/vllm_connector/test_writer_staging.py). The torch gather (the
CUDA staging's) is held to the native one in tests/transfer/test_local_copy.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.reshape import plan_pair, region_checksums
from kvferry.cluster.vllm.staging import Staging, pieces, worth_staging
from kvferry.transfer import TransferConfig, TransferEngine

BLOCKS, BLOCK, HEADS, WIDTH, LAYERS = 8, 16, 4, 64, 2  # fp16 K|V rows of 128 bytes


def caches(heads: int, layout: str, seed: int | None) -> dict[str, torch.Tensor]:
    page = heads * BLOCK * WIDTH
    raw = torch.zeros(LAYERS * BLOCKS * page, dtype=torch.float16)
    if seed is not None:
        raw.view(torch.int16).random_(generator=torch.Generator().manual_seed(seed))
    out = {}
    for layer in range(LAYERS):
        if layout == "HND":
            strides = (page, BLOCK * WIDTH, WIDTH, 1)
        else:
            strides = (page, WIDTH, heads * WIDTH, 1)
        out[f"layer.{layer}"] = raw.as_strided(
            (BLOCKS, heads, BLOCK, WIDTH), strides, layer * BLOCKS * page
        )
    return out


@pytest.fixture
def engines():
    a = TransferEngine(TransferConfig(transports="shm", name="staging-prefill"))
    b = TransferEngine(TransferConfig(transports="shm", name="staging-decode"))
    yield a, b
    a.shutdown()
    b.shutdown()


def fan_out(a: TransferEngine, b: TransferEngine):
    """NHD, prefill TP 1 -> decode worker 0 of TP 2: half of every token's row."""
    src = KVRegions.from_kv_caches(caches(HEADS, "NHD", 3), BLOCKS, "NHD")
    dst = KVRegions.from_kv_caches(caches(HEADS // 2, "NHD", None), BLOCKS, "NHD")
    tokens = 5 * BLOCK
    plan = plan_pair(src, dst, [0, 1], 0, 0, [6, 1, 4, 0, 2], [3, 7, 0, 5, 2], tokens)
    seg = a.register(src.buffers[0].tensor)
    dseg = b.register(dst.buffers[0].tensor)
    peer = a.connect(b.address)
    rseg = a.open_segment(peer, dseg.descriptor().pack())
    return src, dst, plan, seg, peer, rseg


@pytest.mark.parametrize("gather", ["native", "torch"])
def test_staged_batches_land_as_posted_in_fewer_pieces(engines, gather):
    a, b = engines
    src, dst, plan, seg, peer, rseg = fan_out(a, b)
    staging = Staging(a, 8 << 10, 2, gather=gather)
    batches = plan.batches(8 << 10)
    assert all(worth_staging(t) for _, _, t in batches)
    staged_pieces = direct_pieces = 0
    for _, _, triples in batches:
        staged = staging.stage(seg, triples)
        assert staged is not None
        staged.ready.result()
        batch = a.write(peer, staging.segment, rseg, staged.runs)
        a.wait(batch, 10.0)
        assert batch.error is None, batch.error
        staging.release(staged)
        staged_pieces += len(staged.runs)
        t = triples[np.argsort(triples[:, 1])]
        direct_pieces += pieces(t[:, 0], t[:, 2])
    assert staged_pieces * 2 <= direct_pieces
    n = 5
    assert np.array_equal(region_checksums(dst, plan, 1, n), region_checksums(src, plan, 0, n))
    staging.close()


def test_a_slot_is_taken_until_given_back():
    a = TransferEngine(TransferConfig(transports="shm", name="staging-slots"))
    try:
        src = KVRegions.from_kv_caches(caches(HEADS, "NHD", 1), BLOCKS, "NHD")
        seg = a.register(src.buffers[0].tensor)
        staging = Staging(a, 4096, 1)
        triples = np.array([[0, 0, 1024], [4096, 1024, 1024]], dtype=np.int64)
        first = staging.stage(seg, triples)
        assert first is not None and staging.stage(seg, triples) is None
        staging.release(first)
        again = staging.stage(seg, triples)
        assert again is not None and again.slot == first.slot
        with pytest.raises(ValueError, match="does not fit"):
            staging.stage(seg, np.array([[0, 0, 8192]], dtype=np.int64))
        staging.release(again)
        staging.close()
    finally:
        a.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_gathers_on_the_device():
    """Staging in CUDA memory gathers by torch on its own stream: a batch is ready once
    its future is, with the bytes the host reference gives."""
    a = TransferEngine(
        TransferConfig(transports="shm", name="staging-cuda", memory_types=("host", "cuda"))
    )
    try:
        host = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        dev = host.cuda()
        seg = a.register(dev)
        staging = Staging(a, 8192, 2, device=dev.device)
        assert staging.by_torch
        triples = np.array([[4096, 0, 1024], [0, 1024, 2048], [9000, 3072, 512]], dtype=np.int64)
        staged = staging.stage(seg, triples)
        assert staged is not None
        staged.ready.result()
        got = staging.memory[staged.slot * 8192 : staged.slot * 8192 + 3584].cpu()
        want = torch.cat([host[4096:5120], host[0:2048], host[9000:9512]])
        assert torch.equal(got, want)
        staging.release(staged)
        staging.close()
    finally:
        a.shutdown()
