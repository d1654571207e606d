"""The fault suite: abort sources x protocol points through a real local cluster.

Every scenario sends a request A whose prompt carries a fault tag (the ranks were started
with the matching ``--fault`` hooks, see :mod:`.faults`) and a unique marker, lets the
fault and the abort play out, then sends a victim request B of the same size with another
marker. B is the request that would be handed A's pages if they were released too early;
a write of A that lands late would then show up as A's marker in B's answer.

Each scenario asserts: no answer holds another request's marker; every request is
answered (text or error) within its deadline; no page is held on any rank after quiesce;
and the cluster's counters moved as expected. In unsafe mode every mid-transfer scenario
must leak, which shows the suite can fail: pages freed at abort (``--unsafe-free-on-abort``)
for the abort sources, and released at the deadline once the writer is severed, without
proof (``--unsafe-release-on-sever``), for the stalled writer.

Matrix (source x point; cells that cannot happen are not run):

    client      before-write, mid-transfer, after-write, after-notice
    admission   before-write (prompt over the context length: 400, nothing allocated)
    prefill     before-write, mid-transfer, after-write
    transfer    before-write, mid-transfer, after-write
    decode      before-write, mid-transfer, after-write  (writer too slow: decode times out)
    integrity   after-notice (a page corrupted in flight)
    crash       mid-transfer (the writer is SIGKILLed; a second prefill rank serves B)
    stall       mid-transfer (the writer is SIGSTOPped past the abort deadline, then resumes
                and its in-flight write lands: the owner severed it at the deadline, but
                releases only on its late ack or its death)

Prints a table, then one JSON line (the last line) with ``scenarios``, ``passed``,
``unsafe_scenarios``, ``unsafe_leaks_found``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from . import localcluster
from .localcluster import LocalCluster
from .workload import MARKER_RE, expected_replay, make_prompt

CONTEXT = 2048
STALL_STEP_S = 0.01   # the stall group decodes slowly: the victim still reads the prompt
                      # pages when the resumed writer's in-flight write lands
PROMPT = 320
TRANSFER_TIMEOUT = 1.0
ABORT_DEADLINE = 2.0
REQUEST_TIMEOUT = 20.0
HOLD_S = 3.0          # how long an injected in-flight write stays in flight
CLIENT_CANCEL_S = 0.4

POINTS = ("before-write", "mid-transfer", "after-write", "after-notice")


@dataclass(frozen=True)
class Scenario:
    source: str
    point: str
    faults: tuple[str, ...]          # --fault hooks this scenario needs on the cluster
    cancel_after: float | None = None
    max_tokens: int = PROMPT
    expect_a: str = "error"          # error | any (the client may win the race) | rejected
    group: str = "main"              # which cluster runs it

    @property
    def name(self) -> str:
        return f"{self.source}@{self.point}"

    @property
    def tag(self) -> str:
        return f"~{self.source}.{self.point}~"

    @property
    def mid_transfer(self) -> bool:
        return self.point == "mid-transfer"


def scenarios() -> list[Scenario]:
    out: list[Scenario] = []

    def tag(source: str, point: str) -> str:
        return f"~{source}.{point}~"

    for point in POINTS:
        t = tag("client", point)
        if point == "after-notice":
            out.append(Scenario("client", point, (), CLIENT_CANCEL_S, max_tokens=1700, expect_a="any"))
        else:
            out.append(Scenario("client", point, (f"at:{point}:pause:{t}:{HOLD_S}",), CLIENT_CANCEL_S))
    out.append(Scenario("admission", "before-write", (), expect_a="rejected"))
    for source, action in (("prefill", "fail-prefill"), ("transfer", "fail-transfer"),
                           ("decode", "pause")):
        for point in POINTS[:3]:
            t = tag(source, point)
            out.append(Scenario(source, point, (f"at:{point}:{action}:{t}:{HOLD_S}",)))
    out.append(Scenario("integrity", "after-notice", (f"corrupt-page:{tag('integrity', 'after-notice')}",)))
    out.append(Scenario("stall", "mid-transfer",
                        (f"at:mid-transfer:stop:{tag('stall', 'mid-transfer')}:{TRANSFER_TIMEOUT + ABORT_DEADLINE + 1}",),
                        group="stall"))
    # Last: under torchrun a dead rank stops the whole group (fail-stop), so nothing after it.
    out.append(Scenario("crash", "mid-transfer", (f"at:mid-transfer:kill:{tag('crash', 'mid-transfer')}",),
                        group="crash"))
    return out


# ------------------------------------------------------------------ cluster handling
def start(nproc: int, args: list[str], log_dir: Path) -> LocalCluster:
    """A local cluster with the suite's context, pool and deadlines; ``args`` come after
    them, so a group may override one."""
    return localcluster.start(nproc, [
        "--context-length", str(CONTEXT), "--pool-tokens", "16384",
        "--transfer-timeout", str(TRANSFER_TIMEOUT), "--abort-deadline", str(ABORT_DEADLINE),
        "--request-timeout", str(REQUEST_TIMEOUT), *args], log_dir)


# ------------------------------------------------------------------ one scenario
@dataclass
class Outcome:
    scenario: str
    unsafe: bool
    a_status: int | None = None
    b_status: int | None = None
    foreign: list[str] = field(default_factory=list)
    held_after: int = 0
    answered_in_time: bool = True
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def leak(self) -> bool:
        return bool(self.foreign)

    @property
    def passed(self) -> bool:
        return not self.problems


def _marker(i: int, salt: int) -> str:
    return "@" + f"{(salt * 7919 + i * 104729) & 0xFFFFF:05x}" + "@"


def post(cluster: LocalCluster, prompt: str, max_tokens: int, cancel_after: float | None) -> tuple[int | None, dict, float]:
    t0 = time.monotonic()
    timeout = cancel_after if cancel_after is not None else REQUEST_TIMEOUT + 10
    try:
        status, body = cluster.complete(prompt, max_tokens, timeout=timeout)
    except (TimeoutError, socket.timeout, urllib.error.URLError) as exc:
        if cancel_after is None:
            return None, {"error": f"client: {exc}"}, time.monotonic() - t0
        return 499, {"error": "client cancelled"}, time.monotonic() - t0
    return status, body, time.monotonic() - t0


def run_scenario(cluster: LocalCluster, sc: Scenario, unsafe: bool, index: int) -> Outcome:
    out = Outcome(sc.name, unsafe)
    t0 = time.monotonic()
    mark_a, mark_b = _marker(2 * index, index + 1), _marker(2 * index + 1, index + 1)
    length = CONTEXT + 5 if sc.source == "admission" else PROMPT
    prompt_a = sc.tag + make_prompt(mark_a, length - len(sc.tag))
    prompt_b = make_prompt(mark_b, PROMPT)
    before = cluster.metrics()
    try:
        out.a_status, body_a, took_a = post(cluster, prompt_a,
                                             sc.max_tokens if sc.source != "admission" else 8,
                                             sc.cancel_after)
    except (ConnectionError, urllib.error.URLError, http.client.HTTPException) as exc:
        if sc.source != "crash":
            raise
        out.a_status, body_a, took_a = None, {"error": f"connection lost: {exc}"}, time.monotonic() - t0
    if took_a > REQUEST_TIMEOUT + 5:
        out.answered_in_time = False
        out.problems.append(f"A answered after {took_a:.1f} s")
    if sc.expect_a == "rejected" and out.a_status != 400:
        out.problems.append(f"A: expected 400, got {out.a_status}")
    if sc.expect_a == "error" and out.a_status == 200:
        out.problems.append("A: a faulted request was answered 200")
    if out.a_status == 200 and body_a.get("text") != expected_replay(prompt_a, sc.max_tokens):
        out.problems.append("A: answered 200 with a wrong replay")
    if sc.source == "crash":
        return _after_crash(cluster, out, t0)
    # Give an unsafe owner the moment it needs to free A's pages, so B gets them. For the
    # stalled writer, wait until the owner severed it and released A's pages: B then gets
    # them while the writer, resumed, still has a write in flight.
    b_tokens = PROMPT
    if sc.source == "stall":
        time.sleep(ABORT_DEADLINE + 0.3)
    elif sc.source != "admission":
        time.sleep(0.3)
    out.b_status, body_b, took_b = post(cluster, prompt_b, b_tokens, None)
    if out.b_status != 200:
        out.problems.append(f"B: expected 200, got {out.b_status}: {str(body_b)[:200]}")
    elif body_b.get("text") != expected_replay(prompt_b, b_tokens):
        out.problems.append("B: answered 200 with a wrong replay")
    texts = [str(body_a.get("text", "")) + str(body_a.get("message", "")),
             str(body_b.get("text", "")) + str(body_b.get("message", ""))]
    own = [mark_a, mark_b]
    for text, mine in zip(texts, own):
        out.foreign += [m for m in set(MARKER_RE.findall(text)) if m != mine]
    if out.foreign:
        out.problems.append(f"foreign markers {sorted(set(out.foreign))}")
    out.held_after = cluster.quiesce(HOLD_S + ABORT_DEADLINE + 6)
    if out.held_after:
        out.problems.append(f"{out.held_after} pages still held after quiesce")
    after = cluster.metrics()
    out.problems += _check_counters(sc, before, after, out)
    out.seconds = time.monotonic() - t0
    return out


def _after_crash(cluster: LocalCluster, out: Outcome, t0: float) -> Outcome:
    """A writer died mid-transfer. torchrun stops the whole group when a rank dies, so the
    check is: A was not answered 200, and the group (front door included) is gone within
    its deadline: no rank is left that could read or hand out A's pages."""
    deadline = time.monotonic() + 30
    while cluster.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if cluster.proc.poll() is None:
        out.problems.append("the group did not stop within 30 s of a rank's death")
    out.seconds = time.monotonic() - t0
    return out


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _check_counters(sc: Scenario, before: dict, after: dict, out: Outcome) -> list[str]:
    problems = []
    ok = _delta(before, after, 'kvferry_requests_total{outcome="ok"}')
    want_ok = int(out.b_status == 200) + int(out.a_status == 200)
    if ok != want_ok:
        problems.append(f"requests ok counter moved by {ok}, expected {want_ok}")
    if sc.source == "admission":
        if _delta(before, after, 'kvferry_requests_total{outcome="rejected"}') != 1:
            problems.append("rejected counter did not move by 1")
    elif out.a_status != 200:
        failed = sum(_delta(before, after, f'kvferry_requests_total{{outcome="{o}"}}')
                     for o in ("aborted", "failed", "unavailable"))
        if failed < 1:
            problems.append("no failure or abort counted for A")
    if sc.source == "integrity" and not out.unsafe:
        moved = sum(_delta(before, after, k) for k in after if k.startswith("kvferry_integrity_failures"))
        if moved < 1:
            problems.append("integrity failure not counted")
    return problems


