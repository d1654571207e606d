"""A prefill worker's staging memory (cluster/vllm/staging.py): rows scattered at the
source and gathered into staging land over the real transfer engine exactly as posted
as they lie, in fewer pieces; a slot is taken until it is given back (the writer's rule
for giving it back: tests/vllm_connector/test_writer_staging.py); the torch gather (the
CUDA staging's) moves the same bytes as the native one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cluster.vllm import staging as staging_module
from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.reshape import plan_pair, region_checksums
from kvferry.cluster.vllm.staging import Staging, gather_runs, gather_unit, pieces, worth_staging
from kvferry.transfer import SegmentBoundsError, TransferConfig, TransferEngine, copy_runs

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


@st.composite
def run_lists(draw):
    """Runs between a source of ``n`` bytes and a destination of ``m``, the destination's
    disjoint (as a gather's are), on a grain of 1-64 bytes."""
    grain = draw(st.sampled_from([1, 2, 4, 8, 16, 64]))
    n = grain * draw(st.integers(1, 256))
    m = grain * draw(st.integers(1, 256))
    runs, at = [], 0
    for _ in range(draw(st.integers(0, 12))):
        at += grain * draw(st.integers(0, 8))
        length = grain * draw(st.integers(1, 16))
        if at + length > m or length > n:
            break
        src_at = grain * draw(st.integers(0, (n - length) // grain))
        runs.append((src_at, at, length))
        at += length
    order = draw(st.permutations(range(len(runs))))
    return n, m, np.array([runs[i] for i in order], dtype=np.int64).reshape(-1, 3)


def _expected(src: np.ndarray, dst: np.ndarray, runs: np.ndarray) -> np.ndarray:
    out = dst.copy()
    for s, d, n in runs:
        out[d : d + n] = src[s : s + n]
    return out


@settings(max_examples=150, deadline=None)
@given(run_lists(), st.integers(0, 2**31 - 1))
def test_the_torch_gather_moves_what_the_native_copy_moves(case, seed):
    """gather_runs (the CUDA staging's gather, here on CPU tensors) and the native
    copy_runs write the same bytes, and exactly the runs' (every other byte of the
    destination as it was)."""
    n, m, runs = case
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    before = torch.from_numpy(rng.integers(0, 256, m, dtype=np.uint8))
    want = _expected(src.numpy(), before.numpy(), runs)
    by_torch = before.clone()
    assert gather_runs(by_torch, src, runs) == int(runs[:, 2].sum())
    assert np.array_equal(by_torch.numpy(), want)
    a = TransferEngine(TransferConfig(transports="shm", name="gather-native"))
    try:
        native = before.clone()
        copy_runs(a.register(native), a.register(src), runs)
        assert np.array_equal(native.numpy(), want)
    finally:
        a.shutdown()


def test_a_too_wide_gather_unit_is_caught(monkeypatch):
    """BROKEN MODE: a unit taken from the offsets alone (not the lengths) moves whole
    units only and drops each run's tail; the comparison above catches it."""
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    runs = np.array([[64, 0, 48], [128, 64, 16]], dtype=np.int64)
    want = _expected(src.numpy(), np.zeros(256, dtype=np.uint8), runs)
    assert gather_unit(runs) == 16
    good = torch.zeros(256, dtype=torch.uint8)
    gather_runs(good, src, runs)
    assert np.array_equal(good.numpy(), want)

    def offsets_only(r: np.ndarray) -> int:
        g = int(np.gcd.reduce(r[:, :2].reshape(-1)))
        return min(64, g & -g)

    monkeypatch.setattr(staging_module, "gather_unit", offsets_only)
    broken = torch.zeros(256, dtype=torch.uint8)
    gather_runs(broken, src, runs)
    assert not np.array_equal(broken.numpy(), want)


def test_the_torch_gather_refuses_runs_outside_either_tensor():
    src, dst = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(SegmentBoundsError, match="40"):
        gather_runs(dst, src, np.array([[40, 0, 32]], dtype=np.int64))
    with pytest.raises(SegmentBoundsError):
        gather_runs(dst, src, np.array([[0, 16, 32]], dtype=np.int64))
    assert torch.count_nonzero(dst) == 0


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
