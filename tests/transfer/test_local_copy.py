"""copy_runs: byte runs between two host segments of this process, checked against both
before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.transfer import SegmentBoundsError, copy_runs


def test_runs_are_copied_where_they_say(engine):
    src = np.arange(1024, dtype=np.int32).view(np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a, b = engine.register(src), engine.register(dst)
    runs = np.array([[100, 0, 16], [4000, 16, 64], [0, 1000, 8]], dtype=np.int64)
    assert copy_runs(b, a, runs) == 88
    for so, do, n in runs.tolist():
        assert np.array_equal(dst[do : do + n], src[so : so + n])
    assert int(dst[16 + 64 : 1000].sum()) == 0


def test_a_run_outside_either_segment_copies_nothing(engine):
    src = np.ones(1024, dtype=np.uint8)
    dst = np.zeros(512, dtype=np.uint8)
    a, b = engine.register(src), engine.register(dst)
    runs = np.array([[0, 0, 16], [0, 500, 16]], dtype=np.int64)
    with pytest.raises(SegmentBoundsError) as e:
        copy_runs(b, a, runs)
    assert "500" in str(e.value) and "512" in str(e.value)
    assert int(dst.sum()) == 0
