import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvferry.engine import (
    LIVE,
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Request,
    RequestState,
    is_live,
    live_requests,
)
from kvferry.engine.lifecycle import reachable_from, table_violations, terminal_states

S = RequestState


def test_terminal_states_are_exactly_the_endings():
    assert TERMINAL == {S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED}
    assert LIVE | TERMINAL == set(RequestState) and not LIVE & TERMINAL
    assert set(TRANSITIONS) == set(RequestState)


@pytest.mark.parametrize("state", list(RequestState))
def test_is_live_is_false_exactly_for_terminal_states(state):
    """The incident's finished() said 'not finished' for a rejected request. Here one
    predicate decides, and it agrees with the table for every state."""
    assert is_live(state) == bool(TRANSITIONS[state])
    assert is_live(state) == (state not in TERMINAL)


def test_rejected_request_is_dropped_by_every_queue():
    """The test that would have caught the incident: a rejected request must leave the
    queues that feed prefill, transfer and decode, and cannot be moved into them."""
    rejected = Request("r1", [1, 2, 3], max_tokens=4)
    rejected.transition(S.REJECTED, "prompt + max_tokens exceeds the pool")
    queued = Request("r2", [1], max_tokens=1)
    assert live_requests([rejected, queued]) == [queued]
    assert not rejected.live
    for work in (S.ADMITTED, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED):
        with pytest.raises(IllegalTransition):
            rejected.transition(work)


def test_illegal_transition_names_request_and_both_states():
    request = Request("req-42", [1], max_tokens=1)
    with pytest.raises(IllegalTransition) as err:
        request.transition(S.DECODING)
    assert (err.value.request_id, err.value.current, err.value.wanted) == (
        "req-42",
        S.QUEUED,
        S.DECODING,
    )
    assert (
        "req-42" in str(err.value) and "queued" in str(err.value) and "decoding" in str(err.value)
    )
    assert request.state is S.QUEUED and request.history == []


def test_happy_paths_are_allowed():
    paths = [
        [S.ADMITTED, S.PREFILLING, S.DECODING, S.FINISHED],
        [S.ADMITTED, S.PREFILLING, S.TRANSFERRING, S.FINISHED],
        [S.ADMITTED, S.TRANSFERRING, S.DECODING, S.FINISHED],
    ]
    for path in paths:
        request = Request("r", [1], max_tokens=1)
        for state in path:
            request.transition(state)
        assert request.state is S.FINISHED and not request.live
        assert [h.target for h in request.history] == path


def test_table_has_no_violations():
    assert table_violations(TRANSITIONS) == []
    for ending in TERMINAL:
        assert reachable_from(ending) == frozenset()


@pytest.mark.parametrize(
    "breakage",
    [
        {S.REJECTED: frozenset({S.TRANSFERRING})},  # the incident's path
        {S.ABORTED: frozenset({S.QUEUED})},  # back to the queue, then anywhere
        {S.DECODING: frozenset({S.FINISHED, S.REJECTED})},  # rejection after allocation
    ],
)
def test_table_checker_catches_broken_tables(breakage):
    broken = dict(TRANSITIONS) | breakage
    assert table_violations(broken), f"checker missed {breakage}"


def test_broken_table_changes_liveness():
    """If someone makes REJECTED non-terminal, the derived predicate follows the table
    and the checker flags it: liveness and the table cannot silently disagree."""
    broken = dict(TRANSITIONS) | {S.REJECTED: frozenset({S.TRANSFERRING})}
    assert S.REJECTED not in terminal_states(broken)
    assert any("rejected" in v for v in table_violations(broken))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(RequestState)), max_size=25))
def test_no_event_sequence_leaves_a_terminal_state(events):
    request = Request("r", [1], max_tokens=1)
    ended_in = None
    for event in events:
        before = request.state
        try:
            request.transition(event)
        except IllegalTransition:
            assert request.state is before
            continue
        assert event in TRANSITIONS[before]
        if ended_in is not None:
            pytest.fail(f"left terminal {ended_in} for {event}")
        if not is_live(request.state):
            ended_in = request.state


class LifecycleMachine(RuleBasedStateMachine):
    """Many requests, random events; once terminal, a request never reaches
    transferring or decoding, and no live-filtered queue holds it."""

    def __init__(self):
        super().__init__()
        self.requests = [Request(f"r{i}", [1], max_tokens=1) for i in range(3)]
        self.ended: dict[str, RequestState] = {}

    @rule(index=st.integers(0, 2), event=st.sampled_from(list(RequestState)))
    def apply(self, index, event):
        request = self.requests[index]
        try:
            request.transition(event)
        except IllegalTransition as err:
            assert err.request_id == request.request_id
        if not request.live:
            self.ended.setdefault(request.request_id, request.state)

    @invariant()
    def terminal_is_absorbing(self):
        for request in self.requests:
            if request.request_id in self.ended:
                assert request.state is self.ended[request.request_id]
                assert request.state not in (S.TRANSFERRING, S.DECODING)
                assert request not in live_requests(self.requests)


LifecycleMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestLifecycleMachine = LifecycleMachine.TestCase
