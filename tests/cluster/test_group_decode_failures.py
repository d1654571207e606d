"""A llama decode group that splits the KV heads loses a member or its lead mid-decode.

Failure domains on this host (a prefill rank, a decode group of two, each rank its own
job). Request A's prompt length names it to the ``owner-decode`` fault of one decode
rank, which SIGKILLs itself in A's decode step: the lead in its step, or the member in
its share of the lead's first layer. A fails with an error within its deadline (the
lead's reply deadline, or the router's view of the dead rank, ending the whole group),
nothing stays held on any rank, the killed rank is restarted and rejoins, and a request
of another length is then answered with the monolithic engine's text.

Every wait is on an event (a /status field, the front door's answer), each with its
deadline.
"""

from __future__ import annotations

import time

import pytest

from kvferry.cluster.config import ServeConfig
from kvferry.cluster.harness import localcluster
from kvferry.cluster.harness.workload import make_prompt
from kvferry.cluster.models import monolithic_engine

CONTEXT = 2048
POOL = 8192
KILLED_LEN = 320  # A's prompt length: the fault's label ("prompt_len=320")
SERVED_LEN = 300
SHAPE = ["--model", "llama", "--kv-heads", "4", "--q-heads", "8"]
ARGS = [
    "--context-length", str(CONTEXT), "--pool-tokens", str(POOL),
    "--transfer-timeout", "2", "--abort-deadline", "2", "--request-timeout", "30",
    "--decode-tp", "2", *SHAPE,
]  # fmt: skip
LEAD, MEMBER = 2, 3  # rank 0 routes, rank 1 prefills, ranks 2 and 3 are the decode group


def _oracle(prompt: str, max_tokens: int) -> str:
    cfg = ServeConfig(
        context_length=CONTEXT, pool_tokens=POOL, model="llama", kv_heads=4, q_heads=8
    )
    (result,) = monolithic_engine(cfg).generate([("r", prompt, max_tokens)])
    assert result.ok, result.error
    return result.text


@pytest.mark.slow
@pytest.mark.parametrize("killed", [MEMBER, LEAD], ids=["member", "lead"])
def test_a_decode_group_rank_killed_mid_decode_fails_its_request_and_holds_nothing(
    tmp_path, killed
):
    fault = f"rank={killed}:at:owner-decode:kill:prompt_len={KILLED_LEN}"
    cluster = localcluster.start_domains(1, 2, [*ARGS, "--fault", fault], tmp_path, max_restarts=2)
    try:
        old = cluster.incarnation_of(killed)
        started = time.monotonic()
        a = cluster.complete(make_prompt("@k1ll@", KILLED_LEN), 40, timeout=60)
        assert a.status >= 500, a.body
        assert f"rank {killed} lost: exited" in a.body["message"], a.body
        assert time.monotonic() - started < 30, "A outlived its deadline"
        assert "text" not in a.body
        cluster.wait_rejoined(killed, old, 90)
        cluster.wait_status(lambda s: not s["unhealthy"], "every rank healthy", 60)
        prompt = make_prompt("@53rv3d@", SERVED_LEN)
        b = cluster.complete(prompt, 24, timeout=60)
        assert b.status == 200, b.body
        assert b.body["text"] == _oracle(prompt, 24)
        assert cluster.quiesce(every_rank=True) == 0
    finally:
        cluster.stop()
