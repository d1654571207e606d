#!/usr/bin/env bash
# Transfer benchmark: two processes on this host over shared memory and tcp; prints one
# JSON line per result (engine, transport, op, pages, page_bytes, gbps; p50_us/p99_us for
# the write+notify latency, pages checked byte-exact at the target; memcpy ceiling lines;
# the CPU cost of one write+notify in-process; the idle target's CPU use; the host load;
# KV-shaped bursts against a bulk write of the same bytes; every row byte-checked).
#   scripts/bench-transfer.sh                    everything
#   scripts/bench-transfer.sh --transports shm   extra arguments go to kvferry.transfer.tools.bench_transfer
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    echo
    source "$(dirname "$0")/_env.sh"
    exec python -m kvferry.transfer.tools.bench_transfer --help
fi
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
cd "$KVFERRY_ROOT"
exec python -m kvferry.transfer.tools.bench_transfer "$@"
