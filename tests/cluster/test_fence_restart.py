"""A writer severed for a late ack is fenced by restart, and the service recovers by itself.

Failure domains on this host (one prefill, one decode). Request A's writer SIGSTOPs itself
mid-transfer for longer than the transfer timeout plus the abort deadline: the owner
times A out, quarantines its pages, and severs the silent writer at the deadline. With
``--fence-severed restart`` (the default) the router orders the writer's launcher to kill
it: the owner releases A's pages on that proof (the process is gone), torchrun restarts
the writer, the new incarnation is admitted, and request B is served with its own text.
The broken mode, ``--fence-severed off``, is the cluster as it was: the writer resumes,
acks late (A's pages are released on the ack), and stays severed, so B gets 503.

Every wait is on an event (a log line, a field of /status), each with its deadline.
"""

from __future__ import annotations

import re

import pytest

from kvferry.cluster.harness import localcluster
from kvferry.cluster.harness.faultsuite import expected_replay, post
from kvferry.cluster.harness.workload import make_prompt

TAG = "~fence-me~"
TRANSFER_TIMEOUT_S = 1.0
ABORT_DEADLINE_S = 2.0
STOP_S = 12  # the writer stays stopped well past the sever (about 3 s after A starts)
ARGS = [
    "--context-length",
    "2048",
    "--pool-tokens",
    "8192",
    "--transfer-timeout",
    str(TRANSFER_TIMEOUT_S),
    "--abort-deadline",
    str(ABORT_DEADLINE_S),
    "--fault",
    f"at:mid-transfer:stop:{TAG}:{STOP_S}",
]
WRITER = 1  # rank 0 routes, rank 1 prefills, rank 2 decodes


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["restart", "off"])
def test_a_writer_severed_for_a_late_ack_is_restarted_and_the_service_recovers(tmp_path, policy):
    cluster = localcluster.start_domains(
        1, 1, [*ARGS, "--fence-severed", policy], tmp_path, max_restarts=2
    )
    try:
        tail = localcluster.LogTail.at_end(cluster.log)
        status_a, body_a, _ = post(cluster, TAG + make_prompt("@0fe0a@", 256), 8, None)
        assert status_a != 200, body_a  # its writer stopped mid-transfer: A fails
        tail.wait_for(rf"writers \[{WRITER}\] .*severing them", 15)
        if policy == "restart":
            tail.wait_for(rf"rank {WRITER} \(pid \d+, incarnation \S+\) fenced: ", 10)
            cluster.wait_status(
                lambda s: s["rejoined"] >= 1 and not s["unhealthy"] and not s["severed"],
                "the fenced writer rejoined",
                60,
            )
            assert cluster.status()["fences_ordered"] == 1
            releases = cluster.releases()
            assert releases.get("process-gone", 0) >= 1, releases  # A's pages, on the kill
            prompt_b = make_prompt("@0fe0b@", 256)
            status_b, body_b, _ = post(cluster, prompt_b, 8, None)
            assert status_b == 200, body_b
            assert body_b["text"] == expected_replay(prompt_b, 8)
        else:
            # the writer resumes at STOP_S, acks late, A's pages are released on the ack
            tail.wait_for(r"pages released \(\S+; proof: [^)]*acked", STOP_S + 10)
            status = cluster.status()
            assert status["severed"] == [WRITER] and status["fences_ordered"] == 0, status
            status_b, body_b, _ = post(cluster, make_prompt("@0fe0b@", 256), 8, None)
            assert status_b == 503, body_b
            assert re.search("no healthy prefill rank", str(body_b)), body_b
        assert cluster.quiesce(10) == 0
    finally:
        cluster.stop()
