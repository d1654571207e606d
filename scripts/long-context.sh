#!/usr/bin/env bash
# The long-context check: prompts of 681,281 and 1,048,000 tokens at context 1,048,576 and
# 2,097,152, 70,000 at page size 1, and one past each pool, through local clusters (replay
# model, shrunk). Each answered with its own text or refused with 400; pools all-free after.
# JSON lines (timings per prompt; beside each served one, the raw engine write of its KV
# bytes and ttft_over_machine = ttft / max(prefill, raw write); a decode step beside the
# model's attention alone over as long a context), exit 1 if any check fails.
#
#   scripts/long-context.sh [--only 1m|2m|page1] [--shape shrunk|serve|realistic]
#                           [--prompts N,N --context-length C] [--decode-tp N]
#                           [--kv-layout HND|NHD:HND|NHD] [--no-raw] [--log-dir DIR]
# e.g. the serve defaults' goal figure at 1,048,000 and 1,100,000 tokens:
#   scripts/long-context.sh --shape serve --prompts 1048000,1100000 --context-length 1114112
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
source "$(dirname "$0")/_env.sh"
# One machine: UCX's tcp transport stays on loopback unless told otherwise.
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
exec python -m kvferry.cluster.harness.longcontext "$@"
