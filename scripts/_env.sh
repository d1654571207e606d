# Sourced by the other scripts: makes sure .venv holds kvferry and what it needs,
# then puts it first on PATH. Re-installs only when pyproject.toml or setup.py changed.
set -euo pipefail
KVFERRY_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVFERRY_VENV="${KVFERRY_VENV:-$KVFERRY_ROOT/.venv}"
_kvferry_stamp() { cat "$KVFERRY_ROOT/pyproject.toml" "$KVFERRY_ROOT/setup.py" "$KVFERRY_ROOT"/transfer/native/* 2>/dev/null | sha1sum | cut -c1-16; }
if [ ! -x "$KVFERRY_VENV/bin/python" ]; then
    echo "kvferry: creating $KVFERRY_VENV" >&2
    python3 -m venv "$KVFERRY_VENV"
fi
if [ "$(cat "$KVFERRY_VENV/.kvferry-stamp" 2>/dev/null)" != "$(_kvferry_stamp)" ]; then
    echo "kvferry: installing into $KVFERRY_VENV (torch pinned to the CPU build 2.13.0 unless KVFERRY_TORCH says otherwise)" >&2
    "$KVFERRY_VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$KVFERRY_VENV/bin/python" -m pip install -q "${KVFERRY_TORCH:-torch==2.13.0}" >&2
    "$KVFERRY_VENV/bin/python" -m pip install -q -e "$KVFERRY_ROOT[test]" >&2
    _kvferry_stamp > "$KVFERRY_VENV/.kvferry-stamp"
fi
export PATH="$KVFERRY_VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
