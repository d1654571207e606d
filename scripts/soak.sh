#!/usr/bin/env bash
# Soak a local cluster: 2,000 requests by default with random client aborts and injected
# control-plane faults; every pool must return to all-free with zero foreign markers.
#
#   scripts/soak.sh [--requests N] [--concurrency C] [--log-dir DIR]
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.soak "$@"
