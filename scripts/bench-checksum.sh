#!/usr/bin/env bash
# Page checksum benchmark on the CPU: prints one JSON line per pool and page size (pool_mib,
# page_kib, memcpy_gbps of a torch copy_ of the same bytes, native_gbps, reference_gbps,
# native_over_memcpy: the goal is >= 0.5; agree: native == reference), after a host-load line.
#   scripts/bench-checksum.sh                              64 and 256 MiB pools, 16 and 256 KiB pages
#   scripts/bench-checksum.sh --pool-mib 256 --reps 9      extra arguments go to kvferry.engine.tools.bench_checksum
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    echo
    source "$(dirname "$0")/_env.sh"
    exec python -m kvferry.engine.tools.bench_checksum --help
fi
source "$(dirname "$0")/_env.sh"
cd "$KVFERRY_ROOT"
exec python -m kvferry.engine.tools.bench_checksum "$@"
