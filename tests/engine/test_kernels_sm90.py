"""Every kernel variant compiles for sm_90 without a GPU, within its register budget, with
no spills, 16-byte global loads and (attention) tensor-core MMA in its SASS; and the check
fails when a budget is too tight or the alignment that gives 16-byte loads is lost.

The compile runs in a subprocess (``python -m kvferry.engine.kernels.aot``) without
``TRITON_INTERPRET``, since the interpreter tests define the kernels interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the sm_90 compile needs Triton (the test extra pins it)")

from kvferry.engine.kernels import aot


def run_aot(*args: str, timeout: float = 400) -> tuple[int, list[dict], str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.engine.kernels.aot", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, reports, proc.stderr


@pytest.fixture(scope="module")
def all_variants():
    return run_aot()


need_cuobjdump = pytest.mark.skipif(
    aot.cuobjdump() is None,
    reason="no cuobjdump in the Triton wheel or on PATH: registers unknown (PTX only)",
)


def test_every_variant_compiles_within_budget(all_variants):
    rc, reports, stderr = all_variants
    assert len(reports) == len(aot.variants()), stderr[-2000:]
    bad = {r["variant"]: r["violations"] for r in reports if r["violations"]}
    assert not bad, bad
    assert rc == 0
    for r in reports:
        if r["sass_from"] == "cuobjdump":
            assert r["stack"] == 0 and r["local"] == 0 and r["spill_ops"] == 0
            assert 0 < r["registers"] <= aot.REGISTER_BUDGET[r["variant"].split("-")[0]]
        if r["variant"].startswith("decode"):
            assert r["loads_128"] >= 2 and r["mma"] >= 2


@need_cuobjdump
def test_a_tight_register_budget_fails(all_variants):
    rc, reports, _ = run_aot("--only", "decode-bf16-d128-g4-check", "--register-budget", "32")
    assert rc == 1 and len(reports) == 1
    assert any("registers > budget 32" in v for v in reports[0]["violations"])


def test_losing_alignment_loses_16_byte_loads_and_fails():
    rc, reports, _ = run_aot("--only", "decode-bf16-d64-g4-nocheck", "--no-divisibility")
    assert rc == 1 and len(reports) == 1
    assert any("16-byte global loads" in v for v in reports[0]["violations"]), reports[0]


@need_cuobjdump
def test_every_compile_point_of_the_tuning_sweep_compiles_without_spills():
    """The device sweep times only what fits: each (block_n, warps, stages) point with the
    check on compiles for sm_90 with no spills and leaves a program resident per SM."""
    from kvferry.engine.kernels.tuning import compile_points

    rc, reports, stderr = run_aot("--sweep", "--only=-check@")
    points = [p for p in compile_points() if p.compile_key != aot.DEFAULT.compile_key]
    assert len(reports) == len(points), stderr[-2000:]
    assert rc == 0, {r["variant"]: r["violations"] for r in reports if r["violations"]}
    assert all(r["spill_ops"] == 0 and r["resident"] >= 1 for r in reports)


@need_cuobjdump
def test_a_tile_past_the_sweep_rule_spills():
    """The rule the sweep keeps (block_n at most 32 rows per warp) is what keeps spills out:
    one step past it, 128 positions on 2 warps (at 3 stages), spills and is reported as a
    violation."""
    from kvferry.engine.kernels.tuning import MAX_ROWS_PER_WARP, DecodeTuning

    past = DecodeTuning(block_n=128, num_warps=2, num_stages=3)
    assert past.block_n > MAX_ROWS_PER_WARP * past.num_warps
    rc, reports, stderr = run_aot("--tuning", past.name, "--only", "decode-bf16-d128-g4-check")
    assert rc == 1 and len(reports) == 1, stderr[-2000:]
    assert reports[0]["variant"] == "decode-bf16-d128-g4-check@n128-w2-s3"
    assert reports[0]["spill_ops"] > 0 and any("spills" in v for v in reports[0]["violations"])
