"""The dispatcher: the torch references on CPU tensors (the models go through it), the
ownership check's reference path, and, on a CUDA device only, the Triton kernels against
the references."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvferry.engine import headgroup, integrity, llama, replay
from kvferry.engine.allocator import PageGrant
from kvferry.engine.attention import paged_decode_attention as reference
from kvferry.engine.integrity import CanaryTable, IntegrityError, expected_canaries
from kvferry.engine.kernels import (
    FOREIGN_REQUEST,
    OUT_OF_POOL,
    PageOwnership,
    dispatch,
    page_checksums,
    paged_decode_attention,
    use_triton,
)

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the Triton kernels run there)"
)


def small_case(device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(9, 2, 2, 2, 16, 64, generator=gen).to(dtype)
    table = torch.tensor([[4, 1, 7], [0, 2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    q = torch.randn(2, 8, 64, generator=gen).to(dtype)
    return kv.to(device), table.to(device), seq_lens.to(device), q.to(device)


def test_models_call_the_dispatcher():
    assert replay.paged_decode_attention is paged_decode_attention
    assert headgroup.paged_decode_attention is paged_decode_attention  # llama's attention


def test_cpu_goes_to_the_reference_without_importing_triton():
    kv, table, seq_lens, q = small_case()
    assert not use_triton(kv)
    assert torch.equal(
        paged_decode_attention(q, kv, 1, table, seq_lens), reference(q, kv, 1, table, seq_lens)
    )
    code = (
        "import sys, torch; from kvferry.engine.kernels import paged_decode_attention as f; "
        "kv = torch.zeros(2, 1, 2, 1, 16, 64); "
        "f(torch.zeros(1, 1, 64), kv, 0, torch.zeros(1, 1, dtype=torch.int32), "
        "torch.ones(1, dtype=torch.int32)); assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_forcing_the_choice(monkeypatch):
    kv = torch.zeros(1)
    monkeypatch.setenv("KVFERRY_KERNELS", "triton")
    assert use_triton(kv)
    monkeypatch.setenv("KVFERRY_KERNELS", "torch")
    assert not use_triton(kv)


def test_checksums_dispatch_to_the_reference_on_cpu():
    kv, *_ = small_case()
    assert torch.equal(page_checksums(kv, [3, 1]), integrity.page_checksums(kv, [3, 1]))


def test_reference_path_checks_ownership_and_clamps():
    kv, table, seq_lens, q = small_case()
    canaries = CanaryTable(kv.shape[0])
    grants = [[PageGrant(p, 10 + j) for j, p in enumerate(row)] for row in ([4, 1, 7], [0, 2])]
    for rid, row in zip(["a", "b"], grants, strict=True):
        canaries.stamp([g.page for g in row], expected_canaries(rid, row))
    own = PageOwnership.for_requests(canaries, ["a", "b"], grants, width=3)
    clean = paged_decode_attention(q, kv, 0, table, seq_lens, ownership=own)
    assert own.failures() == [] and torch.equal(clean, reference(q, kv, 0, table, seq_lens))
    bad = table.clone()
    bad[0, 2] = 99  # out of the pool: flagged, read clamped, no IndexError
    bad[1, 0] = 7  # another request's page
    out = paged_decode_attention(q, kv, 0, bad, seq_lens, ownership=own)
    assert own.failures() == [(0, OUT_OF_POOL, 2), (1, FOREIGN_REQUEST | 6, 0)]
    assert bool(torch.isfinite(out).all())
    with pytest.raises(IntegrityError, match=r"'a'.*page id outside the pool") as err:
        own.raise_if_bad(["a", "b"], bad)
    assert err.value.bad_pages == [99]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(dtype):
    kv, table, seq_lens, q = small_case("cuda", dtype)
    assert use_triton(kv)
    out = paged_decode_attention(q, kv, 1, table, seq_lens)
    torch.testing.assert_close(
        out.float(), reference(q, kv, 1, table, seq_lens).float(), atol=2e-2, rtol=2e-2
    )
    assert torch.equal(page_checksums(kv, [3, 1, 8]), integrity.page_checksums(kv, [3, 1, 8]))


@cuda
@pytest.mark.cuda
def test_cuda_ownership_matches_reference():
    kv, table, seq_lens, q = small_case("cuda", torch.bfloat16)
    canaries = torch.zeros(kv.shape[0], 3, dtype=torch.int64, device="cuda")
    own = PageOwnership.create(canaries, torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.int64))
    ref = PageOwnership.create(
        canaries.cpu(), torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.int64)
    )
    paged_decode_attention(q, kv, 0, table, seq_lens, ownership=own)
    dispatch.check_ownership_reference(table.cpu(), seq_lens.cpu(), 16, kv.shape[0], ref)
    assert own.failures() == ref.failures() != []


def test_unsupported_shapes_fall_back_to_the_reference(monkeypatch):
    """Forced to Triton, a pool of page size 4 or head dim 16 (the small models') still
    runs the reference instead of failing."""
    monkeypatch.setenv("KVFERRY_KERNELS", "triton")
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(6, 1, 2, 2, 4, 16, generator=gen)
    table = torch.tensor([[1, 3, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([10], dtype=torch.int32)
    q = torch.randn(1, 4, 16, generator=gen)
    assert torch.equal(
        paged_decode_attention(q, kv, 0, table, seq_lens), reference(q, kv, 0, table, seq_lens)
    )


@pytest.mark.parametrize("name", ["replay", "llama"])
def test_a_models_step_checks_ownership_in_its_first_layer_only(monkeypatch, name):
    """Every layer reads the same pages through the same table, and canaries change only
    between steps: the check runs once a step (in the first layer's attention), not once
    a layer, and still every step."""
    seen: list[tuple[int, object]] = []

    def recording(q, kv, layer, table, seq_lens, scale=None, *, ownership=None):
        seen.append((layer, ownership))
        return torch.zeros_like(q)

    module = replay if name == "replay" else headgroup  # llama attends through headgroup
    monkeypatch.setattr(module, "paged_decode_attention", recording)
    if name == "replay":
        model = replay.ReplayModel(replay.ReplayConfig(layers=3))
    else:
        model = llama.LlamaModel(llama.LlamaConfig(layers=3))
    pool = torch.zeros(4, 3, 2, model.kv_heads, 16, model.head_dim)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    own = object()
    args = (pool, table, torch.tensor([5]), torch.tensor([7]))
    if name == "replay":
        model.decode_step(*args, torch.tensor([3]), ownership=own)
    else:
        model.decode_step(*args, ownership=own)
    assert seen == [(0, own), (1, None), (2, None)]
