"""The fault suite: abort sources x protocol points through a real local cluster.

Every scenario sends a request A whose prompt carries a fault tag (the ranks were started
with the matching ``--fault`` hooks, see :mod:`.faults`) and a unique marker, lets the
fault and the abort play out, then sends a victim request B of the same size with another
marker. B is the request that would be handed A's pages if they were released too early;
a write of A that lands late would then show up as A's marker in B's answer.

Each scenario asserts: no answer holds another request's marker; every request is
answered (text or error) within its deadline; no page is held on any rank after quiesce;
and the cluster's counters moved as expected. In unsafe mode every scenario with a write
in flight (mid-transfer, mid-pipeline; not a crashed writer's, nor a corrupted part) must
leak, which shows the suite can fail: pages freed at abort (``--unsafe-free-on-abort``)
for the abort sources, and released at the deadline once the writer is severed, without
proof (``--unsafe-release-on-sever``), for the stalled and the partitioned writer.

Matrix (source x point; cells that cannot happen are not run):

    client      before-write, mid-transfer, after-write, after-notice
    admission   before-write (prompt over the context length: 400, nothing allocated)
    prefill     before-write, mid-transfer, after-write
    transfer    before-write, mid-transfer, after-write
    decode      before-write, mid-transfer, after-write  (writer too slow: decode times out)
    integrity   after-notice (a page corrupted in flight)
    crash       prefill, before-write, mid-transfer, after-write, after-notice (the writer
                SIGKILLs itself; the cluster runs as failure domains: its requests fail,
                requests on the other ranks are served while it is down, torchrun
                restarts it, and it rejoins with a new incarnation)
    owner-crash mid-transfer (killed from outside while a writer's half is in flight),
                after-notice (it kills itself with every notice in)
    router-crash mid-transfer (the router is SIGKILLed with a request in flight: its client
                sees the connection lost, torchrun restarts the router, the ranks adopt
                its new card, finish or release what the old one left, and serve again)
    rejoin      mid-transfer (the writer is SIGKILLed from outside with its half in flight:
                its replacement is admitted only after the old incarnation's quarantined
                pages were released, and then serves)
    tp-stall    mid-transfer (one writer of a tensor-parallel group is SIGSTOPped past the
                abort deadline while the other acks; released on the late ack)
    shape-*     client, prefill and stall @mid-transfer in clusters whose two shapes
                differ: prefill pages twice the decode's, so A's writes are runs into
                pages of another size, from a group of three over two KV heads (one
                member holds a replica and is no writer; client, prefill) or, for the
                stall, groups of two over three heads (split 1 + 2)
    dropped     plan, notice, abort (and the ack after it), each message lost once
    duplicated  every-kind (every message sent twice, through an abort)
    reordered   abort (the writer's ABORT overtaken by the owner's)
    delayed     abort-ack (the ack arrives after the deadline: severed, released on it)
    stall       mid-transfer (the writer is SIGSTOPped past the abort deadline, then resumes
                and its in-flight write lands: the owner severed it at the deadline, but
                releases only on its late ack or its death)
    pipelined   client, prefill, integrity, stall, crash and owner-crash @mid-pipeline:
                the same faults while a prompt goes in parts (``--prefill-chunk-tokens``
                PIPELINE_CHUNK): its first part posted, half of it in flight, the rest
                of the prompt still computing (integrity: the first part corrupted
                after its checksums, caught by the owner's check of that part)
    #decode-tp-2 client, prefill, stall, crash and owner-crash @mid-transfer with A decoded by
                a decode group of two (``--decode-tp 2``): two owners, one answer; the
                owner-crash row kills one of the two owners
    #decode-tp-2-llama client and prefill @mid-transfer with A decoded by a llama decode group
                of two that splits the KV heads (the lead steps, the member attends over
                its own pages for every layer); the answers are checked against the
                monolithic llama engine (no marker can show in a llama answer: a late
                write shows as B's answer changed)
    #kv-replicated client @mid-transfer between groups of two holding replicated KV
                (``--kv-replicated``): each owner written by one member, waiting for
                no other
    partition   mid-transfer (two nodes, tcp: the link to the owner's node goes down with the
                writer's second half in flight; the owner severs the writer at the deadline
                but, unable to prove a remote writer stopped, keeps the pages quarantined
                until the writer's late ack once the link is back. Needs root and iproute2
                for a network namespace; without them the row is printed as skipped and
                not counted)

Prints a table, then one JSON line (the last line) with ``scenarios``, ``passed``,
``unsafe_scenarios``, ``unsafe_leaks_found`` and ``served_during_failure`` (per crash
scenario: requests on healthy ranks answered 200, with their own replay, while a rank was
down).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import http.client
import json
import re
import sys
import tempfile
import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kvferry.engine.protocol.proof import is_justified

from . import localcluster, netns
from .localcluster import LocalCluster, LogTail, TwoNodeCluster, releases_by_justification
from .workload import MARKER_RE, expected_replay, make_prompt

T = TypeVar("T")

CONTEXT = 2048
STALL_STEP_S = 0.01  # the stall group decodes slowly: the victim still reads the prompt
# pages when the resumed writer's in-flight write lands
PROMPT = 320
TRANSFER_TIMEOUT = 1.0
ABORT_DEADLINE = 2.0
REQUEST_TIMEOUT = 20.0
HOLD_S = 3.0  # how long an injected in-flight write stays in flight
CLIENT_CANCEL_S = 0.4
# The partition row. The link is down from A's pause until the owner severed A's writer
# (transfer timeout + abort deadline) and was watched keeping A's pages quarantined; all of
# it stays under the tcp transport's TCP_USER_TIMEOUT (4 s, kvferry.transfer.engine): past
# that the kernel closes every connection with data in flight and the partition turns
# into a peer failure, which is not what this row tests.
PARTITION_ABORT_DEADLINE = 1.0
QUARANTINE_WATCH_S = 1.0  # how long the owner is watched, link down, after severing
PARTITION_HOLD_S = 5.0  # A's second half stays in flight this long: past the partition,
# landing (unsafe) while the victim, sent once the link is back,
# decodes from A's released pages
PARTITION_STEP_S = 0.02  # the partition group decodes slowly: the victim still reads its
# prompt pages when A's half lands

POINTS = ("before-write", "mid-transfer", "after-write", "after-notice")
IN_FLIGHT_POINTS = ("mid-transfer", "mid-pipeline")
# The pipeline groups' prefill chunk: A's prompt of PROMPT tokens goes in parts of at
# least this many tokens, each checked by the owner when it lands; half of the first is
# held in flight.
PIPELINE_CHUNK = 64
# every pipeline group's options: the chunk, and every pipeline row's A goes in parts
PIPELINED = (
    "--prefill-chunk-tokens",
    str(PIPELINE_CHUNK),
    "--fault",
    "plan-first:.mid-pipeline~",
)
# The stalled pipeline: A's late half (tokens 32-63) lands about when the stall row's late
# half (tokens 160-319) does; the victim reads those tokens as late as there at 5 x the
# step time, and takes 16 s to answer.
PIPELINE_STALL_STEP_S = 5 * STALL_STEP_S
PIPELINE_STALL_REQUEST_TIMEOUT = 30.0
# The shapes groups (issue 28): a prefill group of three over two KV heads, so that one
# member holds a replica and writes nothing, with prefill pages twice the decode's and
# token-major (NHD) against the decode's heads-major: each writer's bytes land as runs
# checked per decode page as it lies in memory.
SHAPED = (
    *("--prefill", "3", "--tp", "3", "--kv-heads", "2"),
    *("--prefill-page-size", "32", "--prefill-kv-layout", "NHD"),
)
# The stalled writer's group must leave another group to serve the victim: two groups of
# two over three KV heads (split 1 + 2), pages twice the decode's, the decode's NHD.
SHAPED_STALL = (
    *("--prefill", "4", "--tp", "2", "--kv-heads", "3"),
    *("--prefill-page-size", "32", "--kv-layout", "NHD"),
)
CRASH_POINTS = ("prefill", "before-write", "mid-transfer", "after-write", "after-notice")
CRASH_SOURCES = ("crash", "owner-crash", "rejoin", "router-crash")
# The router is the front door: while it is down no request can be answered, so its row
# reports how long the front door was down instead of requests served meanwhile.
FRONT_DOOR_SOURCES = ("router-crash",)
DOMAIN_ABORT_DEADLINE = 6.0  # past the tcp horizon (4 s), as in production
SERVED_WHILE_DOWN = 3  # requests sent to the healthy ranks while a rank is down
REJOIN_S = 90.0  # a restarted rank: torch's import, the pool, the card, admission
OWNER_KILL_PROMPT = 342  # the owner knows a request by its prompt length only


@dataclass(frozen=True)
class Scenario:
    source: str
    point: str
    faults: tuple[str, ...]  # --fault hooks this scenario needs on the cluster
    cancel_after: float | None = None
    max_tokens: int = PROMPT
    expect_a: str = "error"  # error | any (the client may win the race) | rejected
    group: str = "main"  # which cluster runs it
    prompt: int = PROMPT  # A's prompt length
    shape: str | None = None  # the row repeats a fault in a cluster of another shape

    @property
    def name(self) -> str:
        return f"{self.source}@{self.point}" + (f"#{self.shape}" if self.shape else "")

    @property
    def tag(self) -> str:
        return f"~{self.source}.{self.point}" + (f".{self.shape}" if self.shape else "") + "~"

    @property
    def in_flight(self) -> bool:
        """A write of A's is in flight at the fault (the whole prompt's, or a part's)."""
        return self.point in IN_FLIGHT_POINTS


