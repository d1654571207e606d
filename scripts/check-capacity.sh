#!/usr/bin/env bash
# Ask every rank of a live kvferry cluster for its measured KV pool capacity and the
# declared context length; print a table; exit 1 if any rank holds fewer tokens.
#
#   scripts/check-capacity.sh [--url http://127.0.0.1:8000] [--json] [--api-key-file FILE]
#
# To check a pool shape before starting a cluster, use
#   kvferry check-capacity --context-length N --pool-tokens M [shape options]
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
exec kvferry cluster-capacity "$@"
