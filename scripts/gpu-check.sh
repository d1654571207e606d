#!/usr/bin/env bash
# The device run of the GPU kernels (paged decode attention with the ownership check,
# checksums) and of GPU page transfer between two processes: builds, checks against the
# torch references on fresh random inputs, times against a device-to-device copy and torch
# baselines; JSON lines first, a table last, within 5 minutes. Exit 0 when every check
# passed, 1 when one failed, 2 on a machine without a CUDA device.
#   scripts/gpu-check.sh                 checks and timings
#   scripts/gpu-check.sh --checks-only   correctness only
#   scripts/gpu-check.sh --no-flex       skip the FlexAttention baseline (compiles on first use)
#   scripts/gpu-check.sh --dry-run       no GPU: the whole script on CPU, small shapes
#   scripts/gpu-check.sh --tune          the decode kernel's tuning sweep instead: each tuning
#                                        checked, timed on the goal cases, the best timed as
#                                        the main run times the default (--tunings A,B: those)
#   scripts/gpu-check.sh --tuning NAME   the main run at another tuning (n128-w4-s3-p2-m256)
#   scripts/gpu-check.sh --help-python   the Python options (--budget, --iters, --seed, ...)
# Python: $KVFERRY_PYTHON, else .venv/bin/python when it has torch, else python3. Needs
# torch and triton; kvferry comes from this checkout (no install): transfer/, engine/ and
# cluster/ as kvferry.*. The page transfer needs transfer/_ucp.abi3.so (built here) and,
# where they are missing, the wheels in .whl/ (libucx-cu13, cffi): installed into a
# temporary folder first.
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0
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
# kvferry from this checkout: a namespace folder whose packages point at the sources.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/kvferry"
for pkg in transfer engine cluster; do
    ln -s "$ROOT/$pkg" "$SHIM/kvferry/$pkg"
done
SITE=""
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 && ! "$PY" -c 'import cffi, libucx' 2>/dev/null; then
    SITE="$SHIM/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$ROOT"/.whl/*.whl >&2 || echo "gpu-check: installing .whl/ failed" >&2
fi
export PYTHONPATH="$SHIM${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
unset TRITON_INTERPRET
status=0
cd "$SHIM"  # kvferry from the shim, not from a folder of the same name
timeout --signal=INT --kill-after=10 290 "$PY" -m kvferry.engine.tools.gpu_check "$@" || status=$?
if [ "$status" = 124 ]; then
    echo "gpu-check: stopped at the 290 s limit" >&2
fi
exit "$status"
