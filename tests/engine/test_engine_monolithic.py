"""Monolithic engine, and the leak test that proves the protection can fail when off.

Scenario (the incident's shape): request A, with a unique marker in every position, is
aborted after its pages were written. Request B, with its own marker, is granted A's pages
by the allocator and its prefill writes fewer positions than it will attend over (a stub
prompt / short transfer). In unsafe mode B's replayed answer contains A's marker; in normal
mode B fails with an integrity error and produces no tokens.
"""

import logging

import pytest

from kvferry.engine import IntegrityPolicy, KVPool, MonolithicEngine, ReplayModel, RequestState

S = RequestState
MARK_A = "<<A-7f3e>>"
MARK_B = "<<B-19c4>>"
PROMPT_A = (MARK_A * 13)[:128]
PROMPT_B = (MARK_B * 13)[:128]


def _engine(*, unsafe=False, integrity=IntegrityPolicy(), pages=32):
    model = ReplayModel()
    return MonolithicEngine(
        model,
        KVPool(model.pool_config(16, pages)),
        context_length=pages * 16,
        unsafe=unsafe,
        integrity=integrity,
    )


def run_leak_scenario(engine, *, hold_quarantine=False):
    engine.submit("A", PROMPT_A, 128)
    assert engine.prefill("A")
    pages_a = engine.allocator.pages_of("A")
    engine.abort("A", "client disconnected", hold_quarantine=hold_quarantine)
    engine.submit("B", PROMPT_B, 128)
    assert engine.prefill("B", written_tokens=16)  # 16 of 128 prompt positions written
    shared = set(pages_a) & set(engine.allocator.pages_of("B"))
    if engine.begin_decode("B"):
        engine.run()
    return engine.result("B"), shared


def test_unsafe_mode_leaks_the_other_requests_text(caplog):
    with caplog.at_level(logging.CRITICAL):
        engine = _engine(unsafe=True)
    assert any("UNSAFE" in r.message for r in caplog.records)
    result, shared = run_leak_scenario(engine)
    assert shared, "the allocator must have reused A's pages for the scenario to mean anything"
    assert result.ok
    assert MARK_A in result.text, "unsafe mode must show the leak, or this test cannot fail"


@pytest.mark.parametrize(
    "policy",
    [
        IntegrityPolicy(),
        IntegrityPolicy(length=True, canaries=False, checksums=False),
        IntegrityPolicy(length=False, canaries=True, checksums=False),
        IntegrityPolicy(length=False, canaries=False, checksums=True),
    ],
    ids=["all", "length", "canaries", "checksums"],
)
def test_normal_mode_never_leaks(policy):
    engine = _engine(integrity=policy)
    result, shared = run_leak_scenario(engine)
    assert shared  # same pages as in the unsafe run: only the checks differ
    assert result.state is S.FAILED and result.tokens == []
    assert "integrity" in result.error
    assert MARK_A not in result.text
    assert engine.counters["integrity_failures"] == 1
    assert engine.allocator.counts()["free"] == engine.allocator.num_pages


def test_with_checks_off_the_same_scenario_leaks():
    """Every check off but quarantine on: the scenario leaks, so the checks are what stop it."""
    engine = _engine(integrity=IntegrityPolicy(False, False, False))
    result, _ = run_leak_scenario(engine)
    assert MARK_A in result.text


def test_held_quarantine_keeps_pages_away_from_the_next_request():
    engine = _engine()
    result, shared = run_leak_scenario(engine, hold_quarantine=True)
    assert not shared
    assert engine.allocator.counts()["quarantined"] == 16
    assert not result.ok and MARK_A not in result.text
    assert engine.release("A") and engine.allocator.counts()["quarantined"] == 0


def test_batch_of_requests_each_replays_its_own_prompt():
    engine = _engine(pages=64)
    prompts = {f"r{i}": f"[{i}] request number {i} says hello " * (i + 1) for i in range(6)}
    results = engine.generate(
        [(rid, p, len(p)) for rid, p in prompts.items()] + [("huge", "x" * 900, 200)]
    )
    by_id = {r.request_id: r for r in results}
    for rid, prompt in prompts.items():
        assert by_id[rid].ok and by_id[rid].text == prompt
    assert by_id["huge"].state is S.REJECTED and "400" not in by_id["huge"].error
    assert engine.allocator.counts()["free"] == 64
    assert engine.live() == []


def test_corrupted_page_fails_the_request():
    engine = _engine()
    engine.submit("r", "some prompt text that spans pages", 8)
    assert engine.prefill("r")
    page = engine.allocator.pages_of("r")[1]
    engine.pool.kv[page, 0, 1, 0, 0, 0] += 1  # a byte changed between write and read
    assert not engine.begin_decode("r")
    result = engine.result("r")
    assert result.state is S.FAILED and str(page) in result.error


def test_aborted_request_never_decodes():
    engine = _engine()
    engine.submit("r", "abc", 3)
    assert engine.prefill("r") and engine.begin_decode("r")
    engine.abort("r", "deadline")
    assert engine.step() == []
    assert engine.result("r").state is S.ABORTED and engine.result("r").tokens == []
    with pytest.raises(ValueError):
        engine.abort("r")


def test_requests_wait_for_pages_and_run_later():
    engine = _engine(pages=8)
    results = engine.generate([("a", "a" * 40, 40), ("b", "b" * 40, 40), ("c", "c" * 40, 40)])
    assert [r.text for r in results] == ["a" * 40, "b" * 40, "c" * 40]
