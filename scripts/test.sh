#!/usr/bin/env bash
# Runs kvferry's test suite: unit, property, multi-process and fault tests.
#   scripts/test.sh            all tests
#   scripts/test.sh -k NAME    extra arguments go to pytest
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
cd "$KVFERRY_ROOT"
exec python -m pytest -q -ra "$@"
