"""The decode kernel's tuning record: names that read back, values refused with the number
that is wrong, the split heuristic's bounds, the sweep's shape, and the device sweep's
pick over the goal cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.engine.kernels import tuning
from kvferry.engine.kernels.tuning import DEFAULT, MAX_SPLITS, DecodeTuning
from kvferry.engine.tools.gpu_tune import best_overall


@st.composite
def tunings(draw) -> DecodeTuning:
    block_n = draw(st.sampled_from(tuning.BLOCK_NS))
    return DecodeTuning(
        block_n=block_n,
        num_warps=draw(st.sampled_from(tuning.WARPS)),
        num_stages=draw(st.sampled_from(tuning.STAGES)),
        programs_per_sm=draw(st.sampled_from(tuning.PROGRAMS_PER_SM)),
        min_split_tokens=block_n * draw(st.integers(1, 64)),
    )


@given(tunings())
def test_a_name_reads_back_as_its_tuning(t):
    assert DecodeTuning.parse(t.name) == t
    assert t.compile_key == (t.block_n, t.num_warps, t.num_stages)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"block_n": 32}, "block_n 32 not in (64, 128, 256)"),
        ({"num_warps": 16}, "num_warps 16 not in (2, 4, 8)"),
        ({"num_stages": 0}, "num_stages 0"),
        ({"programs_per_sm": 5}, "programs_per_sm 5"),
        (
            {"min_split_tokens": 100},
            "min_split_tokens 100 must be a positive multiple of block_n 64",
        ),
        ({"block_n": 128, "min_split_tokens": 64}, "min_split_tokens 64"),
    ],
)
def test_a_bad_value_is_refused_with_the_number(fields, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        DecodeTuning(**fields)


@pytest.mark.parametrize("text", ["", "n64-w4-s2", "n64-w4-s2-p2-m256-x", "N64-w4-s2-p2-m256"])
def test_a_name_that_does_not_parse_says_the_form(text):
    with pytest.raises(ValueError, match="n<block_n>-w<warps>"):
        DecodeTuning.parse(text)


@given(
    tunings(),
    st.integers(1, 256),
    st.sampled_from([1, 2, 8, 16]),
    st.integers(0, 1 << 21),
    st.integers(1, 200),
)
def test_splits_stay_within_bounds(t, batch, kv_heads, max_tokens, sms):
    """At least one split, at most MAX_SPLITS; more than one only when each keeps
    ``min_split_tokens`` positions; never fewer programs than the target asks for unless
    a bound stops it."""
    s = t.splits(batch, kv_heads, max_tokens, sms)
    assert 1 <= s <= MAX_SPLITS
    if s > 1:
        assert max_tokens // s >= t.min_split_tokens
    target = t.programs_per_sm * sms
    if batch * kv_heads * s < target:
        assert s in (MAX_SPLITS, max(1, max_tokens // t.min_split_tokens))


def test_the_default_is_the_device_pick():
    """Kernel v1's compiled variant, aiming for 4 programs per SM (engine/GPU.md)."""
    assert DEFAULT.name == "n64-w4-s2-p4-m256"
    assert DEFAULT.compile_key == (64, 4, 2)
    # an H200's 132 SMs, 8 KV heads: 1 x 131072 splits into 66, 16 x 8192 into 5
    assert DEFAULT.splits(1, 8, 131072, 132) == 66
    assert DEFAULT.splits(16, 8, 8192, 132) == 5


def test_the_sweep_starts_with_the_default_and_holds_each_tuning_once():
    sweep = tuning.sweep()
    assert sweep[0] == DEFAULT and len(set(sweep)) == len(sweep)
    points = {t.compile_key for t in sweep}
    assert points == {p.compile_key for p in tuning.compile_points()} | {DEFAULT.compile_key}
    assert all(t.block_n <= tuning.MAX_ROWS_PER_WARP * t.num_warps for t in sweep)
    assert {t.programs_per_sm for t in sweep} == set(tuning.PROGRAMS_PER_SM)


def test_the_pick_over_the_goal_cases_minimises_the_worst_loss():
    """a is best on one goal case and poor on the other, b close on both: b is the pick;
    c, fastest on one case but refused on the other, cannot be picked; the case outside
    the goals does not count; no common tuning, no pick."""
    per_case = {
        "1x131072": {"a": 1.0, "b": 1.05, "c": 0.9},
        "16x8192": {"a": 2.0, "b": 1.1},
        "64x2048": {"a": 1.0, "b": 9.0},
    }
    goals = ["1x131072", "16x8192"]
    assert best_overall(per_case, goals) == "b"
    assert best_overall({"1x131072": {}, "16x8192": {}}, goals) is None
    assert best_overall({"1x131072": {"a": 1.0}, "16x8192": {"b": 1.0}}, goals) is None


def test_the_environment_picks_the_tuning_and_a_bad_one_is_named():
    assert tuning.active({}) == DEFAULT
    assert tuning.active({tuning.ENV: " "}) == DEFAULT
    assert tuning.active({tuning.ENV: "n128-w8-s3-p4-m256"}) == DecodeTuning(128, 8, 3, 4, 256)
    with pytest.raises(ValueError, match=r"KVFERRY_DECODE_TUNING='n32-w4-s2-p2-m256': block_n 32"):
        tuning.active({tuning.ENV: "n32-w4-s2-p2-m256"})