def scenarios() -> list[Scenario]:
    out: list[Scenario] = []

    def tag(source: str, point: str) -> str:
        return f"~{source}.{point}~"

    for point in POINTS:
        t = tag("client", point)
        if point == "after-notice":
            out.append(
                Scenario("client", point, (), CLIENT_CANCEL_S, max_tokens=1700, expect_a="any")
            )
        else:
            out.append(
                Scenario("client", point, (f"at:{point}:pause:{t}:{HOLD_S}",), CLIENT_CANCEL_S)
            )
    out.append(Scenario("admission", "before-write", (), expect_a="rejected"))
    for source, action in (
        ("prefill", "fail-prefill"),
        ("transfer", "fail-transfer"),
        ("decode", "pause"),
    ):
        for point in POINTS[:3]:
            t = tag(source, point)
            out.append(Scenario(source, point, (f"at:{point}:{action}:{t}:{HOLD_S}",)))
    out.append(
        Scenario("integrity", "after-notice", (f"corrupt-page:{tag('integrity', 'after-notice')}",))
    )
    out.append(
        Scenario(
            "stall",
            "mid-transfer",
            (
                f"at:mid-transfer:stop:{tag('stall', 'mid-transfer')}:"
                f"{TRANSFER_TIMEOUT + ABORT_DEADLINE + 1}",
            ),
            group="stall",
        )
    )
    out.append(
        Scenario(
            "partition",
            "mid-transfer",
            (f"at:mid-transfer:pause:{tag('partition', 'mid-transfer')}:{PARTITION_HOLD_S}",),
            group="partition",
        )
    )
    # one writer of a tensor-parallel group stopped past the deadline, the other acks
    t = tag("tp-stall", "mid-transfer")
    out.append(
        Scenario(
            "tp-stall",
            "mid-transfer",
            (
                f"rank=1:at:mid-transfer:stop:{t}:{TRANSFER_TIMEOUT + ABORT_DEADLINE + 1}",
                f"rank=2:at:after-write:pause:{t}:{HOLD_S}",
            ),
            group="tp-stall",
        )
    )
    # the same faults between unlike shapes (SHAPED): an abort and a failure with a write
    # in flight, and a writer stalled past the deadline while the other acks
    t = tag("shape-client", "mid-transfer")
    out.append(
        Scenario(
            "shape-client",
            "mid-transfer",
            (f"at:mid-transfer:pause:{t}:{HOLD_S}",),
            CLIENT_CANCEL_S,
            group="shapes",
        )
    )
    t = tag("shape-prefill", "mid-transfer")
    out.append(
        Scenario(
            "shape-prefill",
            "mid-transfer",
            (f"at:mid-transfer:fail-prefill:{t}:{HOLD_S}",),
            group="shapes",
        )
    )
    t = tag("shape-stall", "mid-transfer")
    out.append(
        Scenario(
            "shape-stall",
            "mid-transfer",
            (
                f"rank=1:at:mid-transfer:stop:{t}:{TRANSFER_TIMEOUT + ABORT_DEADLINE + 1}",
                f"rank=2:at:after-write:pause:{t}:{HOLD_S}",
            ),
            group="shapes-stall",
        )
    )
    # control messages lost, doubled, overtaken or late, each in a cluster of its own
    for source, point, cancel in (
        ("dropped", "plan", None),
        ("dropped", "notice", None),
        ("dropped", "abort", CLIENT_CANCEL_S),
        ("duplicated", "every-kind", CLIENT_CANCEL_S),
        ("reordered", "abort", CLIENT_CANCEL_S),
        ("delayed", "abort-ack", CLIENT_CANCEL_S),
    ):
        faults = (f"at:mid-transfer:pause:{tag(source, point)}:{HOLD_S}",) if cancel else ()
        out.append(Scenario(source, point, faults, cancel, group=f"{source}-{point}"))
    # the pipelined path: A's prompt goes in parts; the fault strikes with its first part
    # posted (half of it in flight) and the rest still computing
    t = tag("client", "mid-pipeline")
    out.append(
        Scenario(
            "client",
            "mid-pipeline",
            (f"at:mid-pipeline:pause:{t}:{HOLD_S}",),
            CLIENT_CANCEL_S,
            group="pipeline",
        )
    )
    t = tag("prefill", "mid-pipeline")
    out.append(
        Scenario(
            "prefill",
            "mid-pipeline",
            (f"at:mid-pipeline:fail-prefill:{t}:{HOLD_S}",),
            group="pipeline",
        )
    )
    out.append(
        Scenario(
            "integrity",
            "mid-pipeline",
            (f"corrupt-page:{tag('integrity', 'mid-pipeline')}",),
            group="pipeline",
        )
    )
    out.append(
        Scenario(
            "stall",
            "mid-pipeline",
            (
                f"at:mid-pipeline:stop:{tag('stall', 'mid-pipeline')}:"
                f"{TRANSFER_TIMEOUT + ABORT_DEADLINE + 1}",
            ),
            group="pipeline-stall",
        )
    )
    out.append(
        Scenario(
            "crash",
            "mid-pipeline",
            (f"at:mid-pipeline:kill:{tag('crash', 'mid-pipeline')}",),
            group="pipeline-domains",
        )
    )
    out.append(
        Scenario(
            "owner-crash",
            "mid-pipeline",
            (f"at:mid-pipeline:pause:{tag('owner-crash', 'mid-pipeline')}:{HOLD_S}",),
            group="pipeline-domains",
        )
    )
    out += decode_group_scenarios()
    # failure domains: a rank dies, the rest serves, it comes back
    for point in CRASH_POINTS:
        out.append(
            Scenario(
                "crash",
                point,
                (f"at:{point}:kill:{tag('crash', point)}",),
                group="domains",
                expect_a="any" if point == "after-notice" else "error",
            )
        )
    out.append(
        Scenario(
            "owner-crash",
            "mid-transfer",
            (f"at:mid-transfer:pause:{tag('owner-crash', 'mid-transfer')}:{HOLD_S}",),
            group="domains",
        )
    )
    out.append(
        Scenario(
            "owner-crash",
            "after-notice",
            (f"at:owner-notice:kill:prompt_len={OWNER_KILL_PROMPT}",),
            group="domains",
            prompt=OWNER_KILL_PROMPT,
        )
    )
    out.append(
        Scenario(
            "router-crash",
            "mid-transfer",
            (f"at:mid-transfer:pause:{tag('router-crash', 'mid-transfer')}:{HOLD_S}",),
            group="domains",
        )
    )
    out.append(
        Scenario(
            "rejoin",
            "mid-transfer",
            (f"at:mid-transfer:pause:{tag('rejoin', 'mid-transfer')}:{HOLD_S}",),
            group="domains",
        )
    )
    return out


