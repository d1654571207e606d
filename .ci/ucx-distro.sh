#!/usr/bin/env bash
# CI: builds kvferry against the distribution's UCX (Debian's libucx-dev, UCX 1.13 with
# verbs) in a separate virtualenv, then runs the transfer tests and one cluster test over
# it, and checks that --transports rdma is refused naming what is missing (this machine
# has no RDMA NIC).
# The default environment (.venv, the libucx wheel) is left as it is.
# Needs root for apt-get. KVFERRY_DISTRO_VENV: where the venv goes (default below).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${KVFERRY_DISTRO_VENV:-/tmp/kvferry-ucx-distro/venv}"
SRC="$(dirname "$VENV")/src"
export DEBIAN_FRONTEND=noninteractive

echo "ucx-distro: installing Debian's libucx-dev" >&2
apt-get update -qq
apt-get install -y -qq libucx-dev pkg-config >/dev/null
echo "ucx-distro: system UCX $(pkg-config --modversion ucx)" >&2

# A copy of the sources (tracked and new files): the build never touches this tree's
# in-place module, which belongs to .venv.
rm -rf "$SRC" "$VENV"
mkdir -p "$SRC"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"

python3 -m venv "$VENV"
PY="$VENV/bin/python"
LOG="$(dirname "$VENV")/pip.log"
# Build tools and what the transfer tests import (no torch: they do not need it); the
# libucx wheel only so the tests of the default choice run here too.
"$PY" -m pip install -q --upgrade pip "setuptools>=77" wheel "cffi>=1.17" "numpy>=1.26" \
    "msgpack>=1.0" "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.3" \
    "libucx-cu12>=1.18,<2" > "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
KVFERRY_UCX=system "$PY" -m pip install -v --no-deps --no-build-isolation "$SRC" \
    > "$LOG" 2>&1 || { grep -E "kvferry: |error" "$LOG" | tail -40; exit 1; }
grep -hE "^ *kvferry: " "$LOG" | sort -u | sed 's/^ */ucx-distro: build: /' >&2

cd "$SRC"
rc=0
"$PY" -m kvferry.transfer --transports rdma > info.json || rc=$?
"$PY" - info.json "$rc" <<'PYEOF'
import json, subprocess, sys
info, rc = json.load(open(sys.argv[1])), int(sys.argv[2])
system = subprocess.run(["pkg-config", "--modversion", "ucx"], capture_output=True,
                        text=True).stdout.strip()
print(f"ucx-distro: {info['ucx']}; verbs compiled in: {info['verbs']}; "
      f"unavailable: {info['unavailable']}", file=sys.stderr)
assert info["running"] == system, (info["running"], system)
assert "KVFERRY_UCX=system" in info["build"], info["build"]
assert info["verbs"], "the distribution's UCX should have its verbs component"
if info["rdma_transports"]:
    assert rc == 0 and info["rdma_refused"] is None, info
else:
    assert rc == 2 and "no RDMA device" in info["rdma_refused"], (rc, info["rdma_refused"])
    print(f"ucx-distro: --transports rdma refused: {info['rdma_refused']}", file=sys.stderr)
PYEOF
"$PY" -m pytest -q -p no:cacheprovider tests/transfer
echo "ucx-distro: transfer tests passed against UCX $(pkg-config --modversion ucx)" >&2

# One cluster test over it too: a torchrun cluster (router, prefill, decode over shared
# memory on loopback) serving concurrent requests, checked against the monolithic engine.
# Its runtime dependencies come from pyproject.toml itself (torch pinned to the CPU build),
# so a dependency added there cannot be missed here.
mapfile -t DEPS < <("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import sys, tomllib
for dep in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    print("torch==2.13.0" if dep.startswith("torch") else dep)
PYEOF
)
"$PY" -m pip install -q "${DEPS[@]}" > "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" "$PY" -m pytest -q -p no:cacheprovider \
    "tests/cluster/test_serving.py::test_disaggregated_equals_monolithic_p1"
echo "ucx-distro: a cluster served over UCX $(pkg-config --modversion ucx)" >&2
