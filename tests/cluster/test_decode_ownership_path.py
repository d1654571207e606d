"""Which ownership check the decode rank's step runs: the kernel's, fused into the
attention pass, when the pool's attention runs the kernels (CUDA), the separate torch
reference before the step otherwise. On this CPU machine the device check is
monkeypatched and the attention wrapped by a recording fake (which still runs the
dispatcher, whose reference path applies the same check the kernel does)."""

from __future__ import annotations

import pytest
import torch
from test_protocol_units import _assign_and_notice_fields, _owner

import kvferry.cluster.decode_path as decode_mod
import kvferry.engine.replay as replay_mod
from kvferry.cluster import messages as m
from kvferry.engine.integrity import Canary, request_id_hash
from kvferry.engine.kernels import dispatch


def _decoding(owner, rt, rid="r21"):
    """A request verified and past its first step; returns its pages and generations."""
    notice = _assign_and_notice_fields(owner, rt, rid, checksums=True)
    rt.deliver(m.NOTICE, src=1, **notice)
    rt.pump()
    assert owner.busy() and owner.step()
    return notice["pages"], notice["generations"]


@pytest.fixture
def recorded(monkeypatch):
    """Records the ``ownership`` each attention call gets and each separate reference
    check the decode rank runs."""
    calls: dict[str, list] = {"attention": [], "reference": []}
    real_attention = replay_mod.paged_decode_attention
    real_reference = decode_mod.check_ownership_reference

    def attention(*args, ownership=None, **kwargs):
        calls["attention"].append(ownership)
        return real_attention(*args, ownership=ownership, **kwargs)

    def reference(*args, **kwargs):
        calls["reference"].append(args)
        return real_reference(*args, **kwargs)

    monkeypatch.setattr(replay_mod, "paged_decode_attention", attention)
    monkeypatch.setattr(decode_mod, "check_ownership_reference", reference)
    return calls


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda-fused", "cpu-reference"])
def test_the_step_picks_the_fused_check_on_cuda_and_the_reference_elsewhere(
    on_cuda, recorded, monkeypatch
):
    if on_cuda:
        monkeypatch.setattr(dispatch, "use_triton", lambda tensor: True)
    owner, rt = _owner(integrity=True)
    pages, gens = _decoding(owner, rt)
    if on_cuda:
        assert recorded["reference"] == [] and recorded["attention"]
        assert all(o is not None for o in recorded["attention"])
        assert recorded["attention"][0].canaries.data_ptr() == owner.path.canaries.table.data_ptr()
    else:
        assert len(recorded["reference"]) == 1 and recorded["attention"] == [None]
    # a page read (not the one written) loses its owner: the next step fails the request
    owner.path.canaries.stamp([pages[1]], [Canary(request_id_hash("another"), gens[1], 1)])
    rt.sent.clear()
    recorded["attention"].clear()
    owner.step()
    assert "TOKENS" not in rt.kinds() and not owner.busy()
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert done["outcome"] == "failed" and "foreign request" in done["error"]
    assert "logical page 1" in done["error"]
    if on_cuda:  # found by the check inside the attention pass, its flags read after it
        assert len(recorded["attention"]) == 1 and recorded["reference"] == []
        assert recorded["attention"][0].failures()[0][1] & 1
    else:  # found before the step: no attention ran
        assert recorded["attention"] == []


def test_on_cuda_the_page_a_step_writes_is_checked_before_the_step(recorded, monkeypatch):
    """The model writes the step's K/V before its attention reads: a foreign page there
    is caught before the step runs, so no token lands in another request's page."""
    monkeypatch.setattr(dispatch, "use_triton", lambda tensor: True)
    owner, rt = _owner(integrity=True)
    pages, gens = _decoding(owner, rt)
    # compared as bits: the pool is torch.empty, and its garbage may hold NaNs
    before = owner.pool.kv[pages[2]].clone().view(torch.uint8)
    owner.path.canaries.stamp([pages[2]], [Canary(request_id_hash("another"), gens[2], 2)])
    rt.sent.clear()
    recorded["attention"].clear()
    owner.step()
    assert recorded["attention"] == [] and "TOKENS" not in rt.kinds()
    assert torch.equal(owner.pool.kv[pages[2]].view(torch.uint8), before)
    done = next(f for _, k, f in rt.sent if k == "DONE")
    assert "foreign request" in done["error"] and "logical page 2" in done["error"]


def test_clean_runs_give_the_same_tokens_on_both_paths(monkeypatch):
    tokens = {}
    for on_cuda in (False, True):
        if on_cuda:
            monkeypatch.setattr(dispatch, "use_triton", lambda tensor: True)
        owner, rt = _owner(integrity=True)
        # the same bytes in both pools (a pool is torch.empty: never zeroed)
        owner.pool.kv.copy_(
            torch.randn(owner.pool.kv.shape, generator=torch.Generator().manual_seed(3))
        )
        _decoding(owner, rt)
        while owner.busy() and owner.step():
            pass
        tokens[on_cuda] = [t for _, k, f in rt.sent if k == "TOKENS" for t in f["tokens"]]
    assert tokens[True] == tokens[False] and len(tokens[True]) == 8
