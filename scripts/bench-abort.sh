#!/usr/bin/env bash
# Abort-to-release time with healthy peers (p50/p99), through a real local cluster.
#
#   scripts/bench-abort.sh [--requests N] [--transports shm|tcp]
#
# Prints one JSON line per case: "relay" (the same exchange between the ranks' engines with
# no protocol work: the floor), "quarantined" (every abort waits for the writer's ack),
# "random" (client cancels at a random moment), then the quarantined case over the relay.
# Goal: p99 <= 2 ms on loopback.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.benchabort "$@"
