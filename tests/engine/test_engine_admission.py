import pytest

from kvferry.engine import (
    AdmissionLimits,
    AdmissionRejected,
    KVPool,
    MonolithicEngine,
    PageAllocator,
    ReplayModel,
    RequestState,
    admit,
    monolithic,
    pages_needed,
    pool_capacity_tokens,
)


def test_pages_needed_rounds_up():
    assert pages_needed(1, 1, 16) == 1
    assert pages_needed(16, 1, 16) == 2
    assert pages_needed(4096, 4096, 16) == 512
    with pytest.raises(ValueError):
        pages_needed(1, 1, 0)


def test_rejection_carries_the_numbers():
    with pytest.raises(AdmissionRejected) as err:
        admit("big", 1_000_000, 100_000, context_length=1_048_576, pool_capacity_tokens=681_280)
    e = err.value
    assert (e.request_id, e.prompt_tokens, e.max_tokens, e.context_length, e.capacity_tokens) == (
        "big",
        1_000_000,
        100_000,
        1_048_576,
        681_280,
    )
    assert e.http_status == 400
    for number in ("1000000", "100000", "1048576", "681280"):
        assert number in str(e)
    assert e.to_dict()["requested_tokens"] == 1_100_000


def test_the_incident_request_is_rejected_by_the_pool_not_just_the_context():
    """Fits the declared context length, not the pool: must be rejected (the incident)."""
    with pytest.raises(AdmissionRejected) as err:
        admit("r", 700_000, 1_000, context_length=1_048_576, pool_capacity_tokens=681_280)
    assert "pool" in err.value.reason


def test_smallest_pool_decides():
    limits = AdmissionLimits(context_length=10_000, capacities_tokens=(8_000, 2_000))
    limits.admit("ok", 1_000, 1_000)
    with pytest.raises(AdmissionRejected) as err:
        limits.admit("no", 1_000, 1_001)
    assert err.value.capacity_tokens == 2_000


@pytest.mark.parametrize("prompt,max_tokens", [(0, 5), (5, 0)])
def test_empty_prompt_or_no_output_is_rejected(prompt, max_tokens):
    with pytest.raises(AdmissionRejected):
        admit("r", prompt, max_tokens, context_length=100, pool_capacity_tokens=100)


def test_quarantined_pages_count_as_used():
    alloc = PageAllocator(10)
    assert pool_capacity_tokens(alloc, 16) == 160
    alloc.allocate("old", 4)
    assert pool_capacity_tokens(alloc, 16) == 160  # owned pages come back when 'old' ends
    alloc.quarantine("old")
    assert pool_capacity_tokens(alloc, 16) == 96
    with pytest.raises(AdmissionRejected):
        admit(
            "new", 90, 10, context_length=1000, pool_capacity_tokens=pool_capacity_tokens(alloc, 16)
        )


def _engine(pages=8, context=128):
    model = ReplayModel()
    return MonolithicEngine(model, KVPool(model.pool_config(16, pages)), context_length=context)


def assert_rejected_holds_nothing(engine, request_id):
    request = engine.request(request_id)
    assert request.state is RequestState.REJECTED
    assert engine.allocator.pages_of(request_id) == []
    assert engine.counters["rejected"] >= 1
    engine.run()
    assert engine.allocator.pages_of(request_id) == []
    assert engine.result(request_id).tokens == [] and not engine.result(request_id).ok


def test_engine_rejects_before_allocating(monkeypatch):
    engine = _engine()
    calls = []
    real_allocate = engine.allocator.allocate
    monkeypatch.setattr(
        engine.allocator, "allocate", lambda rid, n: calls.append(rid) or real_allocate(rid, n)
    )
    engine.submit("too-long", "x" * 100, 100)  # 200 > context 128
    assert_rejected_holds_nothing(engine, "too-long")
    assert "too-long" not in calls


def test_engine_counts_quarantined_pages_as_used():
    model = ReplayModel()
    engine = MonolithicEngine(model, KVPool(model.pool_config(16, 4)), context_length=64)
    engine.submit("old", "abc", 1)
    assert engine.prefill("old")
    engine.abort("old", "client gone", hold_quarantine=True)  # a late write may still land
    assert engine.allocator.counts()["quarantined"] == 1
    engine.submit("fits-context-not-pool", "x" * 40, 10)  # 50 <= 64 context, > 48 usable
    assert_rejected_holds_nothing(engine, "fits-context-not-pool")
    assert (
        engine.request("fits-context-not-pool").error
        and "48" in engine.request("fits-context-not-pool").error
    )


def test_admission_check_fails_when_admission_is_skipped(monkeypatch):
    """Injected fault: admission switched off. The same assertion must catch it."""
    engine = _engine()
    monkeypatch.setattr(monolithic, "admit", lambda *args, **kwargs: None)
    engine.submit("too-long", "x" * 100, 100)
    with pytest.raises(AssertionError):
        assert_rejected_holds_nothing(engine, "too-long")
