#!/usr/bin/env bash
# The protocol's cost on transfer throughput with no aborts: the real prefill and decode
# ranks (stub models, integrity off) against raw engine write + notice, same run, same pages.
#
#   scripts/bench-protocol.sh [--requests N] [--pages P] [--inflight K]
#
# Prints one JSON line per case and one with the ratio protocol/raw.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.benchprotocol "$@"
