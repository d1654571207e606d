"""The transfer engine: one-sided page writes and reads between registered memory of
processes, over UCX, with a Mooncake-like batch API.

Upholds, for the layers above:

- I4 (no release without proof): a completed ``write`` batch, ``quiesce`` and the data
  before a ``notify`` are *flushed*: every earlier put to that peer is visible at the
  target. ``close(peer, force=True)`` severs the endpoint. Registered memory is never
  freed behind a peer's back (``deregister`` is explicit).
- I5 (decode reads only what was written): page lists are bounds-checked against both
  segments before anything is posted; descriptors of another incarnation are refused.
- I6 (every fault is visible): failures raise named exceptions carrying the peer's name
  and are counted; every wait is bounded by a deadline.

Threading: an engine is single-threaded (``UCS_THREAD_MODE_SINGLE``). One thread owns it
and makes every call; nothing runs in the background. Incoming messages are delivered from
inside :meth:`progress` (also driven by :meth:`wait`). For asyncio, ``add_reader`` on
:meth:`fileno` and call ``progress(0)`` when it is readable.

Batches: the engine evaluates them. :meth:`poll` reads a batch's status without blocking,
progressing or touching an endpoint; :meth:`wait` drives progress until it settles or its
deadline passes. Endpoint failures are acted on in the engine's progress path
(:meth:`progress`, :meth:`wait` and posting): a batch that failed with a status meaning
the path to the peer is gone, or a local peer whose process exited while it has
unsettled batches, marks the peer failed and severs its endpoint there.

Transports (``TransferConfig.transports``):

- ``"shm"``: UCX shared-memory transports (``sm``: posix, sysv, cma, plus xpmem/knem
  where present) and ``self``. Writes into memory the target obtained with
  :meth:`TransferEngine.allocate` (``UCP_MEM_MAP_ALLOCATE``: posix/sysv shared memory)
  are copied directly by the initiator through ``ucp_rkey_ptr`` (one memcpy per page in C;
  the target runs nothing). Writes into memory the target merely registered go through
  ``ucp_put_nbx`` over cma (``process_vm_writev``), also one-sided. Prefer ``allocate``
  for destinations: it is the fastest path.
- ``"tcp"``: tcp and self. The target must call :meth:`progress` (UCX emulates RMA over
  tcp in software). Keep-alive and ``TCP_USER_TIMEOUT`` are set so that a silently
  partitioned peer fails within seconds.
- ``"rdma"``: UCX's rc, ud and dc transports over verbs, and self. Refused at start
  (:class:`RdmaUnavailableError`, naming what is missing) when this UCX was built without
  verbs or finds no RDMA device. RC's local ACK timeout and retry count are set (unless the
  operator's ``UCX_RC_TIMEOUT`` / ``UCX_RC_RETRY_COUNT`` are) so that a silent peer fails
  within the default abort deadline (see :mod:`kvferry.transfer.horizon`).
- ``None``: UCX's defaults (every transport it finds); any other string is used as
  ``UCX_TLS`` as is.

Memory types (``TransferConfig.memory_types``, :mod:`kvferry.transfer.memtypes`): host
memory always; with ``"cuda"`` the engine makes a CUDA context current before
``ucp_init``, adds ``cuda_copy,cuda_ipc`` to the ``"shm"`` and ``"tcp"`` presets, and
refuses at start (:class:`CudaMemoryUnavailableError`, naming what is missing) unless
the UCX context reports CUDA among its memory types. :meth:`TransferEngine.register`
then takes CUDA tensors (or ``__cuda_array_interface__`` arrays, or a device pointer with
``memory_type="cuda"``) and maps them as CUDA memory, never bouncing them through host
memory. A write from a CUDA segment first waits for the stream that produced its bytes
(UCX's cuda transports copy on their own streams), see :meth:`TransferEngine.write`.

Transport-level options (``TCP_*``, ``RC_*``, ...) reach UCX through its ``UCX_*``
environment for the duration of the worker's creation: UCX 1.13 ignores them in
``ucp_config_modify``. An operator's own ``UCX_*`` variable wins over the engine's
default; an option this UCX does not have is left out and listed by :meth:`describe`.

UCX's peer error-handling mode is deliberately left at its default: ``PEER`` mode breaks
shared-memory endpoints and slows tcp/cma RMA to software emulation. Peer death is
detected from request errors, from the peer's process (a pidfd, when it runs on this
host) and by deadlines.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import _native as native
from . import horizon as horizons
from . import memtypes, ucxinfo
from ._native import ffi, lib
from .batch import Batch, BatchStatus
from .envelope import REASONS as ENVELOPE_REFUSALS
from .envelope import EnvelopeError
from .errors import (
    PEER_FAILURE_STATUSES,
    CudaMemoryUnavailableError,
    DeadlineExceeded,
    PeerFailedError,
    StaleIncarnationError,
    TransferError,
    WireError,
    status_name,
    ucx_error,
)
from .memtypes import MemoryType
from .pages import as_page_array, check_pages
from .peer import Peer, PeerState
from .protocol import (
    ADDRESS,
    CODEC,
    MAX_PAYLOAD,
    MAX_SENDER,
    AddressInfo,
    IncomingMessage,
    decode_address,
)
from .segment import RemoteSegment, Segment, SegmentDescriptor

log = logging.getLogger("kvferry.transfer")

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
        if self.tcp_failure_detection and self.uses_tcp():
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
    pages_direct: int = 0
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


def _check(status: int, what: str, peer: str | None = None) -> None:
    if status != 0:
        raise ucx_error(int(status), what, peer)


def _host_identity() -> tuple[str, str, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return socket.gethostname(), boot_id, pidns


def _buffer_pointer(buf: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous host buffer: numpy array, CPU torch tensor, or any
    writable buffer-protocol object."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("register: numpy array must be C-contiguous")
        return buf.ctypes.data, buf.nbytes
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # torch.Tensor
        if buf.device.type != "cpu":
            raise ValueError(f"register: tensor on {buf.device} (only CPU memory here)")
        if not buf.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    view = ffi.from_buffer(buf, require_writable=True)
    return int(ffi.cast("uintptr_t", view)), len(view)


class TransferEngine:
    """See the module docstring. ``incarnation`` is random per engine; ``address`` is what
    peers pass to :meth:`connect`."""

    def __init__(self, config: TransferConfig | None = None):
        self.config = config or TransferConfig()
        self.incarnation = secrets.randbits(64) | 1
        self.counters = TransferCounters()
        self._rdma = ucxinfo.check_rdma() if self.config.transports == "rdma" else None
        # CUDA before ucp_init: UCX's cuda transports take the context current at start.
        self._cuda_init = (
            memtypes.init_cuda(self.config.cuda_device) if self.config.wants_cuda() else None
        )
        self._options = self.config.resolved_ucx_options()
        self._plan = plan_options(
            self._options, self.config.engine_defaults(), self.config.ucx_options, dict(os.environ)
        )
        opt_text = ffi.new(
            "char[]", "\n".join(f"{k}={v}" for k, v in self._plan.ucp.items()).encode()
        )
        bad_option = ffi.new("char[]", 128)
        params = ffi.new("kvf_worker_params_t *")
        params.field_mask = (
            native.WORKER_PARAM_FIELD_OPTIONS
            | native.WORKER_PARAM_FIELD_MAX_SENDER
            | native.WORKER_PARAM_FIELD_MAX_PAYLOAD
            | native.WORKER_PARAM_FIELD_BUSY_POLL_US
            | native.WORKER_PARAM_FIELD_SPIN_US
            | native.WORKER_PARAM_FIELD_BAD_OPTION
        )
        params.max_am_bytes = min(self.config.max_message_bytes, MAX_PAYLOAD) + (128 << 10)
        params.options = opt_text
        params.max_sender = MAX_SENDER
        params.max_payload = min(self.config.max_message_bytes, MAX_PAYLOAD)
        params.busy_poll_us = self.config.busy_poll_us
        params.spin_us = self.config.spin_us
        params.bad_option = bad_option
        params.bad_option_length = len(bad_option)
        out = ffi.new("kvf_worker_h *")
        with _environment(self._plan.environment):
            st = int(lib.kvf_worker_create(params, out))
            # read while the worker's environment is in place
            horizon = self._read_horizon() if st == 0 else None
        if st != 0 or horizon is None:
            bad = ffi.string(bad_option).decode()
            raise ucx_error(
                st,
                "creating the UCX context/worker"
                + (f" (option {bad}={self._options.get(bad)!r})" if bad else ""),
            )
        self._horizon = horizon
        self._worker: Any = out[0]  # kvf_worker_h
        self._memory = self._memory_report()
        if self.config.wants_cuda():
            try:
                memtypes.require(MemoryType.CUDA, self._memory)
            except CudaMemoryUnavailableError:
                lib.kvf_worker_destroy(self._worker)
                raise
        addr, alen = ffi.new("void **"), ffi.new("size_t *")
        _check(lib.kvf_worker_address(self._worker, addr, alen), "worker address")
        ucx_address = bytes(ffi.buffer(addr[0], alen[0]))
        lib.kvf_worker_address_release(self._worker, addr[0])
        fd = ffi.new("int *")
        _check(lib.kvf_worker_efd(self._worker, fd), "the worker's event fd")
        self._efd = int(fd[0])
        self._wait_count: Any = ffi.new("unsigned *")  # kvf_worker_wait's output
        # Reused for every batch and message (single-threaded): the fields that never
        # change are set once, the sender address kept alive here.
        self._sender = ffi.from_buffer(b"")
        self._rma_param: Any = ffi.new("kvf_rma_param_t *")
        self._msg_param: Any = ffi.new("kvf_msg_param_t *")
        host, boot_id, pidns = _host_identity()
        self._identity = (host, boot_id, pidns)
        self.name = self.config.name or f"{host}:{os.getpid()}"
        self.address: bytes = CODEC.encode(
            ADDRESS.make(
                ucx=ucx_address,
                incarnation=self.incarnation,
                name=self.name,
                host=host,
                boot_id=boot_id,
                pidns=pidns,
                pid=os.getpid(),
            )
        )
        self._sender = ffi.from_buffer(self.address)
        self._msg_param.sender = self._sender
        self._msg_param.sender_length = len(self.address)
        self._msg_param.incarnation = self.incarnation
        self._rma_param.notice = self._msg_param
        self._peers: dict[bytes, Peer] = {}
        self._segments: list[Segment] = []
        self._inflight: list[tuple[Any, Any]] = []  # (kvf_batch_t *, keep-alive refs)
        self._sweep_at = 256
        # Peers whose batches failed with a peer-failure status, seen by poll(): marked
        # failed and severed in the progress path (poll itself touches no endpoint).
        self._failed_peers: list[tuple[Peer, str]] = []
        self._next_liveness_check = 0.0
        self._handler: MessageHandler | None = None
        self._senders: dict[bytes, AddressInfo] = {}
        self._inbox: deque[IncomingMessage] = deque()
        self._seq = itertools.count(1)
        self._closed = False
        # -1: never stream; else the batch size (bytes) from which direct copies stream
        self._streaming_min_bytes = (
            max(0, self.config.streaming_min_bytes) if self.config.streaming_stores else -1
        )
        log.info("transfer engine %s: %s", self.name, self.describe())

    # ----------------------------------------------------------------- description
    def describe(self) -> dict[str, Any]:
        """UCX version and library, build source (which UCX and why), the UCP API it was
        built against, what that build lacks, requested transports and options (and those
        this UCX lacks), the RDMA devices and transports (``transports="rdma"``), the
        failure horizon, and the transports each connected peer's endpoint uses."""
        out: dict[str, Any] = {
            "ucx_version": ffi.string(lib.kvf_version_string()).decode(),
            "ucx_library": ffi.string(lib.kvf_library_path()).decode(),
            "ucx_build": ffi.string(lib.kvf_ucx_source()).decode(),
            "ucx_built_against": ucxinfo.versions()["built"],
            "ucx_unavailable": ucxinfo.unavailable_features() + self._plan.unsupported,
            "transports_requested": self._options.get("TLS", "all (UCX default)"),
            "ucx_options": dict(self._options),
            "ucx_environment": {**self._plan.operator},
            "failure_horizon": self._horizon.how,
            "incarnation": f"{self.incarnation:#018x}",
            "name": self.name,
            "peers": {
                p.name: {
                    "state": p.state.value,
                    "transports": p.transports,
                    "transports_from": p.transports_from,
                }
                for p in self._peers.values()
            },
        }
        if self._rdma is not None:
            out["rdma"] = dict(self._rdma)
        registered: dict[str, dict[str, int]] = {}
        for seg in self._segments:
            row = registered.setdefault(seg.memory_type, {"segments": 0, "bytes": 0})
            row["segments"] += 1
            row["bytes"] += seg.length
        out["memory_types"] = {
            "requested": [memtypes.parse(m).value for m in self.config.memory_types],
            "ucx": memtypes.ucs_type_names(self._memory.ucs_mask),
            "registered": registered,
            "cuda_transports": self._memory.cuda_components(),
            "cuda_init": self._cuda_init,
        }
        return out

    def _memory_report(self) -> memtypes.UcxMemoryReport:
        """What this engine's UCX context can map (ucp_context_query's memory_types)."""
        kvf_mask, ucs_mask = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        _check(lib.kvf_memory_types(self._worker, kvf_mask, ucs_mask), "querying memory types")
        return memtypes.UcxMemoryReport(
            kvf_mask=int(kvf_mask[0]),
            ucs_mask=int(ucs_mask[0]),
            ucx_version=ffi.string(lib.kvf_version_string()).decode(),
            ucx_library=ffi.string(lib.kvf_library_path()).decode(),
            tls=self._options.get("TLS"),
            components=tuple(ucxinfo.inventory().components),
        )

    def supports_memory_type(self, memory_type: str) -> bool:
        """Whether this engine's UCX context can register and move ``memory_type``."""
        return self._memory.supports(memtypes.parse(memory_type))

    def failure_horizon(self) -> horizons.FailureHorizon:
        """How long a silent connected peer can count as alive on these transports
        (``log_record(abort_deadline_s)`` gives the start-up log line)."""
        return self._horizon

    def _option_value(self, key: str, ucx_default: str | None = None) -> str | None:
        """What the worker read for a transport option: this UCX's own report when it
        can give one, else the engine's or operator's value, else ``ucx_default``."""
        home = _tl_home(key)
        st, value = ucxinfo.iface_option(*home) if home else (UCS_ERR_NO_ELEM, "")
        if st == 0 and value:
            return value
        name = f"UCX_{key}"
        return (
            self._plan.environment.get(name)
            or self._plan.operator.get(name)
            or self._plan.ucp.get(key)
            or ucx_default
        )

    def _read_horizon(self) -> horizons.FailureHorizon:
        parts: list[horizons.FailureHorizon] = []
        if self.config.uses_tcp():
            supported = ucxinfo.iface_option("tcp", "tcp", "USER_TIMEOUT")[0] != UCS_ERR_NO_ELEM
            parts.append(
                horizons.tcp_horizon(
                    self._option_value("TCP_KEEPIDLE"),
                    self._option_value("TCP_KEEPINTVL"),
                    self._option_value("TCP_KEEPCNT"),
                    self._option_value("TCP_USER_TIMEOUT"),
                    supported,
                )
            )
        if self.config.uses_rc() and (self._rdma is not None or ucxinfo.inventory().rdma_devices()):
            parts.append(
                horizons.rc_horizon(
                    self._option_value("RC_TIMEOUT", RC_UCX_DEFAULTS["RC_TIMEOUT"]),
                    self._option_value("RC_RETRY_COUNT", RC_UCX_DEFAULTS["RC_RETRY_COUNT"]),
                )
            )
        tls = self.config.tls()
        if tls is None or "sm" in tls.split(",") or tls == "all" or not parts:
            parts.append(horizons.SHM_HORIZON)
        return horizons.combine(parts)

    def fileno(self) -> int:
        """UCX's event fd: readable when :meth:`progress` has work (:meth:`arm` it first;
        progress with a timeout does that itself)."""
        return self._efd

    def arm(self) -> bool:
        """Prepare to sleep on :meth:`fileno` in another event loop. True: armed, the fd
        becomes readable at the next event. False: work is pending (UCX events, or
        messages not yet delivered): call :meth:`progress` and arm again."""
        self._require_open()
        st = int(lib.kvf_worker_arm(self._worker))
        if st == UCS_ERR_BUSY:
            return False
        _check(st, "arm the worker's event fd")
        return True

    # --------------------------------------------------------------------- memory
    def register(
        self, buf: Any, *, memory_type: str | None = None, nbytes: int | None = None
    ) -> Segment:
        """Register contiguous memory zero-copy; the segment keeps a reference to ``buf``.

        ``buf``: a host buffer (numpy, CPU torch tensor, bytearray...), a CUDA torch
        tensor or an object with ``__cuda_array_interface__`` (CuPy), or an int address
        with ``nbytes`` and ``memory_type``. ``memory_type`` (``"host"``/``"cuda"``) is
        inferred from ``buf`` when not given. CUDA memory is mapped as CUDA memory
        (``UCS_MEMORY_TYPE_CUDA``) after the UCX context is checked to support it:
        :class:`CudaMemoryUnavailableError` names what is missing otherwise, and the
        engine must have been created with ``memory_types`` including ``"cuda"``. Map a
        pool that is one plain ``cudaMalloc`` allocation (cuda_ipc exports the whole
        allocation; VMM or memory-pool memory needs other handles)."""
        self._require_open()
        device: int | None = None
        if isinstance(buf, int) and not isinstance(buf, bool):
            if nbytes is None or memory_type is None:
                raise ValueError("register: an address needs nbytes= and memory_type=")
            kind = memtypes.parse(memory_type)
            address, size = buf, nbytes
        else:
            cuda = memtypes.cuda_pointer(buf)
            if cuda is not None:
                kind = MemoryType.CUDA
                address, size, device = cuda
            else:
                kind = MemoryType.HOST
                address, size = _buffer_pointer(buf)
            if memory_type is not None and memtypes.parse(memory_type) is not kind:
                raise ValueError(f"register: buffer is {kind.value} memory, not {memory_type}")
        if size <= 0:
            raise ValueError("register: empty buffer")
        if kind is MemoryType.CUDA:
            memtypes.require(kind, self._memory)
            if not self.config.wants_cuda():
                raise TransferError(
                    "register: CUDA memory needs an engine created with "
                    "TransferConfig(memory_types=('host', 'cuda')) (CUDA initialised "
                    "before ucp_init, the cuda transports in UCX_TLS)"
                )
            if device is None:
                device = self.config.cuda_device
        return self._map(address, size, allocate=False, owner=buf, memory_type=kind, device=device)

    def allocate(self, nbytes: int, prefault: bool = True) -> Segment:
        """UCX-allocated memory (``UCP_MEM_MAP_ALLOCATE``: shared memory that peers on this
        host map and write directly). ``prefault`` touches every page once."""
        self._require_open()
        if nbytes <= 0:
            raise ValueError(f"allocate: nbytes must be positive, got {nbytes}")
        seg = self._map(0, nbytes, allocate=True, owner=None)
        if prefault:
            seg.as_numpy()[::4096] = 0
        return seg

    def _map(
        self,
        address: int,
        nbytes: int,
        allocate: bool,
        owner: Any,
        memory_type: MemoryType = MemoryType.HOST,
        device: int | None = None,
    ) -> Segment:
        memh, base, mlen = ffi.new("kvf_mem_h *"), ffi.new("void **"), ffi.new("size_t *")
        params = ffi.new("kvf_mem_map_params_t *")
        params.field_mask = (
            native.MEM_MAP_PARAM_FIELD_ADDRESS
            | native.MEM_MAP_PARAM_FIELD_FLAGS
            | native.MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        )
        params.address = ffi.cast("void *", address)
        params.length = nbytes
        params.flags = native.MEM_MAP_FLAG_ALLOCATE if allocate else 0
        params.memory_type = memtypes.NATIVE_TYPE[memory_type]
        _check(
            lib.kvf_mem_map(self._worker, params, memh, base, mlen),
            f"mapping {nbytes} bytes of {memory_type.value} memory",
        )
        rbuf, rsize = ffi.new("void **"), ffi.new("size_t *")
        st = lib.kvf_rkey_pack(self._worker, memh[0], rbuf, rsize)
        if st != 0:
            lib.kvf_mem_unmap(self._worker, memh[0])
            _check(st, "packing an rkey")
        rkey = bytes(ffi.buffer(rbuf[0], rsize[0]))
        lib.kvf_rkey_buffer_release(rbuf[0])
        length = nbytes if not allocate else min(nbytes, int(mlen[0]))
        seg = Segment(
            base=int(ffi.cast("uintptr_t", base[0])),
            length=length,
            rkey=rkey,
            incarnation=self.incarnation,
            allocated=allocate,
            memh=memh[0],
            owner=owner,
            memory_type=memory_type.value,
            device=device,
        )
        self._segments.append(seg)
        return seg

    def deregister(self, seg: Segment) -> None:
        """Unmap a segment. For allocated segments this releases the memory: only do it
        once no peer can write it any more (I4); peers that mapped it keep their mapping."""
        if seg.registered:
            seg.registered = False
            self._segments.remove(seg)
            _check(lib.kvf_mem_unmap(self._worker, seg.memh), "unmapping a segment")

    # ---------------------------------------------------------------------- peers
    def connect(self, peer_address: bytes, name: str = "") -> Peer:
        """Endpoint to the engine at ``peer_address`` (its :attr:`address`). Connecting
        twice to the same live address returns the same peer."""
        self._require_open()
        existing = self._peers.get(peer_address)
        if existing is not None and existing.state is PeerState.CONNECTED:
            return existing
        info = decode_address(peer_address)
        name = name or info.name
        ep = ffi.new("kvf_ep_h *")
        _check(lib.kvf_ep_create(self._worker, info.ucx, ep), "connecting", name)
        peer = Peer(name=name, address=peer_address, info=info, ep=ep[0])
        if (info.host, info.boot_id, info.pidns) == self._identity and info.pid != os.getpid():
            try:
                peer.pidfd = os.pidfd_open(info.pid)
            except (OSError, AttributeError):
                peer.pidfd = None
                if not self._pid_exists(info.pid):
                    peer.state, peer.failure = PeerState.FAILED, f"process {info.pid} is gone"
        peer.transports, peer.transports_from = ucxinfo.endpoint_transports(peer.ep)
        self._peers[peer_address] = peer
        log.info(
            "connected to %s (incarnation %#x) over %s",
            name,
            info.incarnation,
            peer.transports or "?",
        )
        return peer

    @staticmethod
    def _pid_exists(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def _peer_alive(self, peer: Peer, force: bool = False) -> bool:
        if peer.state is not PeerState.CONNECTED:
            return False
        if peer.pidfd is None:
            return True
        now = time.monotonic()
        if not force and now - peer.last_liveness_check < self.config.liveness_interval_s:
            return True
        peer.last_liveness_check = now
        readable, _, _ = select.select([peer.pidfd], [], [], 0)
        if readable:
            self._mark_peer_failed(peer, f"process {peer.info.pid} exited")
            return False
        return True

    def _mark_peer_failed(self, peer: Peer, reason: str) -> None:
        """Record the failure and sever the endpoint: pending requests complete with
        UCS_ERR_CANCELED and nothing more is posted to this peer."""
        if peer.state is not PeerState.CONNECTED:
            return
        peer.state, peer.failure = PeerState.FAILED, reason
        self.counters.peers_failed += 1
        log.warning("peer %s failed: %s; severing its endpoint", peer.name, reason)
        self._release_rkeys(peer)
        lib.kvf_ep_close(
            self._worker,
            peer.ep,
            native.EP_CLOSE_FLAG_FORCE,
            int(self.config.close_timeout_s * 1000),
        )

    @staticmethod
    def _release_rkeys(peer: Peer) -> None:
        for rkey in peer.rkeys:
            lib.kvf_rkey_destroy(rkey)
        peer.rkeys.clear()

    def peer_alive(self, peer: Peer) -> bool:
        """False once the peer failed or was closed (checks its process if local)."""
        if self._failed_peers:
            self._sever_failed_peers()
        return self._peer_alive(peer, force=True)

    def _sever_failed_peers(self) -> None:
        """Mark failed (and sever) the peers whose batches :meth:`poll` found failed with
        a peer-failure status."""
        failed, self._failed_peers = self._failed_peers, []
        for peer, reason in failed:
            self._mark_peer_failed(peer, reason)

    def _watch_peers(self) -> None:
        """Every ``liveness_interval_s``: the process of each local peer with unsettled
        batches (its pidfd); one that exited is marked failed and severed, so those
        batches fail instead of waiting for their deadline."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + self.config.liveness_interval_s
        for peer in list(self._peers.values()):
            if peer.unsettled and peer.pidfd is not None:
                self._peer_alive(peer, force=True)

    def close(self, peer: Peer, force: bool = False) -> None:
        """Close the endpoint. ``force=True`` severs it without flushing: requests in
        flight complete with UCS_ERR_CANCELED (bytes already sent are not recalled)."""
        if peer.state is PeerState.CLOSED:
            return
        was_connected = peer.state is PeerState.CONNECTED
        peer.state = PeerState.CLOSED
        peer.failure = peer.failure or ("severed" if force else "closed")
        self._release_rkeys(peer)
        if was_connected:
            st = lib.kvf_ep_close(
                self._worker,
                peer.ep,
                native.EP_CLOSE_FLAG_FORCE if force else 0,
                int(self.config.close_timeout_s * 1000),
            )
            if st != 0 and not force:
                lib.kvf_ep_close(
                    self._worker,
                    peer.ep,
                    native.EP_CLOSE_FLAG_FORCE,
                    int(self.config.close_timeout_s * 1000),
                )
        if peer.pidfd is not None:
            os.close(peer.pidfd)
            peer.pidfd = None
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        self.progress(0)

    def open_segment(
        self, peer: Peer, desc: SegmentDescriptor | bytes, expected_incarnation: int | None = None
    ) -> RemoteSegment:
        """Unpack a peer's segment descriptor. Refused (StaleIncarnationError) when its
        incarnation is not ``expected_incarnation`` or not the peer's own."""
        if isinstance(desc, (bytes, bytearray, memoryview)):
            desc = SegmentDescriptor.unpack(bytes(desc))
        self._require_peer(peer)
        for what, expected in (
            ("descriptor vs expected", expected_incarnation),
            (f"descriptor vs peer {peer.name}", peer.incarnation),
        ):
            if expected is not None and desc.incarnation != expected:
                self.counters.stale_refused += 1
                raise StaleIncarnationError(what, desc.incarnation, expected)
        rkey = ffi.new("kvf_rkey_h *")
        _check(lib.kvf_rkey_unpack(peer.ep, desc.rkey, rkey), "unpacking an rkey", peer.name)
        rseg = RemoteSegment(peer=peer, descriptor=desc, rkey=rkey[0])
        peer.rkeys.append(rkey[0])
        if self.config.direct_copy and desc.memory_type == MemoryType.HOST.value:
            local = ffi.new("void **")
            if lib.kvf_rkey_ptr(rkey[0], desc.base, local) == 0:
                rseg.direct = int(ffi.cast("uintptr_t", local[0]))
                if self.config.prefault_direct:
                    self._prefault(peer, rseg)
        return rseg

    def _prefault(self, peer: Peer, rseg: RemoteSegment) -> None:
        """The peer's segment is mapped here lazily: without this, the first write to
        each of its pages takes a page fault (a cold 128 KiB write costs ~100 us)."""
        t0 = time.monotonic()
        err = lib.kvf_prefault(rseg.direct, rseg.length)
        if err:
            log.info(
                "segment of %s (%d bytes) not pre-faulted (%s); its pages fault on first write",
                peer.name,
                rseg.length,
                os.strerror(err),
            )
        else:
            log.debug(
                "segment of %s (%d bytes) pre-faulted in %.1f ms",
                peer.name,
                rseg.length,
                1e3 * (time.monotonic() - t0),
            )

    # ------------------------------------------------------------------- batches
    def write(
        self,
        peer: Peer,
        seg: Segment,
        rseg: RemoteSegment,
        pages: Any,
        notice: bytes | None = None,
        *,
        stream: Any = None,
    ) -> Batch:
        """Put pages (local offset, remote offset, length) from ``seg`` into ``rseg``.
        The batch completes once every page is visible at the target (flushed).

        With ``notice``, the same call then posts it as :meth:`notify` would (delivered
        only after these pages and every earlier write on this peer are visible), and
        the batch completes once the notice is sent too. Nothing is noticed if posting
        the pages fails. One native call: the low-latency path for small writes.

        From a CUDA segment, the bytes' producer is waited for before anything is
        posted, since UCX's cuda transports copy on their own streams and would not wait
        on the application's: ``stream`` is anything with ``synchronize()`` (the torch
        or CuPy stream, or cheaper an event recorded right after the kernels that wrote
        these pages); None waits on torch's current stream of the segment's device. A
        host segment waits on nothing."""
        if seg.is_cuda:
            memtypes.synchronize(seg.device, stream)
            self.counters.stream_syncs += 1
        return self._rma(peer, seg, rseg, pages, write=True, notice=notice)

    def read(self, peer: Peer, seg: Segment, rseg: RemoteSegment, pages: Any) -> Batch:
        """Get pages (local offset, remote offset, length) from ``rseg`` into ``seg``."""
        return self._rma(peer, seg, rseg, pages, write=False)

    def _rma(
        self,
        peer: Peer,
        seg: Segment,
        rseg: RemoteSegment,
        pages: Any,
        write: bool,
        notice: bytes | None = None,
    ) -> Batch:
        self._require_peer(peer)
        if rseg.peer is not peer:
            raise TransferError(f"remote segment belongs to {rseg.peer.name}, not {peer.name}")
        if not seg.registered:
            raise TransferError("local segment is not registered")
        arr = as_page_array(pages)
        n = arr.shape[0]
        param = self._rma_param
        mask = native.RMA_PARAM_FIELD_STREAMING_MIN_BYTES
        if write and self.config.fault_skip_page is not None and n > 1:
            mask |= native.RMA_PARAM_FIELD_SKIP_PAGE
            param.skip_page = self.config.fault_skip_page % n
        if rseg.direct is not None and not seg.is_cuda:
            mask |= native.RMA_PARAM_FIELD_DIRECT_BASE
            param.direct_base = rseg.direct
        param.streaming_min_bytes = self._streaming_min_bytes
        param.local_base = seg.base
        param.local_length = seg.length
        param.rkey = rseg.rkey
        param.remote_base = rseg.base
        param.remote_length = rseg.length
        param.pages = ffi.from_buffer("int64_t[]", arr)
        param.npages = n
        handle = ffi.new("kvf_batch_t *")
        flush = False
        if notice is None:
            param.field_mask = mask
            st = (lib.kvf_put_pages if write else lib.kvf_get_pages)(peer.ep, param, handle)
        else:
            notice = self._checked_payload(notice)
            flush = self._needs_flush(peer)
            msg = self._msg_param
            msg.flags = native.MSG_FLAG_NOTICE | (native.MSG_FLAG_FLUSH if flush else 0)
            msg.seq = next(self._seq)
            payload = ffi.from_buffer(notice)
            msg.payload = payload
            msg.payload_length = len(notice)
            param.field_mask = mask | native.RMA_PARAM_FIELD_NOTICE
            st = lib.kvf_put_pages(peer.ep, param, handle)
        if st != 0:
            if st == UCS_ERR_OUT_OF_RANGE:
                self.counters.bounds_refused += 1
                check_pages(arr, seg.length, rseg.length)  # raises with the numbers
                raise AssertionError(
                    "the native bounds check refused a page list that check_pages accepts"
                )
            _check(st, "posting a batch", peer.name)
        nbytes = int(handle.bytes)
        counters = self.counters
        if write:
            counters.bytes_written += nbytes
        else:
            counters.bytes_read += nbytes
        counters.pages_posted += int(handle.posted)
        counters.pages_direct += int(handle.direct)
        puts = write and handle.posted != handle.direct
        if puts or flush:  # later notices to peer flush until this batch is done
            self._hold_notices_for(peer, handle)
        op = "write" if write else "read"
        if notice is not None:
            op = "write+notify"
            counters.messages_sent += 1
            counters.notifies += 1
            counters.notifies_flushed += puts or flush
        return self._track(peer, op, nbytes, n, handle, (arr, seg, rseg))

    def copies_streaming(self, nbytes: int) -> bool:
        """Whether a direct write of ``nbytes`` in one batch uses streaming stores."""
        return 0 <= self._streaming_min_bytes <= nbytes

    def quiesce(self, peer: Peer) -> Batch:
        """Completes when every earlier write to ``peer`` is visible at the target."""
        self._require_peer(peer)
        handle = ffi.new("kvf_batch_t *")
        lib.kvf_flush(peer.ep, handle)
        return self._track(peer, "quiesce", 0, 0, handle, None)

    def notify(self, peer: Peer, payload: bytes) -> Batch:
        """Flush, then send ``payload``: the target receives it only after every earlier
        write on this peer is visible there."""
        return self._message(peer, payload, flushed=True)

    def send(self, peer: Peer, payload: bytes) -> Batch:
        """Send ``payload`` as an active message, without flushing (control traffic)."""
        return self._message(peer, payload, flushed=False)

    def _message(self, peer: Peer, payload: bytes, flushed: bool) -> Batch:
        self._require_peer(peer)
        payload = self._checked_payload(payload)
        handle = ffi.new("kvf_batch_t *")
        flush = flushed and self._needs_flush(peer)
        msg = self._msg_param
        msg.flags = (native.MSG_FLAG_NOTICE if flushed else 0) | (
            native.MSG_FLAG_FLUSH if flush else 0
        )
        msg.seq = next(self._seq)
        data = ffi.from_buffer(payload)
        msg.payload = data
        msg.payload_length = len(payload)
        lib.kvf_msg_send(peer.ep, msg, handle)
        counters = self.counters
        if flushed:
            counters.notifies += 1
            if flush:
                counters.notifies_flushed += 1
                self._hold_notices_for(peer, handle)
        counters.messages_sent += 1
        return self._track(peer, "notify" if flushed else "send", len(payload), 0, handle, None)

    def _checked_payload(self, payload: bytes) -> bytes:
        """``payload`` as bytes, refused (WireError, nothing sent) over the size limit."""
        if len(payload) > self.config.max_message_bytes:
            raise WireError(
                f"payload of {len(payload)} bytes exceeds max_message_bytes "
                f"{self.config.max_message_bytes}"
            )
        return payload if type(payload) is bytes else bytes(payload)

    @staticmethod
    def _needs_flush(peer: Peer) -> bool:
        """True while a put posted through UCX, or an earlier notice's flush, may still be
        outstanding to ``peer`` (a failed one keeps it true: the flush then reports it)."""
        pending = peer.unflushed
        if pending:
            pending[:] = [h for h in pending if h.outstanding != 0 or h.status != 0]
        return bool(pending)

    def _hold_notices_for(self, peer: Peer, handle: Any) -> None:
        """Later notices to ``peer`` flush until ``handle`` is done. Finished handles are
        pruned every 64 additions, so writes without notices between them do not pile
        up."""
        peer.unflushed.append(handle)
        if len(peer.unflushed) % 64 == 0:
            self._needs_flush(peer)

    def _send_raw(self, peer: Peer, data: bytes, flushed: bool = False) -> Batch:
        """Post already-encoded bytes (the envelope is the caller's business)."""
        handle = ffi.new("kvf_batch_t *")
        lib.kvf_raw_send(peer.ep, data, len(data), native.MSG_FLAG_FLUSH if flushed else 0, handle)
        if flushed:
            self.counters.notifies += 1
            self._hold_notices_for(peer, handle)
        self.counters.messages_sent += 1
        return self._track(peer, "notify" if flushed else "send", len(data), 0, handle, None)

    def _track(
        self, peer: Peer, op: str, nbytes: int, npages: int, handle: Any, keep: Any
    ) -> Batch:
        self.counters.batches += 1
        batch = Batch(self, peer, op, nbytes, npages, handle)
        peer.unsettled += 1
        if handle.outstanding != 0:
            self._inflight.append((handle, keep))
            if len(self._inflight) > self._sweep_at:
                self._sweep()
        self.poll(batch)
        if self._failed_peers:  # it failed at once: act on it here, on the posting path
            self._sever_failed_peers()
        return batch

    def _sweep(self) -> None:
        """Drop finished handles; the next sweep waits for twice as many (amortised O(1))."""
        self._inflight = [(h, k) for h, k in self._inflight if h.outstanding != 0]
        self._sweep_at = max(256, 2 * len(self._inflight))

    # ------------------------------------------------------------ batch evaluation
    def poll(self, batch: Batch) -> BatchStatus:
        """The batch's status now, from its native completion tracker: PENDING,
        COMPLETED, FAILED (``batch.error`` says why) or TIMED_OUT. Never blocks, drives
        no progress and touches no endpoint (as ``ucp_request_check_status``): a failure
        that means the peer is gone is acted on (the peer marked failed and severed) by
        the next :meth:`progress`, :meth:`wait` or post."""
        if batch.final is not None:
            return batch.final
        h = batch.native
        peer = batch.peer
        if h.status != 0:
            status = int(h.status)
            err: TransferError
            if status in PEER_FAILURE_STATUSES:
                err = PeerFailedError(
                    peer.name, f"{batch.op} failed with {status_name(status)}", status
                )
                self._failed_peers.append((peer, err.reason))
            else:
                err = ucx_error(status, f"{batch.op} batch", peer=peer.name)
            self._settle(batch, BatchStatus.FAILED, err)
        elif h.outstanding == 0:
            self._settle(batch, BatchStatus.COMPLETED, None)
        elif peer.state is not PeerState.CONNECTED:
            self._settle(
                batch,
                BatchStatus.FAILED,
                PeerFailedError(peer.name, peer.failure or "peer is gone"),
            )
        else:
            return BatchStatus.PENDING
        return batch.final or BatchStatus.PENDING

    def wait(
        self, batch: Batch, timeout_s: float | None = None, *, deadline: float | None = None
    ) -> BatchStatus:
        """Drive progress until ``batch`` settles or the deadline passes (``timeout_s``
        relative, default ``config.default_timeout_s``; or ``deadline``, an absolute
        ``time.monotonic()``), and return its final status. Raises nothing for the
        batch's own outcome: FAILED leaves the named error in ``batch.error``
        (:class:`PeerFailedError` naming the peer, or a :class:`UcxError`), TIMED_OUT a
        :class:`DeadlineExceeded` with the operation, its pages and bytes, the time
        waited and the peer. A timed-out batch may still land later (UCX cannot cancel a
        put)."""
        if deadline is None:
            deadline = time.monotonic() + (
                self.config.default_timeout_s if timeout_s is None else timeout_s
            )
        step = self.config.liveness_interval_s
        while self.poll(batch) is BatchStatus.PENDING:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._settle(
                    batch,
                    BatchStatus.TIMED_OUT,
                    DeadlineExceeded(
                        f"{batch.op} batch of {batch.npages} pages ({batch.nbytes} bytes)",
                        time.monotonic() - batch.posted_at,
                        peer=batch.peer.name,
                    ),
                )
                break
            self.progress(min(remaining, step))
        if self._failed_peers:
            self._sever_failed_peers()
        return batch.final or BatchStatus.PENDING

    def _settle(self, batch: Batch, status: BatchStatus, error: TransferError | None) -> None:
        if batch.final is not None:
            return
        batch.final = status
        batch.error = error
        batch.finished_at = time.monotonic()
        batch.peer.unsettled -= 1
        if status is BatchStatus.COMPLETED:
            self.counters.completed += 1
        elif status is BatchStatus.TIMED_OUT:
            self.counters.timeouts += 1
        else:
            self.counters.failures += 1

    def _require_peer(self, peer: Peer) -> None:
        self._require_open()
        if self._failed_peers:
            self._sever_failed_peers()
        if peer.state is not PeerState.CONNECTED or not self._peer_alive(peer):
            raise PeerFailedError(peer.name, peer.failure or peer.state.value)

    def _require_open(self) -> None:
        if self._closed:
            raise TransferError(f"engine {self.name} is shut down")

    # ------------------------------------------------------------------ messages
    def set_message_handler(self, fn: MessageHandler | None) -> None:
        """``fn(sender_address, payload)`` is called from :meth:`progress` for every
        incoming notify/send; ``sender_address`` can be passed to :meth:`connect` (and
        :func:`decode_address` gives its incarnation). Without a handler, messages queue
        for :meth:`take_messages`."""
        self._handler = fn

    def take_messages(self) -> list[IncomingMessage]:
        """Messages received while no handler was set, oldest first."""
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def progress(self, timeout_s: float = 0, stay_awake: bool = False) -> int:
        """Drive UCX and deliver incoming messages. With ``timeout_s > 0`` and nothing to
        do, polls for ``spin_us`` and for as long as the last activity is within
        ``busy_poll_us`` (a message then costs no wake-up), then sleeps on the event fd
        for the rest of ``timeout_s`` (an idle engine burns no CPU). ``stay_awake``
        polls for all of ``timeout_s`` (napping 5 µs between polls): for a caller
        that expects a message soon, since waking a sleeping thread, and on a VM its
        halted vCPU, can take milliseconds."""
        self._require_open()
        if timeout_s <= 0:
            n = int(lib.kvf_worker_progress(self._worker))
        else:
            count = self._wait_count
            st = lib.kvf_worker_wait(
                self._worker,
                max(1, math.ceil(timeout_s * 1000)),
                native.WAIT_FLAG_STAY_AWAKE if stay_awake else 0,
                count,
            )
            n = int(count[0]) if st == 0 else 0  # a failed arm: as no events
        self._drain_messages()
        if len(self._inflight) > self._sweep_at:
            self._sweep()
        if self._failed_peers:
            self._sever_failed_peers()
        self._watch_peers()
        return n

    def _drain_messages(self) -> None:
        """Deliver queued messages. The native receive path has already checked each
        envelope's header (its reason is in ``env.error``); here only the sender's address
        is decoded (once per sender) and its incarnation compared with the envelope's."""
        pop, free, unpack = lib.kvf_am_pop, lib.kvf_msg_free, ffi.unpack
        ENVELOPE_FLAG_FLUSHED = native.ENVELOPE_FLAG_FLUSHED
        worker, senders, counters = self._worker, self._senders, self.counters
        while True:
            m = pop(worker)
            if m == ffi.NULL:
                break
            try:
                env = m.env
                if env.error:
                    self._refuse(
                        int(m.length),
                        ENVELOPE_REFUSALS.get(EnvelopeError(env.error), f"reason {env.error}"),
                    )
                    continue
                sender_address = unpack(env.sender, env.sender_length)
                payload = unpack(env.payload, env.payload_length)
                incarnation, seq = env.incarnation, env.seq
                flushed = bool(env.flags & ENVELOPE_FLAG_FLUSHED)
            finally:
                free(m)
            sender = senders.get(sender_address)
            if sender is None:
                try:
                    sender = decode_address(sender_address)
                except WireError as exc:
                    self._refuse(len(payload), f"sender address: {exc}")
                    continue
                if len(senders) > 4096:
                    senders.clear()
                senders[sender_address] = sender
            if sender.incarnation != incarnation:
                self._refuse(len(payload), "envelope incarnation differs from its sender address")
                continue
            counters.messages_received += 1
            if self._handler is None:
                self._inbox.append(
                    IncomingMessage(sender_address, sender.name, incarnation, seq, flushed, payload)
                )
                continue
            try:
                self._handler(sender_address, payload)
            except Exception:
                counters.handler_errors += 1
                log.exception("engine %s: message handler failed", self.name)
        counters.dropped_messages = int(lib.kvf_am_dropped(worker))

    def _refuse(self, nbytes: int, why: str) -> None:
        self.counters.malformed_messages += 1
        log.warning(
            "engine %s: refused a malformed message of %d bytes: %s", self.name, nbytes, why
        )

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Sever every endpoint, unmap every segment, destroy the worker."""
        if self._closed:
            return
        for peer in list(self._peers.values()):
            self.close(peer, force=True)
        for seg in list(self._segments):
            self.deregister(seg)
        self._closed = True
        lib.kvf_worker_destroy(self._worker)
        self._inflight.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def counters_dict(self) -> dict[str, int]:
        return asdict(self.counters)
