#!/usr/bin/env bash
# Discrete-event simulation of the abort protocol at 10x10, 100x100 and 1000x1000 ranks,
# with the ranks' own code (the protocol core's tables, the real page allocator).
#
#   scripts/simulate.sh [--scale 10x10,100x100,1000x1000|all] [--scenario steady,storm,partition,partition-long,crash,slow|all]
#                       [--mode safe,unsafe,release-on-sever|all] [--requests N] [--seed S] [--network local|local-tcp|datacentre]
#                       [--no-service-model] [--partition-deadlines N] [--failure-horizon S]
#   scripts/simulate.sh --calibrate                          # measure the service model's figures here
#   scripts/simulate.sh --validate [--validate-requests N]   # 1x1 and 2x2 against the real local cluster
#
# Prints one JSON line per scenario, then a table. With no options, runs them all.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# --validate starts real local clusters: UCX's tcp transport stays on loopback.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.simulate "$@"
