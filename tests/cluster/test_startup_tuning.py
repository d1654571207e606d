"""A decode kernel tuning the operator set wrong stops the cluster at start, naming the
variable and the value, rather than at the first decode step."""

from __future__ import annotations

import pytest

from kvferry.cluster.harness.localcluster import start

pytestmark = pytest.mark.slow


def test_a_bad_decode_tuning_refuses_the_start_with_its_value(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_DECODE_TUNING", "n64-w3-s2-p2-m256")
    with pytest.raises(RuntimeError) as err:
        start(3, [], tmp_path, startup_s=90.0)
    log = str(err.value)
    assert "refusing to start" in log and "KVFERRY_DECODE_TUNING='n64-w3-s2-p2-m256'" in log
    assert "num_warps 3 not in (2, 4, 8)" in log
