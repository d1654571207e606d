"""A rank's large transient buffers (a long prompt's PREFILL chunks, PLAN and NOTICE) are
reused from the heap instead of being mapped afresh and faulted in page by page each time
(cluster/heap.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvferry.cluster.heap import OPERATOR_VARIABLES, keep_freed_buffers

# A message's life at a rank, as the control path allocates it: the encoded bytes, the
# sealed copy, the opened body (a slice), each freed before the next message.
_MESSAGES = """
import json, resource, sys
from kvferry.cluster.heap import keep_freed_buffers
applied = keep_freed_buffers({}).applied if sys.argv[1] == "tuned" else False
size = 2 << 20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
encoded = b"x" * size; sealed = encoded + b"t" * 16; body = sealed[:-16]
del encoded, sealed, body
before = faults()
for i in range(20):
    encoded = bytes([i]) * size; sealed = encoded + b"t" * 16; body = sealed[:-16]
    del encoded, sealed, body
print(json.dumps({"applied": applied, "faults_per_mib": (faults() - before) / 20 / 3 / 2}))
"""


def _faults_per_mib(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MESSAGES, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_a_freed_message_buffer_is_reused_not_faulted_in_again():
    tuned = _faults_per_mib("tuned")
    untuned = _faults_per_mib("untuned")  # the broken mode: glibc's own thresholds
    assert tuned["applied"], tuned
    # 256 pages per MiB: untuned, most are faulted in again for every message
    assert untuned["faults_per_mib"] > 100, untuned
    assert tuned["faults_per_mib"] < untuned["faults_per_mib"] / 4, (tuned, untuned)


# The first message after a rank's start, before any was freed.
_FIRST = """
import json, resource, sys
from kvferry.cluster.heap import WARM_BYTES, keep_freed_buffers
keep_freed_buffers({}, warm_bytes=WARM_BYTES if sys.argv[1] == "warmed" else 0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
encoded = b"x" * (2 << 20); sealed = encoded + b"t" * 16; body = sealed[:-16]
print(json.dumps({"faults_per_mib": (faults() - before) / 6}))
"""


def test_the_first_message_after_start_finds_its_pages_in_place():
    def first(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _FIRST, mode], capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)["faults_per_mib"]

    warmed, cold = first("warmed"), first("cold")  # cold: the broken mode, nothing written
    assert cold > 100, cold
    assert warmed < cold / 4, (warmed, cold)


def test_thresholds_an_operator_set_are_kept():
    for name in OPERATOR_VARIABLES:
        tuning = keep_freed_buffers({name: "1048576"})
        assert not tuning.applied
        assert name in tuning.describe()
