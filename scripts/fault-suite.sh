#!/usr/bin/env bash
# Run the fault suite: abort sources x protocol points, a stalled, a partitioned and a
# crashed writer, lost, doubled, overtaken and late control messages, and ranks (writer,
# owner, router) killed at each point on a cluster of failure domains, through real local
# clusters (replay model), in normal mode and in unsafe mode.
# The partition row runs a two-node cluster, its decode node in a network namespace behind
# a veth link that goes down mid-transfer: it needs root and iproute2, and is printed as
# skipped (not counted) without them.
#
#   scripts/fault-suite.sh [--no-unsafe] [--only NAME] [--group GROUP] [--log-dir DIR]
#
# Prints one row per scenario, then a JSON line with scenarios, passed, unsafe_scenarios,
# unsafe_leaks_found, served_during_failure (per crash scenario: requests on the healthy
# ranks answered while a rank was down) and front_door_down_s (the router's crash). Exits 0
# only if every scenario passes in normal mode, every mid-transfer scenario leaks in unsafe
# mode (the suite can fail), and every crash scenario served requests meanwhile.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.faultsuite "$@"
