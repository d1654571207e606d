#!/usr/bin/env bash
# Run one node of a multi-node kvferry cluster in the foreground (torchrun, static rendezvous
# through node 0's store: global ranks follow node order, so the router is on node 0).
#
#   scripts/serve-node.sh --nnodes N --node-rank R --rdzv-endpoint HOST:PORT [--nproc K] [-- SERVE OPTIONS...]
#
#   --nnodes N             nodes in the cluster
#   --node-rank R          this node's index (0..N-1); the router (global rank 0) runs on node 0
#   --rdzv-endpoint H:P    address of node 0's rendezvous store, reachable from every node
#   --nproc K              ranks on this node (default 2)
#   --rdzv-id ID           rendezvous id shared by the nodes (default kvferry)
# Start the same command on every node; options after -- (the same on every node) go to the
# ranks, e.g. `-- --transports tcp --host 0.0.0.0 --port 8000`. See `kvferry serve --help`.
set -euo pipefail
case "${1:-}" in -h|--help|"") sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; [ -n "${1:-}" ] && exit 0 || exit 2;; esac
nnodes=""; node_rank=""; endpoint=""; nproc=2; rdzv_id=kvferry; serve_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nnodes) nnodes="$2"; shift 2;;
        --node-rank) node_rank="$2"; shift 2;;
        --rdzv-endpoint) endpoint="$2"; shift 2;;
        --nproc) nproc="$2"; shift 2;;
        --rdzv-id) rdzv_id="$2"; shift 2;;
        --) shift; serve_args=("$@"); break;;
        *) echo "serve-node.sh: unknown option $1 (see --help)" >&2; exit 2;;
    esac
done
for v in nnodes node_rank endpoint; do
    [ -n "${!v}" ] || { echo "serve-node.sh: --${v//_/-} is required (see --help)" >&2; exit 2; }
done
source "$(dirname "$0")/_env.sh"
exec python -m torch.distributed.run --nnodes="$nnodes" --node-rank="$node_rank" \
    --nproc-per-node="$nproc" --rdzv-backend=static --master-addr="${endpoint%:*}" \
    --master-port="${endpoint##*:}" --rdzv-id="$rdzv_id" \
    -m kvferry.cluster.launch "${serve_args[@]}"
