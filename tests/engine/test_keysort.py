"""The packed sort order equals np.lexsort's, whether the keys fit in one int64 or not."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.keysort import lexsort_order


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 300),
    bits=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    negative=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_order_is_lexsorts(n, bits, negative, seed):
    rng = np.random.default_rng(seed)
    keys = [
        rng.integers(0, 1 << b, n, dtype=np.int64) if b else np.zeros(n, np.int64) for b in bits
    ]
    keys[0] = rng.permutation(max(n, 1) * 3)[:n].astype(np.int64)  # unique: one order only
    if negative and n:
        keys[-1][0] = -1
    assert np.array_equal(lexsort_order(*keys), np.lexsort(keys))


def test_a_key_that_ties_keeps_lexsorts_stable_order():
    keys = [np.array([5, 5, 1, 5]), np.array([0, 0, 0, 0])]
    assert lexsort_order(*keys).tolist() == np.lexsort(keys).tolist() == [2, 0, 1, 3]
