#!/usr/bin/env bash
# The device run of the GPU kernels (paged decode attention with the ownership check,
# checksums): builds them, checks them against the torch references on fresh random
# inputs, times them against a device-to-device copy and torch baselines; JSON lines
# first, a table last, within 5 minutes. Exit 0 when every check passed, 1 when one
# failed, 2 on a machine without a CUDA device.
#   scripts/gpu-check.sh                 checks and timings
#   scripts/gpu-check.sh --checks-only   correctness only
#   scripts/gpu-check.sh --no-flex       skip the FlexAttention baseline (compiles on first use)
#   scripts/gpu-check.sh --help-python   the Python options (--budget, --iters, --seed, ...)
# Python: $KVFERRY_PYTHON, else .venv/bin/python when it has torch, else python3. Needs
# torch and triton; kvferry itself comes from this checkout (no install).
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${KVFERRY_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c 'import torch' 2>/dev/null; then
        PY="$ROOT/.venv/bin/python"
    else
        PY=python3
    fi
fi
if [ "${1:-}" = "--help-python" ]; then
    shift; set -- --help "$@"
fi
# kvferry.engine from this checkout: a namespace folder that points at engine/.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/kvferry"
ln -s "$ROOT/engine" "$SHIM/kvferry/engine"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
unset TRITON_INTERPRET
status=0
timeout --signal=INT --kill-after=10 290 "$PY" "$ROOT/scripts/gpu_check.py" "$@" || status=$?
if [ "$status" = 124 ]; then
    echo "gpu-check: stopped at the 290 s limit" >&2
fi
exit "$status"
