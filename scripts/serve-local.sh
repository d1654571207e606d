#!/usr/bin/env bash
# Start a kvferry cluster on this machine, wait until it is healthy, print its URL.
#
#   scripts/serve-local.sh [--nproc N] [--port P] [--run-dir DIR] [-- SERVE OPTIONS...]
#   scripts/serve-local.sh --stop [--run-dir DIR]
#
#   --nproc N        ranks in all: 1 router + prefill + decode (default 3)
#   --port P         front door port on 127.0.0.1 (default 8000)
#   --run-dir DIR    where the log and pid file go (default runs/local)
#   --wait S         seconds to wait for /health (default 120)
#   --max-restarts R restarts of a rank that died, per job (default 3)
#   --single-group   every rank in one torchrun group, which stops as a whole when one
#                    rank dies (default: failure domains, one torchrun job per role group
#                    meeting through a rendezvous store; a dead rank costs its own
#                    requests, is restarted and rejoins with a new incarnation)
#   --stop           stop the cluster started from this run dir: its live requests are
#                    answered 503 at once, and every rank has exited when this returns
# Options after -- go to the ranks (see `kvferry serve --help`), e.g.
#   scripts/serve-local.sh --nproc 4 -- --prefill 2 --tp 2 --context-length 8192
#   scripts/serve-local.sh --nproc 5 -- --prefill 2 --tp 2 --decode-tp 2 --kv-heads 4
#   scripts/serve-local.sh -- --api-key-file key.txt   # the front door wants Bearer <key>
# The cluster secret: --secret-file FILE after --, or KVFERRY_SECRET_FILE / KVFERRY_SECRET;
# when none is given, a fresh one is made for this cluster in RUN_DIR/secret (mode 600).
# Prints the URL on stdout when healthy; exits non-zero, with the log's tail, if it is not.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
nproc=3; port=8000; run_dir=""; wait_s=120; stop=0; single=0; restarts=3; serve_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) nproc="$2"; shift 2;;
        --port) port="$2"; shift 2;;
        --run-dir) run_dir="$2"; shift 2;;
        --wait) wait_s="$2"; shift 2;;
        --stop) stop=1; shift;;
        --single-group) single=1; shift;;
        --max-restarts) restarts="$2"; shift 2;;
        --) shift; serve_args=("$@"); break;;
        *) echo "serve-local.sh: unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
run_dir="${run_dir:-$KVFERRY_ROOT/runs/local}"
mkdir -p "$run_dir"
pidfile="$run_dir/cluster.pid"
# torchrun starts each rank in a session of its own, so the ranks are found by parentage,
# not by process group, and each is waited for.
descendants() { local p; for p in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$p"; descendants "$p"; done; }
# A process that exited but is not reaped yet (a zombie, state Z) has stopped: kill -0 would
# still find it, and its parent (torchrun, or init once torchrun is gone) reaps it later.
alive() {
    local p s n=0
    for p in "$@"; do
        s="$(ps -o stat= -p "$p" 2>/dev/null)" || continue
        [ -n "$s" ] && [ "${s:0:1}" != Z ] && n=$((n + 1))
    done
    echo "$n"
}
if [ "$stop" = 1 ]; then
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        pid="$(cat "$pidfile")"
        procs=("$pid" $(descendants "$pid"))
        # The cluster's launcher stops it in order: the router (which answers its live
        # requests and tells every rank to stop), the other ranks, then the store, which
        # a rank's launcher still needs to publish the rank's exit. Signalled all at once,
        # the store went first and each launcher spent seconds looking for it.
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 150); do [ "$(alive "${procs[@]}")" = 0 ] && break; sleep 0.1; done
        left="$(alive "${procs[@]}")"
        if [ "$left" != 0 ]; then
            echo "serve-local.sh: $left process(es) of cluster $pid still running after 15 s; stopping them" >&2
            kill -TERM "${procs[@]}" 2>/dev/null || true
            for _ in $(seq 50); do [ "$(alive "${procs[@]}")" = 0 ] && break; sleep 0.1; done
        fi
        left="$(alive "${procs[@]}")"
        if [ "$left" != 0 ]; then
            echo "serve-local.sh: $left process(es) of cluster $pid still running; killing them" >&2
            kill -KILL "${procs[@]}" 2>/dev/null || true
            for _ in $(seq 50); do [ "$(alive "${procs[@]}")" = 0 ] && break; sleep 0.1; done
        fi
        echo "stopped cluster $pid (${#procs[@]} processes, all exited)" >&2
    else
        echo "serve-local.sh: no running cluster recorded in $pidfile" >&2
    fi
    rm -f "$pidfile"
    exit 0
fi
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "serve-local.sh: a cluster is already running (pid $(cat "$pidfile")); stop it with --stop" >&2
    exit 1
fi
log="$run_dir/cluster.log"
# The cluster secret: given (a serve option or the environment), or made for this cluster.
given_secret=0
for a in "${serve_args[@]}"; do case "$a" in --secret-file|--secret-file=*) given_secret=1;; esac; done
if [ -n "${KVFERRY_SECRET_FILE:-}" ] || [ -n "${KVFERRY_SECRET:-}" ]; then given_secret=1; fi
if [ "$given_secret" = 0 ]; then
    (umask 077; rm -f "$run_dir/secret"; kvferry secret >"$run_dir/secret")
    export KVFERRY_SECRET_FILE="$run_dir/secret"
fi
if [ "$single" = 1 ]; then
    setsid python -m torch.distributed.run --standalone --nproc-per-node="$nproc" \
        -m kvferry.cluster.launch --port "$port" "${serve_args[@]}" >"$log" 2>&1 &
else
    setsid python -m kvferry.cluster.domains --nproc "$nproc" --max-restarts "$restarts" \
        -- --port "$port" "${serve_args[@]}" >"$log" 2>&1 &
fi
pid=$!
echo "$pid" >"$pidfile"
url="http://127.0.0.1:$port"
deadline=$(( $(date +%s) + wait_s ))
while true; do
    if python - "$url" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).read()
PY
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "serve-local.sh: the cluster exited during start-up:" >&2
        grep -E "error: | ERROR " "$log" | awk '!seen[$0]++' | head -n 4 | sed 's/^/  /' >&2 || true
        echo "last lines of $log:" >&2
        tail -n 12 "$log" >&2; rm -f "$pidfile"; exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "serve-local.sh: not healthy within ${wait_s} s; last lines of $log:" >&2
        tail -n 20 "$log" >&2; kill -TERM "$pid" 2>/dev/null || true; rm -f "$pidfile"; exit 1
    fi
    sleep 0.5
done
mode="failure domains"; [ "$single" = 1 ] && mode="one torchrun group"
echo "kvferry cluster (pid $pid, $nproc ranks, $mode) healthy; log: $log" >&2
echo "$url"
