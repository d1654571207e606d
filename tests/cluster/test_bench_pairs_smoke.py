"""The vLLM pairs benchmark runs end to end at a tiny size and the bytes it moves land
where the decode reads them (its own check, asserted here); no figure is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvferry.cluster.harness import benchpairs


def _bench(only: str, *extra: str) -> list[dict]:
    """The benchmark at a tiny size for one pair: its JSON lines (the host's, then the pair's)."""
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.cluster.harness.benchpairs", "--tokens", "100",
         "--layers", "2", "--reps", "1", "--only", only, *extra],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_the_pairs_benchmark_runs_and_checks_its_bytes():
    lines = _bench("tp2/b16/NHD->tp1/b16", "--rows")
    assert len(lines) == 2 and "host" in lines[0], lines
    row = lines[1]
    assert row["src"] == "tp2/b16/NHD" and row["dst"] == "tp1/b16/NHD", row
    assert row["bytes_checked"] and row["bytes"] == 2 * 8 * 100 * 512 and row["ratio"] > 0, row
    # as rows, two writers' heads interleave in each token's row at the target: a remote
    # piece a run
    assert row["pieces"]["remote"] == row["runs"] and row["pieces"]["local"] < row["runs"], row
    assert not row["turned"] and not row["slotted"], row


def test_a_fan_in_of_one_block_size_is_benchmarked_by_slots():
    (_, row) = _bench("tp2/b16/NHD->tp1/b16")
    assert row["slotted"] and not row["turned"] and row["bytes_checked"], row
    # each writer's spans whole into its slot: a run, and a remote piece, per layer, block
    # (7 of 16 tokens for 100) and writer
    assert row["runs"] == 2 * 7 * 2 and row["pieces"]["remote"] == row["runs"], row


def test_a_fan_in_into_larger_blocks_is_benchmarked_by_slots():
    """Decode blocks of 64 tokens, each four of the prefill's: every prefill kernel block
    of the prompt a run (7 of 16 tokens for 100), per layer and writer; a writer's four
    spans of a decode block follow each other there (writer-major), so a remote piece per
    layer, decode block (2 of 64 tokens) and writer."""
    (_, row) = _bench("tp2/b16/NHD->tp1/b64/HND")
    assert row["slotted"] and row["bytes_checked"], row
    assert row["runs"] <= 2 * 7 * 2 and row["pieces"]["remote"] == 2 * 2 * 2, row


def test_a_layout_change_alone_is_benchmarked_as_whole_blocks_turned_by_the_decode():
    (_, row) = _bench("tp2/b16/NHD->tp2/b16/HND")
    assert row["turned"] and row["bytes_checked"], row
    assert row["runs"] == row["homogeneous_runs"], row  # whole blocks, as the homogeneous pair


def test_a_turned_pair_in_parts_turns_every_part():
    """Parts of 16 KiB per decode worker (the connector's part_bytes): each part is
    turned by the decode's thread while the next is posted, and every byte ends in the
    decode's order (the bench's own check reads them there)."""
    (_, row) = _bench("tp2/b16/NHD->tp2/b16/HND", "--part-kib", "16")
    assert row["turned"] and row["parts"] > 2 and row["bytes_checked"], row
    (_, row) = _bench("tp2/b16/NHD->tp1/b16", "--part-kib", "16")
    assert row["slotted"] and row["parts"] > 2 and row["bytes_checked"], row


@pytest.mark.parametrize("broken", [False, True], ids=["safe", "broken-first-part-unturned"])
def test_the_bytes_check_sees_a_part_left_in_the_writers_order(monkeypatch, capsys, broken):
    """The check reads every row where the decode reads it: a part the decode never
    turned (rows in the writer's order) fails it."""
    if broken:
        turn = benchpairs.Move.turn

        def skip_first(self, lo, hi):
            if lo:
                turn(self, lo, hi)

        monkeypatch.setattr(benchpairs.Move, "turn", skip_first)
    monkeypatch.setenv("UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES", "lo"))
    benchpairs.main(
        ["--tokens", "100", "--layers", "2", "--reps", "1", "--part-kib", "16",
         "--only", "tp2/b16/NHD->tp2/b16/HND"]
    )  # fmt: skip
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["parts"] > 2 and row["bytes_checked"] is not broken, row
