#!/usr/bin/env bash
# Run one node of a multi-node kvferry cluster in the foreground, as failure domains: one
# torchrun job per role group on this node, meeting the other nodes' jobs through the
# rendezvous store that node 0 hosts. Ranks follow node order, so the router is on node 0.
#
#   scripts/serve-node.sh --nnodes N --node-rank R (--rdzv-endpoint HOST:PORT | --store etcd://...) [--nproc K] [-- SERVE OPTIONS...]
#
#   --nnodes N             nodes in the cluster
#   --node-rank R          this node's index (0..N-1); node 0 runs the router and the store
#   --rdzv-endpoint H:P    the store's address on node 0, reachable from every node
#   --store etcd://H:P,... an etcd cluster as the store instead (3.4+, run by its operator;
#                          /PREFIX after the hosts keeps clusters apart); its TLS and user
#                          go after -- (--store-ca, --store-cert, --store-key, --store-user,
#                          --store-password-file); no --rdzv-endpoint needed
#   --nproc K              ranks on this node (default 2)
#   --world W              ranks in the whole cluster (default N x K)
#   --first-rank F         this node's first rank (default R x K)
#   --max-restarts M       restarts of a rank that died, per job (default 3)
#   --secret-file FILE     the cluster secret, the same file on every node (make one with
#                          `kvferry secret > FILE`, chmod 600, copy it to each node); needed
#                          with more than one node unless KVFERRY_SECRET_FILE or
#                          KVFERRY_SECRET is set
#   --single-group         the older way: every rank of every node in one torchrun group
#                          (static rendezvous at H:P), which stops as a whole on one death
# Start the same command on every node; options after -- (the same on every node) go to the
# ranks, e.g. `-- --transports rdma --cluster-interface mlx5_0:1,eth1 --host 10.0.0.1
# --api-key-file key.txt`. See `kvferry serve --help` and README, "Threat model".
set -euo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; [ -n "${1:-}" ] && exit 0 || exit 2;; esac
nnodes=""; node_rank=""; endpoint=""; nproc=2; world=""; first=""; restarts=3; single=0
rdzv_id=kvferry; serve_args=(); secret_file=""; store=""
while [ $# -gt 0 ]; do
    case "$1" in
        --nnodes) nnodes="$2"; shift 2;;
        --node-rank) node_rank="$2"; shift 2;;
        --rdzv-endpoint) endpoint="$2"; shift 2;;
        --store) store="$2"; shift 2;;
        --nproc) nproc="$2"; shift 2;;
        --world) world="$2"; shift 2;;
        --first-rank) first="$2"; shift 2;;
        --max-restarts) restarts="$2"; shift 2;;
        --single-group) single=1; shift;;
        --rdzv-id) rdzv_id="$2"; shift 2;;
        --secret-file) secret_file="$2"; shift 2;;
        --) shift; serve_args=("$@"); break;;
        *) echo "serve-node.sh: unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
case "$store" in
    ""|etcd://*) ;;
    *) echo "serve-node.sh: --store takes etcd://HOST:PORT,... (a TCPStore is --rdzv-endpoint)" >&2; exit 2;;
esac
[ -n "$store" ] && [ "$single" = 0 ] && endpoint="${endpoint:-$store}"
for v in nnodes node_rank endpoint; do
    [ -n "${!v}" ] || { echo "serve-node.sh: --${v//_/-} is required (see --help)" >&2; exit 2; }
done
if [ -n "$secret_file" ]; then
    [ -r "$secret_file" ] || { echo "serve-node.sh: cannot read the secret file $secret_file" >&2; exit 2; }
    export KVFERRY_SECRET_FILE="$(cd "$(dirname "$secret_file")" && pwd)/$(basename "$secret_file")"
fi
if [ "$nnodes" -gt 1 ] && [ -z "${KVFERRY_SECRET_FILE:-}" ] && [ -z "${KVFERRY_SECRET:-}" ] \
    && ! printf '%s\n' "${serve_args[@]}" | grep -q -- '^--secret-file'; then
    echo "serve-node.sh: a cluster of $nnodes nodes needs its secret on every node: --secret-file FILE (make one with \`kvferry secret > FILE\`, the same file on each node)" >&2
    exit 2
fi
source "$(dirname "$0")/_env.sh"
if [ "$single" = 1 ]; then
    exec python -m torch.distributed.run --nnodes="$nnodes" --node-rank="$node_rank" \
        --nproc-per-node="$nproc" --rdzv-backend=static --master-addr="${endpoint%:*}" \
        --master-port="${endpoint##*:}" --rdzv-id="$rdzv_id" \
        -m kvferry.cluster.launch "${serve_args[@]}"
fi
world="${world:-$((nnodes * nproc))}"
first="${first:-$((node_rank * nproc))}"
host_store=(); [ "$node_rank" = 0 ] && [ -z "$store" ] && host_store=(--host-store)
exec python -m kvferry.cluster.domains --nproc "$nproc" --world "$world" --first-rank "$first" \
    --store "${store:-$endpoint}" "${host_store[@]}" --max-restarts "$restarts" -- "${serve_args[@]}"