# ------------------------------------------------------------------ the suite
def run_suite(unsafe_too: bool, log_dir: Path, only: str | None = None) -> dict:
    all_sc = [s for s in scenarios() if only is None or only in s.name]
    results: list[Outcome] = []
    for unsafe in ([False, True] if unsafe_too else [False]):
        for group, nproc, extra in (("main", 3, []),
                                    ("stall", 4, ["--prefill", "2", "--fault", f"decode-delay:{STALL_STEP_S}"]),
                                    ("crash", 4, ["--prefill", "2", "--transports", "tcp"])):
            group_sc = [s for s in all_sc if s.group == group]
            if unsafe:   # the scenarios where a write is in flight at the abort
                group_sc = [s for s in group_sc if s.mid_transfer and s.source != "crash"]
            if not group_sc:
                continue
            faults = [f for s in group_sc for f in s.faults]
            args = extra + [a for f in faults for a in ("--fault", f)]
            if unsafe:
                # main: free at abort; stall: release once severed, without proof
                args.append("--unsafe-free-on-abort" if group == "main" else "--unsafe-release-on-sever")
            cluster = start(nproc, args, log_dir)
            try:
                for i, sc in enumerate(group_sc):
                    res = run_scenario(cluster, sc, unsafe, i + (100 if unsafe else 0))
                    results.append(res)
                    _print_row(res)
            finally:
                cluster.stop()
    safe = [r for r in results if not r.unsafe]
    unsafe_runs = [r for r in results if r.unsafe]
    summary = {"scenarios": len(safe), "passed": sum(r.passed for r in safe),
               "unsafe_scenarios": len(unsafe_runs),
               "unsafe_leaks_found": sum(r.leak for r in unsafe_runs)}
    return {"summary": summary, "results": results}


def _print_row(r: Outcome) -> None:
    mode = "UNSAFE" if r.unsafe else "safe"
    verdict = ("LEAK" if r.leak else "no leak") if r.unsafe else ("pass" if r.passed else "FAIL")
    print(f"{r.scenario:<26} {mode:<6} A={str(r.a_status):<4} B={str(r.b_status):<4} "
          f"foreign={len(r.foreign):<2} held={r.held_after:<4} {r.seconds:5.1f}s  {verdict}"
          + ("" if r.passed or r.unsafe else f"  {'; '.join(r.problems)[:200]}"), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry fault-suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--no-unsafe", action="store_true", help="skip the unsafe-mode run")
    p.add_argument("--only", help="run the scenarios whose name contains this")
    p.add_argument("--log-dir", help="where cluster logs go (default: a temporary folder)")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'scenario':<26} {'mode':<6} answers     checks", flush=True)
    report = run_suite(not args.no_unsafe, log_dir, args.only)
    s = report["summary"]
    print(f"cluster logs: {log_dir}")
    print(json.dumps(s))
    mid_unsafe = s["unsafe_scenarios"]
    ok = s["passed"] == s["scenarios"] and s["unsafe_leaks_found"] == mid_unsafe
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
