"""End to end through a real torchrun cluster on loopback (replay model).

- disaggregated answers equal the monolithic engine's, bit for bit, for concurrent
  requests, with one prefill rank and with a tensor-parallel prefill group of 2;
- an oversize prompt gets 400 with the numbers and no rank allocates a page (I1);
- a page corrupted in flight fails that request with an integrity error and no tokens,
  the others are unaffected (I5, I6); with integrity checks off, the same corruption goes
  through unnoticed, which shows that the check is what catches it.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvferry.cluster.config import ServeConfig
from kvferry.cluster.harness.localcluster import start
from kvferry.cluster.harness.workload import expected_replay, make_prompt
from kvferry.cluster.launch import STATS_INTERVAL_S
from kvferry.cluster.models import monolithic_engine

pytestmark = pytest.mark.slow

CONTEXT = 2048
POOL = 16384
COMMON = ["--context-length", str(CONTEXT), "--pool-tokens", str(POOL), "--request-timeout", "60"]
CORRUPT_MARKER = "@badpg@"
SHORT_MARKER = "@5h0r7@"


def oracle(prompts: list[tuple[str, int]], **overrides) -> list[str]:
    cfg = ServeConfig(context_length=CONTEXT, pool_tokens=POOL, **overrides)
    results = monolithic_engine(cfg).generate([(f"r{i}", p, n) for i, (p, n) in enumerate(prompts)])
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [r.text for r in results]


def workload(n: int) -> list[tuple[str, int]]:
    out = []
    for i in range(n):
        marker = f"@{i:05x}@"
        length = 40 + 97 * i % 700
        out.append((make_prompt(marker, length), length + (i % 3) * 5))
    return out


def run_concurrently(cluster, prompts):
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda pm: cluster.complete(*pm), prompts))


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def reported_metric(cluster, name: str, at_least: float, **labels) -> float:
    """The metric once the ranks' reports show at least ``at_least``, or its value after
    a few report periods: counters kept by the ranks reach /metrics with their next report."""
    deadline = time.monotonic() + 6 * STATS_INTERVAL_S
    while True:
        value = metric(cluster.metrics_text(), name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(STATS_INTERVAL_S / 5)


@pytest.fixture(scope="module")
def p1_cluster(tmp_path_factory):
    c = start(
        3,
        [
            *COMMON,
            "--fault",
            f"corrupt-page:{CORRUPT_MARKER}",
            "--fault",
            f"short-write:{SHORT_MARKER}",
        ],
        tmp_path_factory.mktemp("p1"),
        startup_s=90.0,
    )
    yield c
    c.stop()


def test_disaggregated_equals_monolithic_p1(p1_cluster):
    prompts = workload(12)
    replies = run_concurrently(p1_cluster, prompts)
    assert [r.status for r in replies] == [200] * len(prompts), [
        r.body for r in replies if r.status != 200
    ]
    texts = [r.body["text"] for r in replies]
    assert texts == oracle(prompts)
    assert texts == [expected_replay(p, n) for p, n in prompts]
    assert p1_cluster.quiesce() == 0


def test_oversize_prompt_rejected_before_any_page(p1_cluster):
    assert p1_cluster.quiesce() == 0
    before = p1_cluster.metrics_text()
    prompt = make_prompt("@0vr51@", CONTEXT + 10)
    reply = p1_cluster.complete(prompt, 8)
    assert reply.status == 400
    body = reply.body
    assert body["error"] == "admission_rejected"
    assert body["prompt_tokens"] == CONTEXT + 10 and body["max_tokens"] == 8
    assert body["context_length"] == CONTEXT and body["capacity_tokens"] > 0
    assert str(CONTEXT) in body["message"]
    assert p1_cluster.quiesce() == 0
    st = p1_cluster.status()
    assert all(r["owned"] == 0 and r["quarantined"] == 0 for r in st["ranks"].values())
    assert all(
        r["allocations"] == rb
        for r, rb in zip(st["ranks"].values(), _allocations(before, st), strict=True)
    )
    after = p1_cluster.metrics_text()
    assert (
        metric(after, "kvferry_requests_total", outcome="rejected")
        == metric(before, "kvferry_requests_total", outcome="rejected") + 1
    )


def _allocations(before_metrics: str, status: dict) -> list[int]:
    """Allocation counts per rank from the metrics scraped before the request."""
    return [
        int(metric(before_metrics, "kvferry_page_allocations", rank=rank))
        for rank in status["ranks"]
    ]


def test_corrupted_page_fails_only_its_request(p1_cluster):
    good = workload(4)
    bad = (make_prompt(CORRUPT_MARKER, 300), 300)
    replies = run_concurrently(p1_cluster, good + [bad])
    for (p, n), r in zip(good, replies[:-1], strict=True):
        assert r.status == 200 and r.body["text"] == expected_replay(p, n)
    failed = replies[-1]
    assert failed.status == 500, failed.body
    assert "integrity" in failed.body["message"] and "checksum" in failed.body["message"]
    assert re.search(r"req-[0-9a-f]+-\d+", failed.body["message"])
    assert "text" not in failed.body
    assert reported_metric(p1_cluster, "kvferry_integrity_failures", 1) >= 1
    assert p1_cluster.quiesce() == 0


def _incident(cluster) -> tuple[str, object]:
    """The incident's shape: a request finishes and frees its pages; the next one gets them
    and its writer writes only a 1-page stub while claiming the whole prompt."""
    earlier = make_prompt("@0ld3r@", 400)
    assert cluster.complete(earlier, 400).body["text"] == expected_replay(earlier, 400)
    assert cluster.quiesce() == 0
    stub = make_prompt(SHORT_MARKER, 400)
    return stub, cluster.complete(stub, 400)


def test_short_write_fails_before_decode(p1_cluster):
    """I5: the notice names 1 page for a 400-token prompt; decode refuses it."""
    _, reply = _incident(p1_cluster)
    assert reply.status == 500, reply.body
    assert "integrity" in reply.body["message"] and "needs 25" in reply.body["message"]
    assert "text" not in reply.body
    assert p1_cluster.quiesce() == 0


def test_short_write_leaks_the_earlier_request_without_the_checks(cluster_factory):
    """The broken mode (unsafe: decode skips its checks) answers 200 with the earlier
    request's text: the incident, which the check above is what prevents."""
    c = cluster_factory(
        3, *COMMON, "--unsafe-free-on-abort", "--fault", f"short-write:{SHORT_MARKER}"
    )
    _, reply = _incident(c)
    assert reply.status == 200
    assert "@0ld3r@" in reply.body["text"]