DECODE_TP = "decode-tp-2"  # the decode-group rows' shape
DECODE_TP_LLAMA = "decode-tp-2-llama"  # a llama decode group of two that splits the heads
LLAMA_SHAPE = ("--model", "llama", "--kv-heads", "4", "--q-heads", "8")
KV_REPLICATED = "kv-replicated"  # MLA-style KV: every member holds every head


def decode_group_scenarios() -> list[Scenario]:
    """Faults with A decoded by a decode group of two (``--decode-tp 2``): two owners,
    each with pages of its own and the writer's sub-request into it, one answer. An abort
    while the owners wait with a write in flight, a writer that fails, a writer stalled
    past the deadline, a writer killed, and one of the two owners killed (the other's
    pages stay quarantined until the writer's in-flight half landed and it acked); and
    an abort between groups of two that hold replicated KV."""

    def row(source: str, action: str, group: str, shape: str = DECODE_TP, **kw) -> Scenario:
        sc = Scenario(source, "mid-transfer", (), group=group, shape=shape, **kw)
        return dataclasses.replace(sc, faults=(action.format(tag=sc.tag),))

    stalled = TRANSFER_TIMEOUT + ABORT_DEADLINE + 1
    return [
        row(
            "client",
            f"at:mid-transfer:pause:{{tag}}:{HOLD_S}",
            "decode-tp",
            cancel_after=CLIENT_CANCEL_S,
        ),
        row("prefill", f"at:mid-transfer:fail-prefill:{{tag}}:{HOLD_S}", "decode-tp"),
        row("stall", f"at:mid-transfer:stop:{{tag}}:{stalled}", "decode-tp-stall"),
        row("crash", "at:mid-transfer:kill:{tag}", "decode-tp-domains"),
        row("owner-crash", f"at:mid-transfer:pause:{{tag}}:{HOLD_S}", "decode-tp-domains"),
        row(
            "client",
            f"at:mid-transfer:pause:{{tag}}:{HOLD_S}",
            "decode-tp-llama",
            DECODE_TP_LLAMA,
            cancel_after=CLIENT_CANCEL_S,
        ),
        row(
            "prefill",
            f"at:mid-transfer:fail-prefill:{{tag}}:{HOLD_S}",
            "decode-tp-llama",
            DECODE_TP_LLAMA,
        ),
        row(
            "client",
            f"at:mid-transfer:pause:{{tag}}:{HOLD_S}",
            "kv-replicated",
            KV_REPLICATED,
            cancel_after=CLIENT_CANCEL_S,
        ),
    ]


# ------------------------------------------------------------------ cluster handling
@dataclass(frozen=True)
class Group:
    """The scenarios that share one cluster, and how that cluster is started."""

    name: str
    nproc: int
    args: tuple[str, ...]
    unsafe_flag: str = "--unsafe-free-on-abort"
    nodes: int = 1  # 2: the last rank on a second node, behind a link that can go down
    domains: tuple[int, int] | None = None  # (prefill, decode): run as failure domains

    @property
    def skip_reason(self) -> str | None:
        """Why this machine cannot run the group (a second node needs a namespace)."""
        return netns.unavailable_reason() if self.nodes == 2 else None


