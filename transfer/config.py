"""The engine's configuration: transports, UCX options and how they are planned.

:class:`TransferConfig` is what an operator or a rank sets; :func:`plan_options` turns it
(with the environment) into the options ``ucp_init`` gets and the environment UCX's
transports read, each with where it came from (asking UCX only which options its
transports have). Nothing here creates a context, a worker or an endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import memtypes, ucxinfo
from .memtypes import MemoryType

TRANSPORT_PRESETS = {"shm": "sm,self", "tcp": "tcp,self", "rdma": "rc,ud,dc,self"}
# Added to a preset when the config asks for CUDA memory: cuda_ipc moves device memory
# between processes on one host (GPU to GPU, one-sided), cuda_copy between host and
# device and as the staging copy of pipelined protocols.
CUDA_TLS = "cuda_copy,cuda_ipc"
TCP_FAILURE_OPTIONS = {
    "TCP_KEEPIDLE": "1s",
    "TCP_KEEPINTVL": "1s",
    "TCP_KEEPCNT": "3",
    "TCP_USER_TIMEOUT": "4s",
}
# tcp: how many times UCX reads a ready socket in one progress call (UCX's default: 16).
# With 16, loopback tcp here fell into rows at half speed (about 2 GB/s at 256 KiB pages
# against 3.6-5.0, and 0.95 against 1.8 at 16 KiB) in 6 of 16 process pairs; with 256, in
# none of 11 (transfer/README.md, "Benchmark"). A call then reads a socket at most 256
# times before it returns.
TCP_THROUGHPUT_OPTIONS = {"TCP_MAX_POLL": "256"}
# RC: the NIC runs a 0.5 s timeout as 4.096 us x 2^17 = 0.54 s per try; 8 tries (7 retries)
# take 4.3 s, inside the 5 s default abort deadline as tcp's 4 s are. UCX's defaults
# (1.0 s, 7) give 1.07 s x 8 = 8.6 s.
RC_FAILURE_OPTIONS = {"RC_TIMEOUT": "0.5s", "RC_RETRY_COUNT": "7"}
RC_UCX_DEFAULTS = {"RC_TIMEOUT": "1.0s", "RC_RETRY_COUNT": "7"}
# Options below ucp, by prefix: the (component, transport) this UCX reads them for.
TL_OPTION_HOMES = {
    "TCP_": ("tcp", "tcp"),
    "RC_": ("ib", "rc_verbs"),
    "UD_": ("ib", "ud_verbs"),
    "DC_": ("ib", "dc_mlx5"),
    "IB_": ("ib", "rc_verbs"),
}
UCS_ERR_NO_ELEM = -12
UCS_ERR_BUSY = -15
UCS_ERR_OUT_OF_RANGE = -19
RDMA_TLS_WORDS = (
    "rc",
    "ud",
    "dc",
    "rc_verbs",
    "rc_mlx5",
    "ud_verbs",
    "ud_mlx5",
    "dc_mlx5",
    "rc_x",
    "ud_x",
    "dc_x",
    "ib",
)
MessageHandler = Callable[[bytes, bytes], None]


@dataclass
class TransferConfig:
    """Engine settings. ``transports``: ``"shm"``, ``"tcp"``, ``None`` or a UCX_TLS list."""

    transports: str | None = None
    name: str = ""
    direct_copy: bool = True  # copy pages directly into mapped remote memory
    streaming_stores: bool = True  # ... with non-temporal stores (no read-for-ownership)
    streaming_min_bytes: int = 1 << 20  # ... for batches of at least this many bytes
    prefault_direct: bool = True  # ... mapped with its page tables populated up front
    # Into memory a peer on this host registered itself (not mappable here): the kernel's
    # cross-memory copy, up to 1024 pages a system call, instead of one UCX put per page.
    cross_memory_copy: bool = True
    max_message_bytes: int = 256 << 10  # payload limit of notify/send (and of receipt)
    spin_us: int = 50  # busy-poll at least this long before sleeping
    busy_poll_us: int = 1000  # ... and until this long after the last activity
    liveness_interval_s: float = 0.005  # how often waits look at the peer's process
    default_timeout_s: float = 30.0  # Batch.wait() without a timeout
    close_timeout_s: float = 2.0  # bound on endpoint close
    tcp_failure_detection: bool = True  # tcp keep-alive so a silent partition fails
    rc_failure_detection: bool = True  # RC timeout x retries inside the abort deadline
    ucx_options: dict[str, str] = field(default_factory=dict)  # extra ucp_config_modify keys
    # Memory the engine registers: ("host",), or ("host", "cuda") for CUDA segments (CUDA
    # is initialised before ucp_init and the start refused unless UCX can move it).
    memory_types: tuple[str, ...] = ("host",)
    cuda_device: int | None = None  # None: torch's current device (else 0)
    # Injected fault for tests that must show they can fail: skip page i of every write.
    fault_skip_page: int | None = None

    def wants_cuda(self) -> bool:
        return MemoryType.CUDA in {memtypes.parse(m) for m in self.memory_types}

    def tls(self) -> str | None:
        """The UCX_TLS list these transports stand for (None: UCX's default); a preset
        gains the CUDA transports when CUDA memory is asked for."""
        preset = TRANSPORT_PRESETS.get(self.transports or "")
        if preset is None:
            return self.transports
        return f"{preset},{CUDA_TLS}" if self.wants_cuda() else preset

    def uses_tcp(self) -> bool:
        tls = self.tls()
        return tls is None or tls == "all" or "tcp" in tls.split(",")

    def uses_rc(self) -> bool:
        tls = self.tls()
        return tls is None or tls == "all" or any(w in RDMA_TLS_WORDS for w in tls.split(","))

    def engine_defaults(self) -> dict[str, str]:
        """The options the engine sets unless ``ucx_options`` (or, for transport options,
        the operator's ``UCX_*`` environment) says otherwise."""
        opts: dict[str, str] = {}
        tls = self.tls()
        if tls:
            opts["TLS"] = tls
        if self.uses_tcp():
            opts.update(TCP_THROUGHPUT_OPTIONS)
            if self.tcp_failure_detection:
                opts.update(TCP_FAILURE_OPTIONS)
        if self.rc_failure_detection and self.uses_rc() and self.transports is not None:
            opts.update(RC_FAILURE_OPTIONS)
        return opts

    def resolved_ucx_options(self) -> dict[str, str]:
        return {**self.engine_defaults(), **self.ucx_options}


@dataclass
class TransferCounters:
    bytes_written: int = 0
    bytes_read: int = 0
    batches: int = 0
    pages_posted: int = 0
    pages_direct: int = 0  # copied without a UCX request (mapped or cross-memory)
    pages_cross_memory: int = 0  # ... of which by the kernel's cross-memory copy
    completed: int = 0
    failures: int = 0
    timeouts: int = 0
    notifies: int = 0
    notifies_flushed: int = 0  # notices that waited for an endpoint flush (UCX puts before)
    messages_sent: int = 0
    messages_received: int = 0
    malformed_messages: int = 0
    dropped_messages: int = 0
    handler_errors: int = 0
    peers_failed: int = 0
    bounds_refused: int = 0
    stale_refused: int = 0
    stream_syncs: int = 0  # writes from CUDA segments that waited for their producer
    unflushable_peers: int = 0  # remote engines closed or failed with writes not flushed
    notices_refused: int = 0  # notices to those engines: no flush can order them


def _tl_home(key: str) -> tuple[str, str, str] | None:
    """(component, transport, option) of a transport-level option, None for ucp's own."""
    for prefix, (component, tl) in TL_OPTION_HOMES.items():
        if key.startswith(prefix):
            return component, tl, key[len(prefix) :]
    return None


@dataclass
class OptionPlan:
    """How each resolved option reaches UCX: ucp's own through ``ucp_config_modify``,
    transport options through the environment, some left to the operator's environment,
    some left out because this UCX lacks them."""

    ucp: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)  # UCX_KEY -> value
    operator: dict[str, str] = field(default_factory=dict)  # UCX_KEY -> operator's value
    unsupported: list[str] = field(default_factory=list)


def plan_options(
    options: dict[str, str], defaults: dict[str, str], explicit: dict[str, str], env: dict[str, str]
) -> OptionPlan:
    plan = OptionPlan()
    for key, value in options.items():
        home = _tl_home(key)
        if home is None:
            plan.ucp[key] = value
            continue
        name = f"UCX_{key}"
        if key in defaults and key not in explicit and name in env:
            plan.operator[name] = env[name]
            continue
        if ucxinfo.iface_option(*home)[0] == UCS_ERR_NO_ELEM and home[0] == "tcp":
            plan.unsupported.append(f"{key}={value} (this UCX's {home[1]} has no {home[2]} option)")
            continue
        plan.environment[name] = value
    return plan


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in the process environment (where UCX reads them), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