def test_corruption_goes_unnoticed_without_integrity_checks(cluster_factory):
    """The broken mode: with checks off, the corrupted request is answered 200."""
    c = cluster_factory(3, *COMMON, "--no-integrity", "--fault", f"corrupt-page:{CORRUPT_MARKER}")
    prompt = make_prompt(CORRUPT_MARKER, 300)
    reply = c.complete(prompt, 300)
    assert reply.status == 200
    assert reply.body["text"] != expected_replay(prompt, 300)


@pytest.mark.parametrize(
    "kv_heads, tp, writers, model",
    [(3, 2, [1, 2], "replay"), (3, 2, [1, 2], "llama"), (2, 4, [1, 3], "replay")],
    ids=["uneven-3-heads-over-2", "uneven-llama", "gqa-2-heads-over-4"],
)
def test_prefill_groups_whose_size_does_not_divide_the_heads(
    cluster_factory, kv_heads, tp, writers, model
):
    """A group of 2 over 3 KV heads (the second member computes and writes two) and a
    group of 4 over 2 (members share a head; its first holder writes it, the others are
    sent nothing): answers equal the monolithic engine's, and the router's log names the
    writing members only."""
    shape = ["--kv-heads", str(kv_heads), "--q-heads", str(2 * kv_heads), "--model", model]
    c = cluster_factory(2 + tp, *COMMON, "--prefill", str(tp), "--tp", str(tp), *shape)
    prompts = workload(6)
    replies = run_concurrently(c, prompts)
    assert [r.status for r in replies] == [200] * len(prompts), [
        r.body for r in replies if r.status != 200
    ]
    expected = oracle(prompts, kv_heads=kv_heads, q_heads=2 * kv_heads, model=model)
    assert [r.body["text"] for r in replies] == expected
    assert c.quiesce() == 0
    routed = re.findall(r"-> prefill (\[[0-9, ]*\]), decode", c.log.read_text())
    assert len(routed) >= len(prompts) and set(routed) == {str(writers)}


