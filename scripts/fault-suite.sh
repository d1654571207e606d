#!/usr/bin/env bash
# Run the fault suite: abort sources x protocol points, a stalled, a partitioned and a
# crashed writer, through real local clusters (replay model), in normal mode and in unsafe mode.
# The partition row runs a two-node cluster, its decode node in a network namespace behind
# a veth link that goes down mid-transfer: it needs root and iproute2, and is printed as
# skipped (not counted) without them.
#
#   scripts/fault-suite.sh [--no-unsafe] [--only NAME] [--log-dir DIR]
#
# Prints one row per scenario, then a JSON line with scenarios, passed, unsafe_scenarios,
# unsafe_leaks_found. Exits 0 only if every scenario passes in normal mode and every
# mid-transfer scenario leaks in unsafe mode (the suite can fail).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.faultsuite "$@"
