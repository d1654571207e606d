"""scripts/gpu-check.sh, the device run: on a machine without a CUDA device it says so and
exits 2 (its checks and timings run only on the GPU machine); --help answers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def test_help():
    proc = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "JSON lines" in proc.stdout


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA device is present: the script would run for real"
)
def test_without_a_gpu_it_says_so_and_fails():
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device visible" in proc.stderr
    assert proc.stdout == ""


def test_the_tool_module_runs_through_the_script_without_an_install():
    """scripts/gpu-check.sh runs kvferry.engine.tools.gpu_check with transfer/, engine/
    and cluster/ exposed as kvferry.* by its shim (no install on the device machine)."""
    proc = subprocess.run(
        [str(SCRIPT), "--help-python"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "KVFERRY_PYTHON": sys.executable, "PYTHONNOUSERSITE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and "--no-transfer" in proc.stdout


def test_the_page_transfer_moves_host_pages_between_two_processes(monkeypatch):
    """The transfer measurement's own path on host memory (as the dry run drives it): a
    target process, pages scattered into its pool, each batch flushed and noticed, the
    bytes checked there."""
    from kvferry.engine.tools import gpu_check

    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    monkeypatch.setattr(gpu_check, "RESULTS", [])
    monkeypatch.setattr(gpu_check, "FAILED", [])
    gpu_check._transfer_run("ucx", 1.0, 1, 2, (8, 4096), {})
    checks = [r for r in gpu_check.RESULTS if r["kind"] == "check"]
    assert gpu_check.FAILED == [] and len(checks) == 2 and all(r["ok"] for r in checks)
    (row,) = [r for r in gpu_check.RESULTS if r["kind"] == "transfer"]
    assert row["bytes"] == 8 * 4096 and row["memory_types"]["registered"] == {
        "host": {"segments": 1, "bytes": 8 * 4096}
    }


@pytest.mark.parametrize("broken", [False, True])
def test_the_staging_gather_row_checks_its_bytes(monkeypatch, broken):
    """The device run's staging gather (a fan-out's rows into contiguous staging, as the
    vLLM connector stages them) is checked against torch indexing before it is timed.
    BROKEN MODE: a unit wider than the rows (no whole unit in a run, so nothing lands)
    fails that check."""
    from kvferry.engine.tools import gpu_check
    from kvferry.transfer import local_copy

    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    monkeypatch.setattr(gpu_check, "SMALL", True)
    monkeypatch.setattr(gpu_check, "RESULTS", [])
    monkeypatch.setattr(gpu_check, "FAILED", [])
    if broken:
        monkeypatch.setattr(local_copy, "copy_unit", lambda runs: 2048)
    gpu_check.staging_gather_bandwidth(10.0, 1, 1)
    (check,) = [r for r in gpu_check.RESULTS if r["kind"] == "check"]
    (row,) = [r for r in gpu_check.RESULTS if r["kind"] == "staging_gather"]
    assert check["ok"] is not broken
    assert gpu_check.FAILED == (["staging gather of a fan-out's rows"] if broken else [])
    assert row["pieces"] == 1024 and row["piece_bytes"] == 1024 and row["bytes"] == 2 << 20


def _script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "KVFERRY_PYTHON": sys.executable, "PYTHONNOUSERSITE": "1"},
    )


def test_the_tuning_sweep_runs_whole_on_cpu():
    """``--tune --dry-run``: the device sweep's own logic under the interpreter, three
    tunings on two small cases: each checked against the reference, timed, a pick over
    the goal cases, and the pick timed as the main run times the default."""
    proc = _script("--tune", "--dry-run", "--no-transfer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    from kvferry.engine.tools.gpu_tune import DRY_RUN_TUNINGS, SMALL_CASES

    timed = {(r["case"], r["tuning"]) for r in rows if r["kind"] == "tune"}
    cases = {f"{b}x{c}" for b, c in SMALL_CASES}
    assert timed == {(c, t) for c in cases for t in DRY_RUN_TUNINGS}
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] for r in checks)
    (pick,) = [r for r in rows if r["kind"] == "tuned" and r["case"] == "goal cases"]
    assert pick["best"] in DRY_RUN_TUNINGS
    again = {(r["case"], r["impl"]) for r in rows if r["kind"] == "attention"}
    assert again == {
        (c, i)
        for c in cases
        for i in ("triton", "triton+check", "triton+check tiles", "torch gather+sdpa")
    }
    assert all(r["tuning"] == pick["best"] for r in rows if r.get("impl", "").startswith("triton"))
    assert f"best over the goal cases: {pick['best']}" in proc.stdout


def test_a_tuning_that_does_not_parse_is_refused_with_its_form():
    proc = _script("--dry-run", "--tuning", "n64-w4")
    assert proc.returncode == 2 and "n<block_n>-w<warps>" in proc.stderr
    proc = _script("--tune", "--dry-run", "--tunings", "n32-w4-s2-p2-m256")
    assert proc.returncode == 1
    (row,) = [json.loads(x) for x in proc.stdout.splitlines() if '"tunings parse"' in x]
    assert row["ok"] is False and "block_n 32 not in" in row["error"]


def test_the_jit_registers_are_set_beside_the_sm_90_compile():
    """The device run's register comparison, its compile half on CPU: each launched kernel
    (here a stand-in holding the counts a JIT would report) is compiled for sm_90 again and
    one line says whether the counts agree. Runs in a process of its own: the kernels must
    be defined without the interpreter for the compile."""
    pytest.importorskip("triton")
    from kvferry.engine.kernels import aot

    if aot.cuobjdump() is None:
        pytest.skip("no cuobjdump in the Triton wheel or on PATH: registers unknown")
    code = """
import json, types
from kvferry.engine.tools import gpu_check as gc
from kvferry.engine.kernels import aot
from kvferry.engine.kernels.tuning import DEFAULT
want = aot.compile_variant(aot.Variant("decode", "bf16", 128, 4, False)).registers
jit = lambda n: types.SimpleNamespace(n_regs=n, n_spills=0)
gc.compare_registers(
    [(aot.Variant("decode", "bf16", 128, 4, False), jit(want)),
     (aot.Variant("decode", "bf16", 128, 4, True), jit(7))],
    DEFAULT,
)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [(r["variant"], r["equal"]) for r in rows] == [
        ("decode-bf16-d128-g4-nocheck", True),
        ("decode-bf16-d128-g4-check", False),
    ]
    assert rows[1]["jit"] == 7 and rows[1]["aot"] > 7 and rows[1]["tuning"] == "n64-w4-s2-p4-m256"
