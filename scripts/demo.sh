#!/usr/bin/env bash
# The main job: start a local kvferry cluster (replay model), serve a workload of concurrent
# users (each with a unique marker; some over capacity, some cancelled by their client),
# print a table and a JSON line, stop the cluster.
#
#   scripts/demo.sh [--nproc N] [--port P] [WORKLOAD OPTIONS...]
#
#   --nproc N   ranks: 1 router + prefill + decode (default 3)
#   --port P    front door port (default 8100)
# Workload options (see `kvferry workload --help`): --requests, --users, --concurrency, ...
# Exits 0 only if every answer is its own prompt's replay or an error, and no foreign
# marker was found.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
nproc=3; port=8100; workload_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) nproc="$2"; shift 2;;
        --port) port="$2"; shift 2;;
        *) workload_args+=("$1"); shift;;
    esac
done
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
context=4096
run_dir="$KVFERRY_ROOT/runs/demo"
stop() { "$KVFERRY_ROOT/scripts/serve-local.sh" --stop --run-dir "$run_dir" >/dev/null 2>&1 || true; }
trap stop EXIT
stop
url=$("$KVFERRY_ROOT/scripts/serve-local.sh" --nproc "$nproc" --port "$port" --run-dir "$run_dir" \
      -- --context-length "$context" --pool-tokens 32768 --request-timeout 120)
echo "cluster up at $url (log: $run_dir/cluster.log)" >&2
set +e
kvferry workload --url "$url" --context-length "$context" "${workload_args[@]}"
rc=$?
set -e
exit $rc
