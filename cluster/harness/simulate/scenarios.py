"""The scenarios: a workload, the faults to inject, the network and the fleet's size.

Six scenarios (issue #17, and ``partition-long``), each at three scales (:data:`SCALES`):

- ``steady``: Poisson arrivals at ``load`` of the decode pages, 1 % of the requests
  aborted by their client at a random moment of their life;
- ``storm``: the same, and at 40 % of the arrivals half of every live request is aborted
  within one second;
- ``partition``: one rack of prefill ranks cut off from everything else for twice the
  abort deadline, from 30 % of the arrivals. A write stuck in it fails at the
  transport's failure horizon (the tcp horizon the engine sets up, about 4 s), before the
  abort deadline (5 s) runs out: nothing of it can land later, so ``release-on-sever``,
  which releases at the deadline, shows no leak here;
- ``partition-long``: the same cut for four abort deadlines, with a failure horizon of
  :data:`LONG_HORIZON_S` (a transport that keeps retransmitting, as tcp with long
  keep-alives and no user timeout does): a write stuck in the partition lands at the
  heal, after the deadline. The protocol keeps such pages until the writer acks (after
  the heal); ``release-on-sever`` releases them at the deadline, and the late write lands
  in released pages;
- ``crash``: prefill ranks crash at 1 % per rank-hour, sped up so that the simulated span
  holds an hour's worth at 1,000 ranks (10 crashes) and at least 2 at smaller scales (the
  speed-up is reported);
- ``slow``: 1 % of the prefill ranks (at least one) stall, right after posting a write,
  for the transfer timeout plus twice the abort deadline: past the deadline, with a write
  in flight.

Prefill and decode ranks sit on hosts of their own (8 ranks a host, 4 hosts a rack at
1,000 ranks; 4 x 4 at 100; 2 x 2 at 10), so an owner never shares a host with its
writers: a crashed writer's quarantined pages are released on its launcher's exit record
(published as the process dies) once the transport's failure horizon has passed, as the
runtime does; a writer that never acks and never dies keeps them (reported as stranded,
the price I4 asks). The validation's layout puts every rank on one host, as the local
cluster does.

The protocol's timings (abort deadline, transfer timeout, request deadline, admission
wait, context length) are the service's defaults (:class:`kvferry.cluster.config.ServeConfig`).
The workload's sizes are assumptions, stated here: a Llama-70B-like KV (80 layers x 8 KV
heads x 128 dims x K and V x 2 bytes = 320 KiB a token, 20 MiB a 64-token page), 1,024
pages a decode rank (64 Ki tokens), prompts of 512-4,096 tokens, 64-256 new tokens,
25 ms a decode step, 50,000 prompt tokens a second a prefill rank, 200 Gb/s links.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvferry.cluster.config import ServeConfig

from .network import LATENCIES, NetConfig
from .ranks import RankTimes
from .service import MEASURED, ServiceModel

SERVE = ServeConfig()
KV_BYTES_PER_TOKEN = 80 * 8 * 128 * 2 * 2
SIM_PAGE_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: tuple[int, int] = (512, 4096)  # uniform
    max_tokens: tuple[int, int] = (64, 256)  # uniform
    load: float = 0.7  # offered share of the decode pages
    # 64-token pages (the service's default is 16): the allocator's work is per page, and
    # a fleet of 1,000 ranks must run in minutes; 1,024 pages hold 64 Ki tokens a rank.
    page_size: int = SIM_PAGE_TOKENS
    page_bytes: int = SIM_PAGE_TOKENS * KV_BYTES_PER_TOKEN
    decode_pages: int = 1024
    prefill_pages: int = 1024
    # The validation's pacing (bench-abort): one request at a time, each cancelled by its
    # client after a time drawn from ``cancel_after``, the next once every page is free.
    sequential: bool = False
    cancel_after: tuple[float, float] | None = None
    pause_before_write_s: float = 0.0  # bench-abort's at:before-write:pause


@dataclass(frozen=True)
class Faults:
    client_abort: float = 0.01  # share of requests their client aborts
    storm: bool = False
    storm_at: float = 0.4  # share of the arrival span
    storm_share: float = 0.5
    storm_window_s: float = 1.0
    partition_racks: int = 0
    partition_at: float = 0.3
    partition_deadlines: float = 2.0  # its length, in abort deadlines
    crash_per_hour: float = 0.0  # per prefill rank
    stalls: float = 0.0  # share of prefill ranks that stall (at least one when > 0)
    stall_s: float | None = None  # default: transfer timeout + 2 x abort deadline


@dataclass(frozen=True)
class Scenario:
    name: str
    prefill: int
    decode: int
    workload: Workload
    faults: Faults = field(default_factory=Faults)
    tp: int = 2
    net: NetConfig = field(default_factory=NetConfig)
    times: RankTimes = field(
        default_factory=lambda: RankTimes(prefill_tokens_per_s=50_000.0, prefill_layers=80)
    )
    ranks_per_host: int = 8
    hosts_per_rack: int = 4
    colocate: bool = False
    unsafe: bool = False
    release_on_sever: bool = False
    seed: int = 1
    abort_deadline_s: float = SERVE.abort_deadline_s
    transfer_timeout_s: float = SERVE.transfer_timeout_s
    request_timeout_s: float = SERVE.request_timeout_s
    admission_wait_s: float = SERVE.admission_wait_s
    context_length: int = SERVE.context_length
    service: ServiceModel | None = MEASURED  # None: ranks take no time (.service)
    tags: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def scale(self) -> str:
        return f"{self.prefill}x{self.decode}"

    @property
    def mode(self) -> str:
        if self.unsafe:
            return "unsafe"
        return "release-on-sever" if self.release_on_sever else "safe"


# name -> (prefill ranks, decode ranks, ranks a host, hosts a rack, default requests)
SCALES: dict[str, tuple[int, int, int, int, int]] = {
    "10x10": (10, 10, 2, 2, 300),
    "100x100": (100, 100, 4, 4, 3_000),
    "1000x1000": (1000, 1000, 8, 4, 30_000),
}
NAMES = ("steady", "storm", "partition", "partition-long", "crash", "slow")
LONG_HORIZON_S = 60.0  # partition-long's failure horizon: past the heal
MODES = ("safe", "unsafe", "release-on-sever")


def build(
    name: str,
    scale: str,
    *,
    requests: int | None = None,
    mode: str = "safe",
    seed: int = 1,
    network: str = "local",
    loss: float = 0.0,
    dup: float = 0.0,
    reorder: float = 0.0,
    tp: int = 2,
    service: bool = True,
    partition_deadlines: float | None = None,
    failure_horizon_s: float | None = None,
) -> Scenario:
    """One scenario at one scale. ``partition_deadlines`` sets the partition's length (in
    abort deadlines) and ``failure_horizon_s`` how long the transport retransmits through
    it before giving up (default: the tcp horizon the engine sets up)."""
    prefill, decode, rph, hpr, default_requests = SCALES[scale]
    faults = {
        "steady": Faults(),
        "storm": Faults(storm=True),
        "partition": Faults(partition_racks=1),
        "partition-long": Faults(partition_racks=1, partition_deadlines=4.0),
        "crash": Faults(crash_per_hour=0.01),
        "slow": Faults(stalls=0.01),
    }[name]
    if partition_deadlines is not None:
        faults = replace(faults, partition_deadlines=partition_deadlines)
    net = replace(NetConfig(), latency=LATENCIES[network], loss=loss, dup=dup, reorder=reorder)
    if name == "partition-long":
        net = replace(net, failure_horizon_s=LONG_HORIZON_S)
    if failure_horizon_s is not None:
        net = replace(net, failure_horizon_s=failure_horizon_s)
    return Scenario(
        name=name,
        prefill=prefill,
        decode=decode,
        workload=Workload(requests=requests or default_requests),
        faults=faults,
        tp=tp,
        net=net,
        ranks_per_host=rph,
        hosts_per_rack=hpr,
        unsafe=mode == "unsafe",
        release_on_sever=mode == "release-on-sever",
        seed=seed,
        service=MEASURED if service else None,
    )


def validation(
    case: str, prefill: int, decode: int, requests: int, seed: int = 7, service: bool = True
) -> Scenario:
    """bench-abort's cluster cases (:func:`kvferry.cluster.harness.benchabort.run_case`) in
    the simulator, with the fault suite's context, pool and deadlines: one request at a
    time, 256 new tokens; ``quarantined``: the writer pauses 1 s before its first write and
    the client cancels after 50 ms, so every abort waits for the writer's ack;
    ``random``: cancelled after 1-31 ms, wherever the request is. The ranks' times are
    the replay model's on this CPU, measured (:data:`REPLAY_TIMES`)."""
    from ..benchabort import TAG
    from ..faultsuite import ABORT_DEADLINE, CONTEXT, REQUEST_TIMEOUT, TRANSFER_TIMEOUT

    quarantined = case == "quarantined"
    prompt = 256 + (len(TAG) if quarantined else 0)
    pool_pages = SUITE_POOL_TOKENS // SERVE.page_size
    workload = Workload(
        requests=requests,
        prompt_tokens=(prompt, prompt),
        max_tokens=(256, 256),
        page_bytes=SERVE.page_size * 2 * SERVE.layers * SERVE.kv_heads * SERVE.head_dim * 4,
        decode_pages=pool_pages,
        prefill_pages=pool_pages,
        sequential=True,
        cancel_after=(0.05, 0.05) if quarantined else (0.001, 0.031),
        pause_before_write_s=1.0 if quarantined else 0.0,
    )
    return Scenario(
        name=f"validate-{case}",
        prefill=prefill,
        decode=decode,
        workload=workload,
        faults=Faults(client_abort=0.0),
        tp=1,
        times=REPLAY_TIMES,
        ranks_per_host=1 + prefill + decode,
        hosts_per_rack=1,
        colocate=True,
        seed=seed,
        abort_deadline_s=ABORT_DEADLINE,
        transfer_timeout_s=TRANSFER_TIMEOUT,
        request_timeout_s=REQUEST_TIMEOUT,
        context_length=CONTEXT,
        service=MEASURED if service else None,
    )


SUITE_POOL_TOKENS = 16384  # the fault suite's --pool-tokens (faultsuite.suite_args)

# The replay model of a fault-suite cluster on this CPU (1 layer, 2 KV heads of 32 dims,
# fp32, 16-token pages, integrity checks on), measured with ``simulate --calibrate``:
# the real DecodeRank.step for batches of 1-32 (medians 1.85, 2.29, 2.70, 4.06, 5.44,
# 7.60 ms: 2.07 ms + 0.183 ms a request) and the real PrefillPath.solo_steps with
# its checksums for 64-2,048 tokens (0.50 ms + 2.70 us a token). verify_gbps is not
# measured (the checks of a 256-token prompt's 16 pages take microseconds either way).
REPLAY_TIMES = RankTimes(
    prefill_tokens_per_s=1 / 2.70e-6,
    prefill_base_s=0.50e-3,
    decode_step_s=2.07e-3,
    decode_step_per_seq_s=0.183e-3,
    verify_gbps=5.0,
)
