"""A short soak (the full one is scripts/soak.sh, 2,000 requests): random client aborts,
dropped/duplicated/delayed/reordered protocol messages and writes held in flight; every
pool returns to all-free, no foreign marker, every request answered."""

from __future__ import annotations

import pytest

from kvferry.cluster.harness import soak

pytestmark = pytest.mark.slow


def test_short_soak_leaves_no_page_and_no_foreign_marker(tmp_path, capsys):
    rc = soak.main(["--requests", "300", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    import json

    result = json.loads(out.strip().splitlines()[-1])
    assert result["requests"] == 300
    assert result["foreign_markers"] == 0 and result["wrong_answers"] == 0
    assert result["leaked_pages"] == 0 and result["unanswered"] == 0
    assert result["ok"] > 0 and result["aborted"] > 0 and result["rejected"] > 0
    # every release carried its proof, and none is a timer
    assert result["unjustified_releases"] == 0 and sum(result["release_justifications"].values())
    assert all("timer" not in k for k in result["release_justifications"])
