#!/usr/bin/env bash
# CI: the vLLM connector tests (tests/vllm_connector) against the real vLLM 0.33 on CPU, in their own
# virtualenv so the core suite's .venv does not carry vLLM. Builds the venv from nothing
# when it is missing or its pins changed (a stamp of this file), else reuses it:
#   torch==2.13.0 (the CPU build, from this machine's wheel store; never an unpinned torch),
#   vllm==0.33.0 with --no-deps, then only the light pure-Python requirements vLLM's
#   scheduler and connector API import (pinned below, torch constrained so nothing
#   upgrades it), then kvferry built from a copy of the sources (the build never touches
#   this tree's in-place module, which belongs to .venv).
# KVFERRY_VLLM_VENV: where the venv goes (default .venv-vllm, git-ignored).
# KVFERRY_VLLM_TABLE: where the side-by-side table of the cases goes (default: its log dir).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${KVFERRY_VLLM_VENV:-$ROOT/.venv-vllm}"
WORK="${TMPDIR:-/tmp}/kvferry-vllm-build"
t0=$(date +%s)
say() { echo "vllm: $*" >&2; }

PINS="torch==2.13.0
vllm==0.33.0
aiohttp==3.14.5
blake3==1.0.11
cachetools==8.0.2
cbor2==6.3.0
cloudpickle==3.1.3
einops==0.8.2
fastapi==0.165.0
huggingface_hub==2.4.0
llguidance==1.9.1
msgspec==0.23.0
numpy==2.4.6
openai==3.57.0
oss-harmony==0.0.11
partial-json-parser==0.2.1.1.post7
pillow==13.0.0
prometheus_client==0.26.0
protobuf==7.36.2
psutil==7.2.2
py-cpuinfo==9.0.0
pybase64==1.5.1
pydantic==2.14.4
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
safetensors==0.8.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.20.2
uvloop==0.23.0
xgrammar==0.2.9
msgpack==1.2.4
cffi==2.1.1
cryptography==50.0.2
blake3==1.0.11
libucx-cu12==1.22.0
setuptools==84.2.1
wheel
pytest==9.2.0
pytest-timeout==2.4.0"
STAMP="$( (cat "$0"; python3 --version) | sha1sum | cut -c1-16)"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.kvferry-vllm-stamp" 2>/dev/null)" = "$STAMP" ]; then
    say "reusing $VENV (pins unchanged)"
else
    say "building $VENV from nothing"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    mkdir -p "$WORK"
    LOG="$WORK/pip.log"
    echo "torch==2.13.0" > "$WORK/constraints.txt"
    say "installing torch==2.13.0 (CPU)"
    "$VENV/bin/python" -m pip install -q torch==2.13.0 > "$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
    say "installing vllm==0.33.0 without its dependencies"
    "$VENV/bin/python" -m pip install -q --no-deps vllm==0.33.0 > "$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
    say "installing the light requirements (torch constrained)"
    echo "$PINS" | grep -v -E "^(torch|vllm)==" > "$WORK/requirements.txt"
    "$VENV/bin/python" -m pip install -q -r "$WORK/requirements.txt" -c "$WORK/constraints.txt" \
        > "$LOG" 2>&1 || { tail -30 "$LOG"; exit 1; }
    echo "$STAMP" > "$VENV/.kvferry-vllm-stamp"
fi
"$VENV/bin/python" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'

say "installing kvferry from a copy of the sources"
SRC="$WORK/src"
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"
rm -f "$SRC"/transfer/*.so
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$SRC" \
    > "$WORK/kvferry.log" 2>&1 || { tail -30 "$WORK/kvferry.log"; exit 1; }
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from kvferry.cluster.vllm.connector import KvferryConnector
assert issubclass(KvferryConnector, KVConnectorBase_V1) and issubclass(KvferryConnector, SupportsHMA)
import importlib.metadata as m
eps = [e.value for e in m.entry_points(group="vllm.general_plugins") if e.name == "kvferry"]
assert eps == ["kvferry.cluster.vllm.plugin:register"], eps
print("vllm: connector imports; entry point", eps[0])'
say "setup took $(( $(date +%s) - t0 )) s"

export KVFERRY_VLLM_TABLE="${KVFERRY_VLLM_TABLE:-$WORK/table.jsonl}"
cd "$ROOT/tests/vllm_connector"
rc=0
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" \
    --timeout 600 . || rc=$?
if [ -s "$KVFERRY_VLLM_TABLE" ]; then
    say "the cases side by side ($KVFERRY_VLLM_TABLE):"
    cat "$KVFERRY_VLLM_TABLE" >&2
fi
say "done in $(( $(date +%s) - t0 )) s (rc $rc)"
exit $rc
