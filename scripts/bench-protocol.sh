#!/usr/bin/env bash
# The protocol's cost on transfer throughput with no aborts: the real prefill and decode
# ranks (stub models, integrity off) against raw engine write + notice, same run, same pages,
# a stream of requests with K in flight; the two alternate over C cycles.
#
#   scripts/bench-protocol.sh [--requests N] [--pages P1,P2,..] [--inflight K] [--cycles C]
#
# Per request size (P pages of 512 KiB; default 32,128,512: 16, 64 and 256 MiB), prints a
# JSON line per case and one with the ratio protocol/raw (goal: >= 0.97). About 1 minute.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.benchprotocol "$@"
