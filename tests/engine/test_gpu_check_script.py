"""scripts/gpu-check.sh, the device run: on a machine without a CUDA device it says so and
exits 2 (its checks and timings run only on the GPU machine); --help answers."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


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