GROUPS = (
    Group("main", 3, ()),
    # the stall and the partition: released once severed, without proof, in unsafe mode
    Group(
        "stall",
        4,
        ("--prefill", "2", "--fault", f"decode-delay:{STALL_STEP_S}"),
        "--unsafe-release-on-sever",
    ),
    # node 0: router and two prefill ranks (one writes A, the other B: the owner severed
    # A's writer); node 1: the decode rank
    Group(
        "partition",
        4,
        (
            "--prefill",
            "2",
            "--fault",
            f"decode-delay:{PARTITION_STEP_S}",
            "--abort-deadline",
            str(PARTITION_ABORT_DEADLINE),
        ),
        "--unsafe-release-on-sever",
        nodes=2,
    ),
    # two tensor-parallel groups of two: one member of A's group stops
    Group(
        "tp-stall",
        6,
        ("--prefill", "4", "--tp", "2", "--fault", f"decode-delay:{STALL_STEP_S}"),
        "--unsafe-release-on-sever",
    ),
    # unlike shapes (SHAPED): router, three prefill ranks (one group), one decode rank
    Group("shapes", 5, SHAPED),
    Group(
        "shapes-stall",
        6,
        (*SHAPED_STALL, "--fault", f"decode-delay:{STALL_STEP_S}"),
        "--unsafe-release-on-sever",
    ),
    # the pipelined path (see PIPELINE_CHUNK): an abort and a failure, a corrupted part,
    # a stalled writer, and (as failure domains) a killed writer and a killed owner; the
    # first group's model has two layers, so each part is a piece written through both
    Group("pipeline", 3, (*PIPELINED, "--layers", "2")),
    Group(
        "pipeline-stall",
        4,
        (
            "--prefill",
            "2",
            *PIPELINED,
            "--fault",
            f"decode-delay:{PIPELINE_STALL_STEP_S}",
            "--request-timeout",
            str(PIPELINE_STALL_REQUEST_TIMEOUT),
        ),
        "--unsafe-release-on-sever",
    ),
    Group(
        "pipeline-domains",
        5,
        (
            "--transports",
            "tcp",
            "--abort-deadline",
            str(DOMAIN_ABORT_DEADLINE),
            *PIPELINED,
        ),
        domains=(2, 2),
    ),
    Group("dropped-plan", 3, ("--fault", "drop:PLAN:1:1")),
    Group("dropped-notice", 3, ("--fault", "drop:NOTICE:1:1")),
    Group("dropped-abort", 3, ("--fault", "drop:ABORT:1:1", "--fault", "drop:ABORT_ACK:1:1")),
    Group(
        "duplicated-every-kind",
        3,
        tuple(
            a
            for kind in (
                "PREFILL",
                "ASSIGN",
                "PLAN",
                "NOTICE",
                "TOKENS",
                "DONE",
                "ABORT",
                "ABORT_ACK",
                "RELEASED",
            )
            for a in ("--fault", f"dup:{kind}")
        ),
    ),
    Group("reordered-abort", 3, ("--fault", "reorder:ABORT")),
    Group("delayed-abort-ack", 3, ("--fault", f"delay:ABORT_ACK:{ABORT_DEADLINE + 1}")),
    # decode groups of two (issue 28): router, a prefill rank, one decode group; with two
    # prefill ranks for the stall; as failure domains, two of each (two decode groups)
    Group("decode-tp", 4, ("--prefill", "1", "--decode-tp", "2")),
    Group("decode-tp-llama", 4, ("--prefill", "1", "--decode-tp", "2", *LLAMA_SHAPE)),
    Group(
        "decode-tp-stall",
        5,
        ("--prefill", "2", "--decode-tp", "2", "--fault", f"decode-delay:{STALL_STEP_S}"),
        "--unsafe-release-on-sever",
    ),
    # replicated KV: groups of two on both sides, each decode member written by one
    # prefill member, the other assigned nothing
    Group(
        "kv-replicated",
        5,
        ("--prefill", "2", "--tp", "2", "--decode-tp", "2", "--kv-heads", "1", "--kv-replicated"),
    ),
    Group(
        "decode-tp-domains",
        7,
        (
            "--prefill",
            "2",
            "--decode-tp",
            "2",
            "--transports",
            "tcp",
            "--abort-deadline",
            str(DOMAIN_ABORT_DEADLINE),
        ),
        domains=(2, 4),
    ),
    # failure domains: each rank its own torchrun job, restarted when it dies
    Group(
        "domains",
        5,
        ("--transports", "tcp", "--abort-deadline", str(DOMAIN_ABORT_DEADLINE)),
        domains=(2, 2),
    ),
)


def suite_args(args: list[str]) -> list[str]:
    """The suite's context, pool and deadlines; ``args`` come after them, so a group may
    override one."""
    return [
        "--context-length",
        str(CONTEXT),
        "--pool-tokens",
        "16384",
        "--transfer-timeout",
        str(TRANSFER_TIMEOUT),
        "--abort-deadline",
        str(ABORT_DEADLINE),
        "--request-timeout",
        str(REQUEST_TIMEOUT),
        *args,
    ]


def start(nproc: int, args: list[str], log_dir: Path) -> LocalCluster:
    """A local cluster with :func:`suite_args`."""
    return localcluster.start(nproc, suite_args(args), log_dir)


@contextlib.contextmanager
def open_cluster(group: Group, args: list[str], log_dir: Path) -> Iterator[LocalCluster]:
    """The group's cluster with ``args`` (its own, its scenarios' faults, the unsafe flag),
    stopped (and a second node's namespace removed) on leaving."""
    if group.nodes == 2:
        with localcluster.two_nodes(group.nproc - 1, 1, suite_args(args), log_dir) as cluster:
            yield cluster
        return
    if group.domains is not None:
        prefill, decode = group.domains
        domains = localcluster.start_domains(
            prefill, decode, suite_args(args), log_dir, max_restarts=len(CRASH_POINTS) + 4
        )
        try:
            yield domains
        finally:
            domains.stop()
        return
    single = start(group.nproc, args, log_dir)
    try:
        yield single
    finally:
        single.stop()


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
    served_during_failure: int = 0  # 200s from healthy ranks while a rank was down
    ok_answers: int = 0  # 200s besides A's and B's, for the counters check
    front_door_down_s: float | None = None  # a router crash: until /health answered again

    wrong_answer: bool = False  # B answered 200 with bytes that are not its replay
    # B failed because the members of its decode group read different tokens: one of them
    # read bytes B never wrote (the group's combine caught it before the client did)
    members_disagreed: bool = False
    releases: dict[str, float] = field(default_factory=dict)  # by justification, this row

    @property
    def leak(self) -> bool:
        """Another request's bytes reached an answer: its marker, or (a tensor-parallel
        writer's late half, which carries only some KV heads) the victim's replay broken,
        or the members of the victim's decode group read different tokens."""
        return bool(self.foreign) or self.wrong_answer or self.members_disagreed

    @property
    def passed(self) -> bool:
        return not self.problems


