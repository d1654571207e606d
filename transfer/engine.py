"""The transfer engine: one-sided page writes and reads between registered memory of
processes, over UCX, with a Mooncake-like batch API.

Upholds, for the layers above:

- I4 (no release without proof): a completed ``write`` batch, ``quiesce`` and the data
  before a ``notify`` are *flushed*: every earlier put to that peer is visible at the
  target. ``close(peer, force=True)`` severs the endpoint, which is no proof that its
  writes stop landing: an engine closed or failed with writes not flushed is
  *unflushable*, and every later notice or flush to it raises
  :class:`UnflushableError` rather than claim to follow them. Registered memory is never
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
  the target runs nothing). Writes into memory the target merely registered are what
  UCX's cma transport would make of them, the kernel's cross-memory copy
  (``process_vm_writev``), but up to 1024 pages per system call from C instead of one
  ``ucp_put_nbx`` each (``cross_memory_copy=False`` keeps the puts); also one-sided, the
  target's process checked through its pidfd before and after. Prefer ``allocate`` for
  destinations: it is the fastest path.
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
import socket
import time
from collections import deque
from dataclasses import asdict
from typing import Any

from . import _native as native
from . import horizon as horizons
from . import mappings, memtypes, ucxinfo
from ._native import ffi, lib
from .batch import Batch, BatchStatus
from .config import (
    RC_UCX_DEFAULTS,
    UCS_ERR_BUSY,
    UCS_ERR_NO_ELEM,
    UCS_ERR_OUT_OF_RANGE,
    _environment,
    _tl_home,
)
from .config import (
    TCP_FAILURE_OPTIONS as TCP_FAILURE_OPTIONS,
)
from .config import (
    TRANSPORT_PRESETS as TRANSPORT_PRESETS,
)
from .config import (
    MessageHandler as MessageHandler,
)
from .config import (
    OptionPlan as OptionPlan,
)
from .config import (
    TransferConfig as TransferConfig,
)
from .config import (
    TransferCounters as TransferCounters,
)
from .config import (
    plan_options as plan_options,
)
from .envelope import REASONS as ENVELOPE_REFUSALS
from .envelope import EnvelopeError
from .errors import (
    PEER_FAILURE_STATUSES,
    CudaMemoryUnavailableError,
    DeadlineExceeded,
    PeerFailedError,
    StaleIncarnationError,
    TransferError,
    UnflushableError,
    WireError,
    status_name,
    ucx_error,
)
from .liveness import PeerTable
from .memory import SegmentMap
from .memtypes import MemoryType
from .peer import Peer, PeerState
from .protocol import (
    ADDRESS,
    CODEC,
    MAX_PAYLOAD,
    MAX_SENDER,
    AddressInfo,
    IncomingMessage,
    decode_address,
    read_boot_id,
    read_pid_namespace,
)
from .runs import as_runs, check_runs
from .segment import RemoteSegment, Segment, SegmentDescriptor

log = logging.getLogger("kvferry.transfer")
# A draining progress stops once no event came for this long: past a busy sender's
# 5 us nap and its refill of the transport's queue, well under any step's length.
DRAIN_IDLE_US = 50
# decoded sender addresses kept (a message's sender is decoded once, not per message):
# anyone who reaches the worker can send addresses of up to MAX_SENDER bytes, so the cache
# is bounded in bytes as well as entries, and starts over when full
SENDER_CACHE_ENTRIES = 4096
SENDER_CACHE_BYTES = 16 << 20


def _check(status: int, what: str, peer: str | None = None) -> None:
    if status != 0:
        raise ucx_error(int(status), what, peer)


def _host_identity() -> tuple[str, str, int]:
    """(hostname, boot id, PID namespace inode) for this engine's address; an empty boot
    id or namespace 0 where unreadable, which no engine takes for its own host
    (:meth:`AddressInfo.same_host`)."""
    try:
        boot_id = read_boot_id()
    except OSError:
        boot_id = ""
    try:
        pidns = read_pid_namespace()
    except OSError:
        pidns = 0
    return socket.gethostname(), boot_id, pidns


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
        self._inflight: list[tuple[Any, Any]] = []  # (kvf_batch_t *, keep-alive refs)
        self._sweep_at = 256
        self.memory = SegmentMap(
            self._worker, self.config, self.incarnation, self._memory, self._require_open
        )
        self.peers = PeerTable(
            self._worker,
            self.config,
            self.counters,
            decode_address(self.address),
            self._require_open,
            self.progress,
        )
        self._handler: MessageHandler | None = None
        self._senders: dict[bytes, AddressInfo] = {}
        self._sender_bytes = 0  # what the sender cache holds, about
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
        failure horizon, and the transports each connected peer's endpoint uses (and how many of
        its segments each data path serves)."""
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
                    "segment_paths": dict(p.segment_paths),
                }
                for p in self.peers.by_address.values()
            },
        }
        if self._rdma is not None:
            out["rdma"] = dict(self._rdma)
        registered: dict[str, dict[str, int]] = {}
        for seg in self.memory.segments:
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
        """Register ``buf`` zero-copy as a segment: see :meth:`.memory.SegmentMap.register`."""
        return self.memory.register(buf, memory_type=memory_type, nbytes=nbytes)

    def allocate(self, nbytes: int, prefault: bool = True) -> Segment:
        """UCX-allocated memory as a segment: see :meth:`.memory.SegmentMap.allocate`."""
        return self.memory.allocate(nbytes, prefault)

    def deregister(self, seg: Segment) -> None:
        """Unmap a segment: see :meth:`.memory.SegmentMap.deregister`."""
        self.memory.deregister(seg)

    # ---------------------------------------------------------------------- peers
    def connect(self, peer_address: bytes, name: str = "") -> Peer:
        """Endpoint to the engine at ``peer_address``: see :meth:`.liveness.PeerTable.connect`."""
        return self.peers.connect(peer_address, name)

    def peer_alive(self, peer: Peer) -> bool:
        """False once the peer failed or was closed (checks its process if local)."""
        return self.peers.peer_alive(peer)

    def close(self, peer: Peer, force: bool = False) -> None:
        """Close the endpoint: see :meth:`.liveness.PeerTable.close`."""
        self.peers.close(peer, force)

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
                self._require_mapped(peer, rseg)
                if self.config.prefault_direct:
                    self._prefault(peer, rseg)
        if rseg.direct is None:
            rseg.cross_memory = self._cross_memory_possible(peer, desc)
        path = rseg.path
        peer.segment_paths[path] = peer.segment_paths.get(path, 0) + 1
        return rseg

    def _require_mapped(self, peer: Peer, rseg: RemoteSegment) -> None:
        """Refuse a descriptor whose length runs past the mapping UCX made of it here: the
        direct path's stores at ``direct + offset`` would land in other memory of this
        process, another peer's pool among it (:mod:`.mappings`)."""
        assert rseg.direct is not None
        span = mappings.mapped_span(rseg.direct)
        end = rseg.direct + rseg.length
        if span is not None and span[0] <= rseg.direct and end <= span[1]:
            return
        mapped = 0 if span is None else span[1] - rseg.direct
        self.counters.bounds_refused += 1
        peer.rkeys.remove(rseg.rkey)
        lib.kvf_rkey_destroy(rseg.rkey)
        raise TransferError(
            f"segment of {peer.name}: its descriptor claims {rseg.length} bytes at "
            f"{rseg.base:#x}, but {mapped} bytes are mapped here from there; refused (a "
            f"write past them would land in other memory of this process)"
        )

    def _cross_memory_possible(self, peer: Peer, desc: SegmentDescriptor) -> bool:
        """Whether pages into ``desc`` can go by the kernel's cross-memory copy: host
        memory of a peer whose process on this host is watched through its pidfd, and
        the kernel lets this process write it (one byte read as the proof)."""
        if not (
            self.config.cross_memory_copy
            and desc.memory_type == MemoryType.HOST.value
            and peer.pidfd is not None
            and desc.length > 0
            and "cma" in ucxinfo.lane_transports(peer.transports)
        ):
            return False
        err = lib.kvf_cma_probe(peer.info.pid, desc.base)
        if err:
            log.info(
                "segment of %s (%d bytes at %#x): no cross-memory copy into process %d (%s); "
                "its pages go through UCX",
                peer.name,
                desc.length,
                desc.base,
                peer.info.pid,
                os.strerror(err),
            )
            return False
        return True

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
        runs: Any,
        notice: bytes | None = None,
        *,
        stream: Any = None,
    ) -> Batch:
        """Put ``runs`` (local offset, remote offset, length: byte runs, ``[n, 3]``) from
        ``seg`` into ``rseg``.
        The batch completes once every page is visible at the target (flushed).

        With ``notice``, the same call then posts it as :meth:`notify` would (delivered
        only after these runs and every earlier write on this peer are visible), and
        the batch completes once the notice is sent too. Nothing is noticed if posting
        the runs fails. One native call: the low-latency path for small writes.

        From a CUDA segment, the bytes' producer is waited for before anything is
        posted, since UCX's cuda transports copy on their own streams and would not wait
        on the application's: ``stream`` is anything with ``synchronize()`` (the torch
        or CuPy stream, or cheaper an event recorded right after the kernels that wrote
        these runs); None waits on torch's current stream of the segment's device. A
        host segment waits on nothing."""
        if seg.is_cuda:
            memtypes.synchronize(seg.device, stream)
            self.counters.stream_syncs += 1
        return self._rma(peer, seg, rseg, runs, write=True, notice=notice)

    def read(self, peer: Peer, seg: Segment, rseg: RemoteSegment, runs: Any) -> Batch:
        """Get ``runs`` (local offset, remote offset, length) from ``rseg`` into ``seg``."""
        return self._rma(peer, seg, rseg, runs, write=False)

    def _rma(
        self,
        peer: Peer,
        seg: Segment,
        rseg: RemoteSegment,
        runs: Any,
        write: bool,
        notice: bytes | None = None,
    ) -> Batch:
        self._require_peer(peer)
        if rseg.peer is not peer:
            raise TransferError(f"remote segment belongs to {rseg.peer.name}, not {peer.name}")
        if not seg.registered:
            raise TransferError("local segment is not registered")
        arr = as_runs(runs)
        n = arr.shape[0]
        param = self._rma_param
        mask = native.RMA_PARAM_FIELD_STREAMING_MIN_BYTES
        if write and self.config.fault_skip_page is not None and n > 1:
            mask |= native.RMA_PARAM_FIELD_SKIP_PAGE
            param.skip_page = self.config.fault_skip_page % n
        cross_memory = False
        if seg.is_cuda:  # UCX picks its protocol by it: never a CPU copy of device bytes
            mask |= native.RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE
            param.local_memory_type = native.MEMORY_TYPE_CUDA
        if rseg.direct is not None and not seg.is_cuda:
            mask |= native.RMA_PARAM_FIELD_DIRECT_BASE
            param.direct_base = rseg.direct
        elif rseg.cross_memory and not seg.is_cuda and peer.pidfd is not None:
            mask |= native.RMA_PARAM_FIELD_PEER_PROCESS
            param.peer_pid = peer.info.pid
            param.peer_pidfd = peer.pidfd
            cross_memory = True
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
            self._require_flushable(peer)
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
                check_runs(arr, seg.length, rseg.length)  # raises with the numbers
                raise AssertionError(
                    "the native bounds check refused a run list that check_runs accepts"
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
        if cross_memory:
            counters.pages_cross_memory += int(handle.direct)
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
        self._require_flushable(peer)
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
        if flushed:
            self._require_flushable(peer)
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

    def _require_flushable(self, peer: Peer) -> None:
        """Refuse a notice or flush to an engine with writes no flush can order: an
        endpoint to it closed or failed before they were flushed (UnflushableError)."""
        why = self.peers.unflushable.get(peer.address)
        if why is not None:
            self.counters.notices_refused += 1
            raise UnflushableError(peer.name, why)

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
        if flushed:
            self._require_flushable(peer)
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
        if self.peers.failed:  # it failed at once: act on it here, on the posting path
            self.peers.sever_failed()
        return batch

    def _sweep(self) -> None:
        """Drop finished handles; the next sweep waits for twice as many (amortised O(1))."""
        self._inflight = [(h, k) for h, k in self._inflight if h.outstanding != 0]
        self._sweep_at = max(256, 2 * len(self._inflight))

    # ------------------------------------------------------------ batch evaluation
    def reading(self, batch: Batch) -> bool:
        """Whether the transport may still touch the batch's local bytes: operations of
        it posted and not completed. A FAILED batch can be (a post that failed part way
        leaves the puts before it in flight, and they complete, or fail, later); memory a
        batch was posted from is reused only once this is False."""
        return int(batch.native.outstanding) != 0

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
                self.peers.failed.append((peer, err.reason))
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
        if self.peers.failed:
            self.peers.sever_failed()
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
        if self.peers.failed:
            self.peers.sever_failed()
        if peer.state is not PeerState.CONNECTED or not self.peers.alive(peer):
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

    def progress(self, timeout_s: float = 0, stay_awake: bool = False, drain_us: int = 0) -> int:
        """Drive UCX and deliver incoming messages. With ``timeout_s > 0`` and nothing to
        do, polls for ``spin_us`` and for as long as the last activity is within
        ``busy_poll_us`` (a message then costs no wake-up), then sleeps on the event fd
        for the rest of ``timeout_s`` (an idle engine burns no CPU). ``stay_awake``
        polls for all of ``timeout_s`` (napping 5 µs between polls): for a caller
        that expects a message soon, since waking a sleeping thread, and on a VM its
        halted vCPU, can take milliseconds. ``drain_us`` (with no timeout): while events
        keep coming, progress for up to that long (see ``kvf_worker_progress_drain``), for
        a caller that computes for milliseconds between polls."""
        self._require_open()
        if timeout_s <= 0 and drain_us > 0:
            n = int(lib.kvf_worker_progress_drain(self._worker, drain_us, DRAIN_IDLE_US))
        elif timeout_s <= 0:
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
        if self.peers.failed:
            self.peers.sever_failed()
        self.peers.watch()
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
                if (
                    len(senders) >= SENDER_CACHE_ENTRIES
                    or self._sender_bytes + 2 * len(sender_address) > SENDER_CACHE_BYTES
                ):  # addresses of up to 64 KiB from anyone who reaches us: bounded in bytes
                    senders.clear()
                    self._sender_bytes = 0
                senders[sender_address] = sender
                self._sender_bytes += 2 * len(sender_address)  # the key and its ucx part
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
        for peer in list(self.peers.by_address.values()):
            self.close(peer, force=True)
        for seg in list(self.memory.segments):
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
