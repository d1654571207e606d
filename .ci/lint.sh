#!/usr/bin/env bash
# The static checks, configured in pyproject.toml: ruff's formatter (check only, it rewrites
# nothing), ruff's linter, and mypy (strict for kvferry.transfer and kvferry.engine). Each
# runs from the repo root with .venv's tools, even when an earlier one fails; exits 1 if
# any failed. Runs after scripts/test.sh, which made .venv; installs the ruff and mypy
# pinned in pyproject.toml's test extra when .venv has other versions.
#   .ci/lint.sh            run all three
#   .ci/lint.sh PATH...    ruff on these paths only (mypy always checks the packages)
set -uo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${KVFERRY_VENV:-$ROOT/.venv}"
[ -x "$VENV/bin/python" ] || { echo "lint: $VENV missing; run scripts/test.sh first" >&2; exit 1; }
# The test extra's ruff and mypy pins that .venv does not match, one a line.
missing="$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import tomllib

with open("pyproject.toml", "rb") as f:
    test = tomllib.load(f)["project"]["optional-dependencies"]["test"]
for req in test:
    name, _, version = req.partition("==")
    if name in ("ruff", "mypy"):
        try:
            ok = m.version(name) == version
        except m.PackageNotFoundError:
            ok = False
        if not ok:
            print(req)
EOF
)" || exit 1
if [ -n "$missing" ]; then
    # shellcheck disable=SC2086  # one requirement a word
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $missing >&2 || exit 1
fi
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(.)
failed=()
step() {
    echo "+ $*" >&2
    "$@" || failed+=("$*")
}
step "$VENV/bin/ruff" format --check "${paths[@]}"
step "$VENV/bin/ruff" check "${paths[@]}"
step "$VENV/bin/mypy"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'lint: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "lint: ruff format --check, ruff check and mypy passed" >&2