def _marker(i: int, salt: int) -> str:
    return "@" + f"{(salt * 7919 + i * 104729) & 0xFFFFF:05x}" + "@"


def post(
    cluster: LocalCluster, prompt: str, max_tokens: int, cancel_after: float | None
) -> tuple[int | None, dict, float]:
    t0 = time.monotonic()
    timeout = cancel_after if cancel_after is not None else REQUEST_TIMEOUT + 10
    try:
        status, body = cluster.complete(prompt, max_tokens, timeout=timeout)
    except (TimeoutError, urllib.error.URLError) as exc:
        if cancel_after is None:
            return None, {"error": f"client: {exc}"}, time.monotonic() - t0
        return 499, {"error": "client cancelled"}, time.monotonic() - t0
    return status, body, time.monotonic() - t0


@dataclass(frozen=True)
class Pair:
    """A scenario's two requests: A carries the fault tag, B is the victim."""

    mark_a: str
    mark_b: str
    prompt_a: str
    prompt_b: str

    @classmethod
    def of(cls, sc: Scenario, index: int) -> Pair:
        mark_a, mark_b = _marker(2 * index, index + 1), _marker(2 * index + 1, index + 1)
        length = CONTEXT + 5 if sc.source == "admission" else sc.prompt
        return cls(
            mark_a,
            mark_b,
            sc.tag + make_prompt(mark_a, length - len(sc.tag)),
            make_prompt(mark_b, PROMPT),
        )


def run_scenario(cluster: LocalCluster, sc: Scenario, unsafe: bool, index: int) -> Outcome:
    out = Outcome(sc.name, unsafe)
    t0 = time.monotonic()
    pair = Pair.of(sc, index)
    prompt_a, prompt_b = pair.prompt_a, pair.prompt_b
    before = cluster.metrics()
    tail = LogTail.at_end(cluster.log)
    try:
        out.a_status, body_a, took_a = post(
            cluster, prompt_a, sc.max_tokens if sc.source != "admission" else 8, sc.cancel_after
        )
    except (ConnectionError, urllib.error.URLError, http.client.HTTPException) as exc:
        if sc.source != "crash":
            raise
        out.a_status, body_a, took_a = (
            None,
            {"error": f"connection lost: {exc}"},
            time.monotonic() - t0,
        )
    _check_a(sc, out, prompt_a, body_a, took_a)
    # B goes once the owner has decided A's pages (quarantined, or freed at once in
    # unsafe mode, so that B gets them); for the stalled writer, once the owner severed it
    # (and, unsafe, released A's pages without proof: B then gets them while the writer,
    # resumed, still has a write in flight). Waited on the owner's log lines, never slept.
    b_tokens = PROMPT
    if sc.source != "admission":
        _wait_owner_decided(tail, sc, unsafe, out)
    out.b_status, body_b, _ = post(cluster, prompt_b, b_tokens, None)
    _check_b_and_after(cluster, sc, out, pair, body_a, body_b, before)
    if sc.source == "duplicated" and not unsafe:
        moved = sum(
            v - before.get(k, 0.0)
            for k, v in cluster.metrics().items()
            if k.startswith("kvferry_dropped_messages") and 'reason="duplicate"' in k
        )
        if moved < 1:
            out.problems.append("no duplicate counted as dropped")
    out.seconds = time.monotonic() - t0
    return out


OWNER_DECIDED_S = REQUEST_TIMEOUT + 10  # the longest an owner takes to settle A's pages


def _wait_owner_decided(tail: LogTail, sc: Scenario, unsafe: bool, out: Outcome) -> None:
    """Until the owner's log says what became of A's pages: quarantined, released or
    freed; for a stalled writer, severed (and, unsafe, released). A is the scenario's
    first request routed since ``tail`` began."""
    routed = _logged(out, lambda: tail.wait_for(r"request (\S+): \d+ prompt tokens", 10))
    if routed is None:
        return
    rid = re.escape(routed[1])
    if sc.source in ("stall", "tp-stall", "shape-stall"):
        _logged(out, lambda: tail.wait_for(rf"request {rid}: writers \[.*severing", 30))
        if unsafe:
            _logged(out, lambda: tail.wait_for(rf"request {rid}: \d+ pages released", 10))
        return
    decided = rf"request {rid}: \d+ pages (quarantined|released|freed)"
    _logged(out, lambda: tail.wait_for(decided, OWNER_DECIDED_S))


def expected_answer(sc: Scenario, prompt: str, max_tokens: int) -> str:
    """What the cluster of ``sc``'s group must answer: the replay, or for the llama rows
    the monolithic llama engine's answer (computed here, once per prompt)."""
    if sc.shape != DECODE_TP_LLAMA:
        return expected_replay(prompt, max_tokens)
    return _llama_answer(prompt, max_tokens)


@functools.cache
def _llama_answer(prompt: str, max_tokens: int) -> str:
    from kvferry.cluster.config import add_serve_arguments, config_from_args
    from kvferry.cluster.models import monolithic_engine

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    cfg = config_from_args(parser.parse_known_args(suite_args(list(LLAMA_SHAPE)))[0])
    (result,) = monolithic_engine(cfg).generate([("oracle", prompt, max_tokens)])
    if not result.ok:
        raise RuntimeError(f"the monolithic llama engine failed the oracle: {result.error}")
    return result.text


def _check_a(sc: Scenario, out: Outcome, prompt_a: str, body_a: dict, took_a: float) -> None:
    if took_a > REQUEST_TIMEOUT + 5:
        out.answered_in_time = False
        out.problems.append(f"A answered after {took_a:.1f} s")
    if sc.expect_a == "rejected" and out.a_status != 400:
        out.problems.append(f"A: expected 400, got {out.a_status}")
    if sc.expect_a == "error" and out.a_status == 200:
        out.problems.append("A: a faulted request was answered 200")
    if out.a_status == 200 and body_a.get("text") != expected_answer(sc, prompt_a, sc.max_tokens):
        out.problems.append("A: answered 200 with a wrong answer")