@pytest.mark.parametrize(
    "tp, decode_tp, kv_heads",
    [(1, 2, 4), (2, 2, 3), (1, 4, 2)],
    ids=["llama-1-to-2", "llama-2-to-2-uneven", "llama-1-to-4-shared-heads"],
)
def test_llama_decode_groups_that_split_the_heads(cluster_factory, tp, decode_tp, kv_heads):
    """A decode group whose members each hold a share of a llama model's KV heads: the
    lead steps, every member attends over its own pages for each layer (heads split
    evenly, unevenly, and shared by more members than heads); answers equal the
    monolithic engine's and every page comes back."""
    shape = ["--kv-heads", str(kv_heads), "--q-heads", str(2 * kv_heads), "--model", "llama"]
    c = cluster_factory(
        1 + tp + decode_tp,
        *COMMON,
        "--prefill", str(tp), "--tp", str(tp), "--decode-tp", str(decode_tp), *shape,
    )  # fmt: skip
    prompts = workload(6)
    replies = run_concurrently(c, prompts)
    assert [r.status for r in replies] == [200] * len(prompts), [
        r.body for r in replies if r.status != 200
    ]
    expected = oracle(prompts, kv_heads=kv_heads, q_heads=2 * kv_heads, model="llama")
    assert [r.body["text"] for r in replies] == expected
    assert c.quiesce() == 0


@pytest.mark.parametrize(
    "prefill_page, decode_page, tp", [(16, 32, 1), (64, 16, 2)], ids=["16-to-32", "64-to-16-tp2"]
)
def test_prefill_pages_of_another_size_than_decode(cluster_factory, prefill_page, decode_page, tp):
    """Prefill ranks with pages of another size than the decode rank's: answers equal the
    monolithic engine's; a page corrupted in flight fails its request with the checksum
    of the owner's page that holds it, and a short write fails before decode."""
    c = cluster_factory(
        2 + tp,
        *COMMON,
        "--prefill", str(tp), "--tp", str(tp),
        "--page-size", str(decode_page), "--prefill-page-size", str(prefill_page),
        "--fault", f"corrupt-page:{CORRUPT_MARKER}", "--fault", f"short-write:{SHORT_MARKER}",
    )  # fmt: skip
    prompts = workload(6)
    replies = run_concurrently(c, prompts)
    assert [r.status for r in replies] == [200] * len(prompts), [
        r.body for r in replies if r.status != 200
    ]
    assert [r.body["text"] for r in replies] == oracle(prompts, page_size=decode_page)
    corrupt = c.complete(make_prompt(CORRUPT_MARKER, 300), 300)
    assert corrupt.status == 500 and "checksum mismatch" in corrupt.body["message"]
    short = c.complete(make_prompt(SHORT_MARKER, 300), 300)
    needs = f"needs {-(-300 // decode_page)}"
    assert short.status == 500 and needs in short.body["message"], short.body
    assert c.quiesce() == 0


def test_tensor_parallel_prefill_group_of_two(cluster_factory):
    c = cluster_factory(4, *COMMON, "--prefill", "2", "--tp", "2")
    prompts = workload(8)
    replies = run_concurrently(c, prompts)
    assert [r.status for r in replies] == [200] * len(prompts), [
        r.body for r in replies if r.status != 200
    ]
    assert [r.body["text"] for r in replies] == oracle(prompts)
    assert c.quiesce() == 0
