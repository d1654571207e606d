"""The transfer benchmark checks every byte its throughput rows wrote at the target: a
small run of the scattered, bulk and KV-shaped rows passes, and the same rows with the
engine told to skip one page per batch (the engine's fault mode) fail the run."""

from __future__ import annotations

import argparse

import pytest

from kvferry.transfer.tools import bench_transfer as bt


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        dst_mib=16,
        src_mib=16,
        spin_us=0,
        busy_poll_us=0,
        warmup=1,
        batches=2,
    )


@pytest.mark.parametrize("skip", [None, 1], ids=["exact", "broken-skips-a-page"])
def test_every_throughput_row_checks_the_bytes_at_the_target(skip, capsys):
    bench = bt.Bench(_args(), "shm", "allocate")
    try:
        bench.eng.config.fault_skip_page = skip
        if skip is not None:
            with pytest.raises(RuntimeError, match="descriptors differ at the target"):
                bench.kv_burst(4, 2, 16 << 10, 2 << 20, ceiling=1.0)
            return
        bench.throughput(64, 16 << 10)
        ceiling = bench.bulk(2 << 20)
        bench.kv_burst(4, 2, 16 << 10, 2 << 20, ceiling)
    finally:
        bench.close()
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [bt.json.loads(line) for line in lines]
    assert [r["op"] for r in rows] == ["write", "bulk", "kv-burst"]
    assert all(r["verified"] == "byte-exact" and r["gbps"] > 0 for r in rows)
    assert rows[2]["descriptors"] == 4 * 8 * 2 * 2 and rows[2]["ceiling_ratio"] > 0


def test_cross_memory_flag_takes_on_off_lists_and_refuses_anything_else():
    assert bt._on_off_list("on,off") == ["on", "off"] and bt._on_off_list("off") == ["off"]
    with pytest.raises(argparse.ArgumentTypeError, match="expected on, off"):
        bt._on_off_list("yes")


def test_split_placement_gives_each_process_a_cpu_of_its_own():
    """Two processes on one host model a writer and its owner on hosts of their own only
    when they do not share a CPU; ``any`` leaves placement to the scheduler."""
    cpus = sorted(__import__("os").sched_getaffinity(0))
    split = bt.placement_cpus("split")
    if len(cpus) >= 2:
        assert split is not None and split[0].isdisjoint(split[1])
    else:
        assert split is None
    shared = bt.placement_cpus("shared")
    assert shared is not None and shared[0] == shared[1] and len(shared[0]) == 1
    assert bt.placement_cpus("any") is None
    assert [bt.placement_name(bt.placement_cpus(p)) for p in ("shared", "any")] == ["shared", "any"]
    assert bt.placement_name(split) == ("split" if split is not None else "any")