def _check_b_and_after(
    cluster: LocalCluster,
    sc: Scenario,
    out: Outcome,
    pair: Pair,
    body_a: dict,
    body_b: dict,
    before: dict,
    every_rank: bool = False,
) -> None:
    """B's answer, both answers' markers, the pools after quiesce (``every_rank``: also on
    ranks the router no longer routes to, see :meth:`LocalCluster.held`), the counters."""
    if out.b_status != 200:
        out.problems.append(f"B: expected 200, got {out.b_status}: {str(body_b)[:200]}")
        out.members_disagreed = "decode group members disagree" in str(body_b)
    elif body_b.get("text") != expected_answer(sc, pair.prompt_b, PROMPT):
        out.wrong_answer = True
        out.problems.append("B: answered 200 with a wrong answer")
    texts = [
        str(body_a.get("text", "")) + str(body_a.get("message", "")),
        str(body_b.get("text", "")) + str(body_b.get("message", "")),
    ]
    for text, mine in zip(texts, (pair.mark_a, pair.mark_b), strict=True):
        out.foreign += [m for m in set(MARKER_RE.findall(text)) if m != mine]
    if out.foreign:
        out.problems.append(f"foreign markers {sorted(set(out.foreign))}")
    out.held_after = cluster.quiesce(HOLD_S + ABORT_DEADLINE + 6, every_rank)
    if out.held_after:
        out.problems.append(f"{out.held_after} pages still held after quiesce")
    after = cluster.metrics()
    out.problems += _check_counters(sc, before, after, out)


def run_partition(cluster: TwoNodeCluster, sc: Scenario, unsafe: bool, index: int) -> Outcome:
    """A's writer (node 0) pauses with A's second half in flight to the owner (node 1); the
    link goes down. The owner times A out, aborts, and at its deadline severs the writer it
    cannot reach. Safe: A's pages stay quarantined through the partition (watched on the
    owner's log) and are released on the writer's late ack once the link is back. Unsafe
    (``--unsafe-release-on-sever``): released at the deadline; B, sent once the link is
    back, gets them and A's half lands in them while B decodes. A is answered whenever the
    owner's failure reaches the router (after the link is back, at the latest at the
    router's own deadline), so B is sent without waiting for A."""
    out = Outcome(sc.name, unsafe)
    t0 = time.monotonic()
    pair = Pair.of(sc, index)
    before = cluster.metrics()
    node0, node1 = LogTail.at_end(cluster.log), LogTail.at_end(cluster.node1_log)
    with ThreadPoolExecutor(1) as pool:
        answer_a = pool.submit(post, cluster, pair.prompt_a, sc.max_tokens, None)
        rid = _logged(
            out, lambda: node0.wait_for(r"fault: request (\S+): pause at mid-transfer", 30)[1]
        )
        if rid is not None:
            try:
                cluster.partition()
                _while_partitioned(node1, rid, unsafe, out)
            finally:
                cluster.heal()
        _logged(out, lambda: _wait_ranks_heard(cluster, REQUEST_TIMEOUT))
        out.b_status, body_b, _ = post(cluster, pair.prompt_b, PROMPT, None)
        out.a_status, body_a, took_a = answer_a.result()
    _check_a(sc, out, pair.prompt_a, body_a, took_a)
    if rid is not None and not unsafe:
        # released only now, on the writer's late ack after its half landed: the proof
        _logged(
            out,
            lambda: node1.wait_for(
                rf"request {re.escape(rid)}: \d+ pages released \(severed[;)]",
                PARTITION_HOLD_S + 10,
            ),
        )
    _check_b_and_after(cluster, sc, out, pair, body_a, body_b, before, every_rank=True)
    out.seconds = time.monotonic() - t0
    return out


def _while_partitioned(node1: LogTail, rid: str, unsafe: bool, out: Outcome) -> None:
    """With the link down: wait for the owner to sever A's writer; unsafe, for it to release
    A's pages anyway; safe, watch that it keeps them quarantined."""
    if (
        _logged(
            out,
            lambda: node1.wait_for(
                rf"severed rank \d+ .*request {re.escape(rid)}",
                TRANSFER_TIMEOUT + PARTITION_ABORT_DEADLINE + 10,
            ),
        )
        is None
    ):
        return
    released = rf"request {re.escape(rid)}: \d+ pages released \((\w+)[;)]"
    if unsafe:
        _logged(out, lambda: node1.wait_for(released, 10))
        return
    watch_until = time.monotonic() + QUARANTINE_WATCH_S
    while time.monotonic() < watch_until:
        if (found := re.search(released, node1.text())) is not None:
            out.problems.append(f"A's pages released ({found[1]}) while the writer was unreachable")
            return
        time.sleep(0.1)


def _logged(out: Outcome, wait: Callable[[], T]) -> T | None:
    """``wait()``, or None with its TimeoutError recorded as one of the row's problems."""
    try:
        return wait()
    except TimeoutError as exc:
        out.problems.append(str(exc).split("\n", 1)[0])
        return None


def _wait_ranks_heard(cluster: LocalCluster, timeout_s: float) -> None:
    """Until the router hears from every rank again: one silent through the partition was
    marked unhealthy (no heartbeat), which would refuse B."""
    deadline = time.monotonic() + timeout_s
    while any(why.startswith("no heartbeat") for why in cluster.status()["unhealthy"].values()):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ranks still silent {timeout_s:.0f} s after the link came back: "
                f"{cluster.status()['unhealthy']}"
            )
        time.sleep(0.1)


def run_crash(cluster: LocalCluster, sc: Scenario, unsafe: bool, index: int) -> Outcome:
    """A rank dies (see the matrix); the cluster runs as failure domains. Checks: A is
    not answered 200 (unless its writer died after its notice: then its pages are all in),
    the router marks the dead rank at once, requests sent meanwhile are served by the
    other ranks (``served_during_failure``), the rank comes back with a new incarnation and
    is admitted only after every quarantine of its old one was released, B is served, no
    page is held after quiesce, and the counters moved as expected."""
    assert isinstance(cluster, localcluster.DomainCluster)
    out = Outcome(sc.name, unsafe)
    t0 = time.monotonic()
    pair = Pair.of(sc, index)
    before = cluster.metrics()
    tail = LogTail.at_end(cluster.log)
    incarnations = {int(r): p["incarnation"] for r, p in cluster.status()["processes"].items()}
    with ThreadPoolExecutor(1) as pool:
        answer_a = pool.submit(post, cluster, pair.prompt_a, sc.max_tokens, None)
        if sc.source in ("rejoin", "owner-crash") and sc.in_flight:
            # killed from outside (as the OOM killer would) with A's half in flight
            paused = rf"fault: request (\S+): pause at {sc.point}"
            rid = _logged(out, lambda: tail.wait_for(paused, 30)[1])
            if rid is not None:
                rid = client_rid(rid)
                placed = tail.wait_for(
                    rf"request {re.escape(rid)}: .* -> prefill \[(\d+)[^\]]*\], decode (\d+)", 5
                )
                cluster.kill_rank(int(placed[2] if sc.source == "owner-crash" else placed[1]))
        out.a_status, body_a, took_a = answer_a.result()
    _check_a(sc, out, pair.prompt_a, body_a, took_a)
    rid = body_a.get("id") or _rid_in(body_a)
    dead = _logged(out, lambda: _wait_marked_dead(cluster, 10))
    if dead is None:
        out.seconds = time.monotonic() - t0
        return out
    _serve_while_down(cluster, dead, index, out)
    _logged(out, lambda: cluster.wait_rejoined(dead, incarnations[dead], REJOIN_S))
    if rid:
        _check_rejoin_order(tail, rid, dead, out)
    out.b_status, body_b, _ = post(cluster, pair.prompt_b, PROMPT, None)
    _check_b_and_after(cluster, sc, out, pair, body_a, body_b, before, every_rank=True)
    if out.served_during_failure < 1:
        out.problems.append(f"no request was served while rank {dead} was down")
    out.seconds = time.monotonic() - t0
    return out


