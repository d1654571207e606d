#!/usr/bin/env bash
# The vLLM connector's data path between engines of different shapes (TP sizes, block sizes,
# HND/NHD layouts) against the homogeneous pair of the same bytes, over the transfer engine,
# timed in alternation; one JSON line per pair (gbps, homogeneous_gbps, ratio: the goal is
# >= 0.9; plan_ms; runs and mean_run_bytes; bytes_checked), after a host-load line.
#   scripts/bench-pairs.sh                              11 pairs, 16,384 tokens of 8 layers x 8 heads x 128 bf16
#   scripts/bench-pairs.sh --tokens 8192 --only tp2     extra arguments go to kvferry.cluster.harness.benchpairs
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    echo
    source "$(dirname "$0")/_env.sh"
    exec python -m kvferry.cluster.harness.benchpairs --help
fi
source "$(dirname "$0")/_env.sh"
cd "$KVFERRY_ROOT"
exec python -m kvferry.cluster.harness.benchpairs "$@"
