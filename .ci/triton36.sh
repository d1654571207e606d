#!/usr/bin/env bash
# The kernel checks under Triton 3.6 (the lent GPU machine's version): the sm_90 compile
# of the device table's variants with their register counts, and of every compile point of
# the tuning sweep (fails on a spill), then the interpreter tests against the torch
# references. Runs after scripts/test.sh, which made .venv.
#   .ci/triton36.sh            run them
#   .ci/triton36.sh -k NAME    extra arguments go to pytest
# A venv of its own (.venv/triton36) holds triton==3.6.0 and numpy<2.4 (Triton 3.6's
# interpreter fails with numpy 2.4 on a 1-element loop bound) and reaches torch, pytest
# and kvferry through .venv's site-packages, which come after its own on sys.path.
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
MAIN="${KVFERRY_VENV:-$ROOT/.venv}"
VENV="${KVFERRY_TRITON36_VENV:-$MAIN/triton36}"
[ -x "$MAIN/bin/python" ] || { echo "triton36: $MAIN missing; run scripts/test.sh first" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
    "$MAIN/bin/python" -m venv "$VENV"
fi
have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("triton"), m.version("numpy"))' 2>/dev/null || true)"
case "$have" in
    "3.6.0 2.3."* | "3.6.0 2.2."* | "3.6.0 2.1."* | "3.6.0 2.0."* | "3.6.0 1."*) ;;
    *) "$VENV/bin/python" -m pip install -q --disable-pip-version-check "triton==3.6.0" "numpy<2.4" >&2 ;;
esac
main_site="$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
own_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$main_site')" > "$own_site/kvferry-main-venv.pth"
"$VENV/bin/python" - <<'EOF'
import numpy, torch, triton, kvferry.engine
assert triton.__version__ == "3.6.0", triton.__version__
print(f"triton36: triton {triton.__version__}, numpy {numpy.__version__}, torch {torch.__version__}", flush=True)
EOF
cd "$ROOT"
env -u TRITON_INTERPRET "$VENV/bin/python" -m kvferry.engine.kernels.aot --only decode-bf16-d128-g4 --jobs 2
env -u TRITON_INTERPRET "$VENV/bin/python" -m kvferry.engine.kernels.aot --sweep --jobs 2
"$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider -W ignore::DeprecationWarning tests/engine/test_kernels_interpret.py "$@"