def run_router_crash(cluster: LocalCluster, sc: Scenario, unsafe: bool, index: int) -> Outcome:
    """The router dies with A in flight (its writer holding the second half): A's client
    sees the connection lost (never a 200), the router's job restarts it, every rank adopts
    its new card at its first message, what the old router left on the ranks (A's pages)
    is finished or released without it, and B is served by the new router."""
    assert isinstance(cluster, localcluster.DomainCluster)
    out = Outcome(sc.name, unsafe)
    t0 = time.monotonic()
    pair = Pair.of(sc, index)
    tail = LogTail.at_end(cluster.log)
    old = cluster.incarnation_of(0)
    with ThreadPoolExecutor(1) as pool:
        answer_a = pool.submit(_post_or_lost, cluster, pair.prompt_a, sc.max_tokens)
        rid = _logged(
            out, lambda: tail.wait_for(r"fault: request (\S+): pause at mid-transfer", 30)[1]
        )
        down_at = time.monotonic()
        if rid is not None:
            cluster.kill_rank(0)
        out.a_status, body_a, took_a = answer_a.result()
    _check_a(sc, out, pair.prompt_a, body_a, took_a)
    if _logged(out, lambda: _wait_front_door(cluster, REJOIN_S)) is None:
        out.seconds = time.monotonic() - t0
        return out
    out.front_door_down_s = round(time.monotonic() - down_at, 2)
    if cluster.incarnation_of(0) == old:
        out.problems.append("the router answers, but in its old incarnation")
    before = cluster.metrics()  # the new router's counters
    out.b_status, body_b, _ = post(cluster, pair.prompt_b, PROMPT, None)
    _check_b_and_after(cluster, sc, out, pair, body_a, body_b, before, every_rank=True)
    if rid is not None and not re.search(rf"request {re.escape(rid)}: ", tail.text()):
        out.problems.append(f"nothing logged of request {rid} after the router died")
    out.seconds = time.monotonic() - t0
    return out


def client_rid(rid: str) -> str:
    """The client's request id of a decode group member's request (``rid.1`` -> ``rid``)."""
    return re.sub(r"\.\d+$", "", rid)


def _post_or_lost(cluster: LocalCluster, prompt: str, max_tokens: int):
    t0 = time.monotonic()
    try:
        return post(cluster, prompt, max_tokens, None)
    except (ConnectionError, urllib.error.URLError, http.client.HTTPException) as exc:
        return None, {"error": f"connection lost: {exc}"}, time.monotonic() - t0


def _wait_front_door(cluster: LocalCluster, timeout_s: float) -> bool:
    """Until /health answers 200 again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cluster.call("GET", "/health", timeout=2).status == 200:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the front door did not answer within {timeout_s:.0f} s")
        time.sleep(0.2)


def _rid_in(body: dict) -> str | None:
    found = re.search(r"request (req-[0-9a-f]+-\d+)", str(body.get("message", "")))
    return found[1] if found else None


def _wait_marked_dead(cluster: LocalCluster, timeout_s: float) -> int:
    """The rank the router marked as exited (or already restarted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for rank, why in cluster.status()["unhealthy"].items():
            if why.startswith(("exited", "rejoining")):
                return int(rank)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no rank marked exited within {timeout_s:.0f} s: {cluster.status()['unhealthy']}"
            )
        time.sleep(0.1)


def _serve_while_down(cluster: LocalCluster, dead: int, index: int, out: Outcome) -> None:
    """Requests sent while ``dead`` is out of service: each must be served by the others."""
    for k in range(SERVED_WHILE_DOWN):
        if str(dead) not in cluster.status()["unhealthy"]:
            break
        mark = _marker(1000 + 10 * index + k, index + 7)
        prompt = make_prompt(mark, PROMPT)
        status, body, _ = post(cluster, prompt, 16, None)
        if status == 200 and body.get("text") == expected_replay(prompt, 16):
            out.served_during_failure += 1
            out.ok_answers += 1
        else:
            out.problems.append(
                f"a request on the healthy ranks got {status} while rank {dead} was down: "
                f"{str(body)[:160]}"
            )


def _check_rejoin_order(tail: LogTail, rid: str, dead: int, out: Outcome) -> None:
    """The replacement was admitted only after A's pages (quarantined on a live owner)
    were released."""
    text = tail.text()
    released = re.search(rf"request {re.escape(rid)}: \d+ pages released", text)
    admitted = re.search(rf"rank {dead} rejoined as incarnation", text)
    if released is not None and admitted is not None and admitted.start() < released.start():
        out.problems.append(
            f"rank {dead} was admitted again before request {rid}'s pages were released"
        )


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _check_releases(before: dict, after: dict, out: Outcome) -> list[str]:
    """Every release of the row carried its proof (``kvferry_releases_total``): one at
    least (B's), and in safe mode none without proof."""
    was, now = releases_by_justification(before), releases_by_justification(after)
    out.releases = {k: n - was.get(k, 0.0) for k, n in now.items() if n > was.get(k, 0.0)}
    if not out.releases:
        return ["no release counted in kvferry_releases_total"]
    unproven = {k: n for k, n in out.releases.items() if not is_justified(k)}
    if unproven and not out.unsafe:
        return [f"releases without proof: {unproven}"]
    return []


