#!/usr/bin/env bash
# A llama decode group that splits the KV heads against one decode rank holding every
# head: ms per answer token (the decode step) and time to first token, in alternating
# rounds through real local clusters, every answer checked against the monolithic engine.
#
#   scripts/bench-decode-groups.sh [--decode-tp N] [--rounds R] [--requests K]
#                                  [--prompt P] [--tokens T] [--layers L]
#
# Prints one JSON line per case and round, then the round's ratio (group_over_single).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.benchgroups "$@"