def _check_counters(sc: Scenario, before: dict, after: dict, out: Outcome) -> list[str]:
    problems = _check_releases(before, after, out)
    ok = _delta(before, after, 'kvferry_requests_total{outcome="ok"}')
    want_ok = int(out.b_status == 200) + int(out.a_status == 200) + out.ok_answers
    if ok != want_ok:
        problems.append(f"requests ok counter moved by {ok}, expected {want_ok}")
    if sc.source == "admission":
        if _delta(before, after, 'kvferry_requests_total{outcome="rejected"}') != 1:
            problems.append("rejected counter did not move by 1")
    elif out.a_status != 200 and sc.source not in FRONT_DOOR_SOURCES:  # A's router is gone
        failed = sum(
            _delta(before, after, f'kvferry_requests_total{{outcome="{o}"}}')
            for o in ("aborted", "failed", "unavailable")
        )
        if failed < 1:
            problems.append("no failure or abort counted for A")
    if sc.source == "integrity" and not out.unsafe:
        moved = sum(
            _delta(before, after, k) for k in after if k.startswith("kvferry_integrity_failures")
        )
        if moved < 1:
            problems.append("integrity failure not counted")
    return problems


# ------------------------------------------------------------------ the suite
def unsafe_scenario(sc: Scenario) -> bool:
    """Run in unsafe mode too: a write is in flight at the abort (a crashed writer's is
    not: its process is gone; a corrupted part fails A, it puts nothing in flight)."""
    return sc.in_flight and sc.source not in CRASH_SOURCES and sc.source != "integrity"


def skipped() -> dict[str, str]:
    """The scenarios this machine cannot run, with the reason."""
    groups = {g.name: g for g in GROUPS}
    return {s.name: why for s in scenarios() if (why := groups[s.group].skip_reason) is not None}


def run_suite(
    unsafe_too: bool, log_dir: Path, only: str | None = None, group: str | None = None
) -> dict:
    """Every group's scenarios on its own cluster, safe mode, then (``unsafe_too``) the
    unsafe ones in unsafe mode; ``only``: the scenarios whose name contains it; ``group``:
    one group's. A group this machine cannot run is printed as skipped and not counted
    (``report["skipped"]``: scenario -> reason)."""
    all_sc = [
        s
        for s in scenarios()
        if (only is None or only in s.name) and (group is None or s.group == group)
    ]
    results: list[Outcome] = []
    skips: dict[str, str] = {}
    for unsafe in [False, True] if unsafe_too else [False]:
        for g in GROUPS:
            group_sc = [
                s for s in all_sc if s.group == g.name and (not unsafe or unsafe_scenario(s))
            ]
            if not group_sc:
                continue
            if g.skip_reason is not None:
                for sc in group_sc:
                    skips[sc.name] = g.skip_reason
                    _print_skip(sc, unsafe, g.skip_reason)
                continue
            results += _run_group(g, group_sc, unsafe, log_dir)
    safe = [r for r in results if not r.unsafe]
    unsafe_runs = [r for r in results if r.unsafe]
    summary = {
        "scenarios": len(safe),
        "passed": sum(r.passed for r in safe),
        "unsafe_scenarios": len(unsafe_runs),
        "unsafe_leaks_found": sum(r.leak for r in unsafe_runs),
        "releases": _sum_releases(safe),
        "unjustified_releases": sum(_unproven(r) for r in safe),
        "unsafe_unjustified_releases": sum(_unproven(r) for r in unsafe_runs),
        "served_during_failure": {
            r.scenario: r.served_during_failure
            for r in safe
            if r.scenario.split("@")[0] in CRASH_SOURCES
            and r.scenario.split("@")[0] not in FRONT_DOOR_SOURCES
        },
        "front_door_down_s": {
            r.scenario: r.front_door_down_s for r in safe if r.front_door_down_s is not None
        },
    }
    return {"summary": summary, "results": results, "skipped": skips}


def _unproven(r: Outcome) -> float:
    return sum(n for k, n in r.releases.items() if not is_justified(k))


def _sum_releases(rows: list[Outcome]) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in rows:
        for k, n in r.releases.items():
            total[k] = total.get(k, 0.0) + n
    return dict(sorted(total.items()))


def _run_group(
    group: Group, group_sc: list[Scenario], unsafe: bool, log_dir: Path
) -> list[Outcome]:
    args = [*group.args, *(a for s in group_sc for f in s.faults for a in ("--fault", f))]
    if unsafe:
        args.append(group.unsafe_flag)
    run: Callable[..., Outcome] = (
        run_partition
        if group.nodes == 2
        else run_crash
        if group.domains is not None
        else run_scenario
    )
    results = []
    with open_cluster(group, args, log_dir) as cluster:
        for i, sc in enumerate(group_sc):
            runner = run_router_crash if sc.source in FRONT_DOOR_SOURCES else run
            res = runner(cluster, sc, unsafe, i + (100 if unsafe else 0))
            results.append(res)
            _print_row(res)
    return results


def _print_skip(sc: Scenario, unsafe: bool, reason: str) -> None:
    print(f"{sc.name:<34} {'UNSAFE' if unsafe else 'safe':<6} skipped: {reason}", flush=True)


def _print_row(r: Outcome) -> None:
    mode = "UNSAFE" if r.unsafe else "safe"
    verdict = ("LEAK" if r.leak else "no leak") if r.unsafe else ("pass" if r.passed else "FAIL")
    print(
        f"{r.scenario:<38} {mode:<6} A={r.a_status!s:<4} B={r.b_status!s:<4} "
        f"foreign={len(r.foreign):<2}{' (B wrong)' if r.wrong_answer else ''}"
        f"{' (B: members disagree)' if r.members_disagreed else ''} "
        f"held={r.held_after:<4} {r.seconds:5.1f}s  {verdict}"
        + ("" if r.passed or r.unsafe else f"  {'; '.join(r.problems)[:200]}"),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvferry fault-suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--no-unsafe", action="store_true", help="skip the unsafe-mode run")
    p.add_argument("--only", help="run the scenarios whose name contains this")
    p.add_argument(
        "--group",
        choices=[g.name for g in GROUPS],
        help="run one group's scenarios (each group is one cluster)",
    )
    p.add_argument("--log-dir", help="where cluster logs go (default: a temporary folder)")
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{'scenario':<38} {'mode':<6} answers     checks", flush=True)
    report = run_suite(not args.no_unsafe, log_dir, args.only, args.group)
    s = report["summary"]
    print(f"cluster logs: {log_dir}")
    print(json.dumps(s))
    mid_unsafe = s["unsafe_scenarios"]
    ok = (
        s["passed"] == s["scenarios"]
        and s["unsafe_leaks_found"] == mid_unsafe
        and all(n > 0 for n in s["served_during_failure"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
