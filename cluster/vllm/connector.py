"""kvferry as a vLLM 0.33 KV connector: the prefill pushes a prompt's KV one-sided into
the decode's blocks, and the decode gives a block back to vLLM only with proof that no
write can land in it any more.

One class, :class:`KvferryConnector`, in each of vLLM's processes: role SCHEDULER in the
engine core (it must not block: it stages block ids and keeps the books of what vLLM
holds), role WORKER in each TP worker (it owns a kvferry ``TransferEngine`` and runs the
protocol). The protocol is kvferry's own, not a copy: each decode worker runs the owner
machine (:mod:`kvferry.engine.protocol.owner`) for every request it receives, each
prefill worker the writer machine (:mod:`kvferry.engine.protocol.writer`) for every
request it sends, both fed with their ``on_*`` functions and moved with ``step``; this
module only carries out the effects their tables list.

Decode TP worker ``r`` is the owner of its share of a request's blocks and prefill TP
worker ``r`` is its one writer (equal TP sizes; a different TP size is refused at the
handshake, with both sizes in the error). vLLM's ``KVOutputAggregator`` reports a request
to the scheduler only once every TP worker reported it, so the abort-ack protocol holds
across every TP worker.

Upholds I4 (a request aborted while waiting for remote KV is reported in
``finished_recving``, which is when vLLM frees its blocks, only after its writer acked
after a flush or its process is gone: never on a timer), I5 (``finished_recving`` for a
good load only after the writer's notice, sent after its flush, and a verified length,
block list, canary and checksum), and I6 (a failed load is in ``failed_recving``,
``finished_recving`` and ``get_block_ids_with_load_errors()``, logged with its reason and
counted in the connector's stats).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

from kvferry.cluster.processes import DRAIN_S, process_gone
from kvferry.engine.integrity import IntegrityError, page_checksums, request_id_hash
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol import writer as wc
from kvferry.engine.protocol.driver import Driver
from kvferry.engine.protocol.owner import OwnerBook, OwnerDo, OwnerEvent, OwnerState
from kvferry.engine.protocol.proof import GoneFacts, Proof, gone_proof
from kvferry.engine.protocol.words import AbortSource
from kvferry.engine.protocol.writer import WriterBook, WriterDo, WriterEvent, WriterState
from kvferry.engine.verify import Notice as VerifyNotice
from kvferry.engine.verify import Planned, check_all
from kvferry.transfer import (
    Batch,
    BatchStatus,
    Peer,
    RemoteSegment,
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
    TransferError,
    decode_address,
)

from . import wire
from .layout import KVRegions, LayoutError
from .metrics import KvferryPromMetrics, KvferryStats
from .settings import Settings
from .sidechannel import Fetcher, SideChannel

log = logging.getLogger("kvferry.vllm")

WRITER = 0  # an owner's one writer: the prefill worker of its TP rank
PROOF_CHECK_S = 0.05
TOMBSTONE_S = 600.0


class HandshakeError(RuntimeError):
    """The two engines cannot exchange pages (TP sizes, layouts); the message says why."""


@dataclass
class KvferryHandshake(KVConnectorHandshakeMetadata):
    """One worker's card, gathered by vLLM and served by its scheduler's side channel."""

    tp_rank: int
    tp_size: int
    address: bytes
    pid: int
    layout: str
    signature: list[list[int]]


class KvferryMetadata(KVConnectorMetadata):
    """What the scheduler tells its workers each step."""

    def __init__(self) -> None:
        self.recv: dict[str, dict[str, Any]] = {}  # decode: load into these blocks
        self.abort: dict[str, str] = {}  # decode: aborted while waiting for remote KV
        self.refuse: dict[str, dict[str, Any]] = {}  # decode: never allocated: free the prefill
        self.send: dict[str, dict[str, Any]] = {}  # prefill: these blocks wait for a plan


def _tp(vllm_config: Any) -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # no distributed groups (one worker, or a test driving workers)
        size = vllm_config.parallel_config.tensor_parallel_size
        return vllm_config.parallel_config.rank % size, size


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module doc. ``kv_connector_extra_config`` keys: :class:`Settings`."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(vllm_config, self.settings)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self.settings)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.take_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._sched is not None
        self._sched.serve_handshake(metadata)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvferryStats(data=data) if data is not None else KvferryStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KvferryHandshake | None:
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryMetadata)
        self._worker.take_meta(meta)
        self._worker.poll()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]):
        assert self._worker is not None
        sending, recving, failed = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self):
        if self._worker is None:
            return None
        return self._worker.take_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()


# ====================================================================== scheduler side
class _SchedulerSide:
    def __init__(self, vllm_config: Any, settings: Settings) -> None:
        self.settings = settings
        ktc = vllm_config.kv_transfer_config
        self.engine_id = str(ktc.engine_id)
        self.is_producer = ktc.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.meta = KvferryMetadata()
        self.staged: set[str] = set()  # decode: loads not yet reported by the workers
        self.holding: set[str] = set()  # prefill: blocks held until finished_sending
        self.side: SideChannel | None = None

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.is_consumer and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        params = request.kv_transfer_params or {}
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # staged once, even if vLLM calls twice
        remote = _remote(params)
        if num_external > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()
            if len(groups) != 1:
                raise LayoutError(
                    f"request {request.request_id}: {len(groups)} KV cache groups; kvferry "
                    "moves one full-attention group"
                )
            self.meta.recv[request.request_id] = {
                **remote,
                "blocks": list(groups[0]),
                "tokens": len(request.prompt_token_ids),
            }
            self.staged.add(request.request_id)
        else:  # everything hit locally: the prefill's blocks can go at once
            self.meta.refuse[request.request_id] = remote

    def take_meta(self) -> KvferryMetadata:
        meta, self.meta = self.meta, KvferryMetadata()
        return meta

    def update_connector_output(self, out: Any) -> None:
        for rid in out.finished_recving or ():
            self.staged.discard(rid)
        for rid in out.finished_sending or ():
            self.holding.discard(rid)

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if rid in self.staged:
            # Aborted while WAITING_FOR_REMOTE_KVS: vLLM keeps the blocks until the
            # workers report the request, which they do only with proof (I4).
            self.meta.abort[rid] = f"request finished as {request.status.name} while loading"
            return False, None
        if self.is_consumer and params.get("do_remote_prefill"):
            # Rejected (or aborted) before any block was allocated: the prefill still
            # holds the prompt's blocks and must be told.
            params["do_remote_prefill"] = False
            self.meta.refuse[rid] = _remote(params)
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted at the prefill: no decode will ask for it
        tokens = len(request.prompt_token_ids)
        blocks = list(block_ids[0])[: -(-tokens // self.block_size)]
        if any(len(g) for g in block_ids[1:]):
            log.error("request %s: more than one KV cache group; not sent", rid)
            return False, None
        self.meta.send[rid] = {"blocks": blocks, "tokens": tokens}
        self.holding.add(rid)
        host = self.side.host if self.side else self.settings.side_channel_host
        port = self.side.port if self.side else self.settings.side_channel_port
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": rid,
            "remote_block_ids": blocks,
            "tp_size": self.tp_size,
        }

    def pending(self) -> bool:
        return bool(self.holding or self.staged)

    def serve_handshake(self, metadata: dict[int, Any]) -> None:
        workers = {
            int(rank): {
                "tp_rank": m.tp_rank,
                "tp_size": m.tp_size,
                "address": m.address,
                "pid": m.pid,
                "layout": m.layout,
                "signature": m.signature,
            }
            for rank, m in metadata.items()
        }
        blob = {"engine_id": self.engine_id, "tp_size": self.tp_size, "workers": workers}
        if self.side is not None:
            self.side.close()
        self.side = SideChannel(
            self.settings.side_channel_host,
            self.settings.side_channel_port,
            blob,
            self.settings.key,
            timeout_s=self.settings.handshake_timeout_s,
        )

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()


def _remote(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine": str(params.get("remote_engine_id", "")),
        "host": str(params.get("remote_host", "")),
        "port": int(params.get("remote_port") or 0),
        "rid": str(params.get("remote_request_id", "")),
        "tp_size": int(params.get("tp_size") or 0),
    }


# ====================================================================== worker side
@dataclass
class _Job:
    """A request at a prefill worker: the writer book and its data path."""

    rid: str
    book: WriterBook = field(init=False)
    src: list[int] | None = None  # vLLM holds these blocks until finished_sending
    tokens: int = 0
    checksums: list[int] = field(default_factory=list)
    peer: Peer | None = None
    orid: str = ""
    plan: dict[str, Any] | None = None
    dst: KVRegions | None = None
    rsegs: list[RemoteSegment] = field(default_factory=list)
    queue: list[tuple[int, Any]] = field(default_factory=list)
    inflight: list[tuple[Batch, Any]] = field(default_factory=list)
    posted_bytes: int = 0
    batches_posted: int = 0
    hold_until: float = 0.0
    reason: str = ""
    source: AbortSource = AbortSource.PREFILL

    def __post_init__(self) -> None:
        self.book = WriterBook(self.rid)


@dataclass
class _Owned:
    """A request at a decode worker: the owner book and its data path."""

    rid: str
    remote: dict[str, Any]
    blocks: list[int]
    tokens: int
    book: OwnerBook = field(init=False)
    gens: list[int] = field(default_factory=list)
    peer: Peer | None = None
    peer_pid: int = -1
    peer_local: bool = False
    notice: dict[str, Any] | None = None
    failed: bool = False
    error: str = ""
    scheduler_aborted: bool = False
    reported: bool = False
    refused: bool = False
    abort_writers_pending: bool = False
    started: float = field(default_factory=time.monotonic)
    timer_at: float | None = None
    retry_at: float | None = None
    deadline_at: float | None = None
    proof_at: float | None = None
    gone_since: float | None = None
    abort_source: AbortSource = AbortSource.INTERNAL

    def __post_init__(self) -> None:
        self.book = OwnerBook(self.rid, (WRITER,))


class _WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_rank, self.tp_size = _tp(vllm_config)
        self.layout = str(getattr(vllm_config.cache_config, "kv_cache_layout", None) or "?")
        # the protocol's one driver per side (an event an effect produces waits for the
        # rest of its row)
        self.owner_driver: Driver = Driver(
            oc.owner_table(unsafe=settings.unsafe), self._do_owner, settled=self._owner_settled
        )
        self.writer_driver: Driver = Driver(
            wc.WRITER_TABLE, self._do_writer, settled=self._writer_settled
        )
        if settings.unsafe:
            log.error("kvferry connector in UNSAFE mode: loads reported before they land")
        self.engine = TransferEngine(
            TransferConfig(
                transports=settings.transports,
                name=f"kvferry-{self.engine_id}-tp{self.tp_rank}",
            )
        )
        self.me = decode_address(self.engine.address)
        self.regions: KVRegions | None = None
        self.segments: list[Any] = []
        self.gens: torch.Tensor | None = None  # per block: bumped at each plan into it
        self.canaries: torch.Tensor | None = None  # per block: (rid hash, gen, index)
        self.jobs: dict[str, _Job] = {}
        self.owned: dict[str, _Owned] = {}
        self.tombstones: dict[str, float] = {}
        self.handshakes: dict[tuple[str, int], dict[str, Any]] = {}
        self.handshake_errors: dict[tuple[str, int], str] = {}
        self.fetcher = Fetcher(settings.handshake_timeout_s, settings.key)
        self.peers: dict[bytes, Peer] = {}
        self.remote_segments: dict[int, tuple[KVRegions, list[RemoteSegment]]] = {}
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats = KvferryStats()
        self._pending_aborts: list[_Owned] = []  # ABORT_WRITERS waiting for a handshake

    # ------------------------------------------------------------ registration
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self.kv_cache_config.num_blocks)
        self.regions = KVRegions.from_kv_caches(kv_caches, num_blocks, self.layout)
        self.segments = [self.engine.register(b.tensor) for b in self.regions.buffers]
        self.gens = torch.zeros(num_blocks, dtype=torch.int64)
        self.canaries = torch.full((num_blocks, 3), -1, dtype=torch.int64)
        log.info(
            "kvferry worker tp%d/%d: %d layers in %d buffers (%s), %d bytes per block",
            self.tp_rank,
            self.tp_size,
            len(kv_caches),
            len(self.regions.buffers),
            self.layout,
            self.regions.block_bytes,
        )

    def handshake(self) -> KvferryHandshake:
        assert self.regions is not None, "register_kv_caches first"
        return KvferryHandshake(
            self.tp_rank,
            self.tp_size,
            self.engine.address,
            os.getpid(),
            self.layout,
            self.regions.signature(),
        )

    # ------------------------------------------------------------ the scheduler's word
    def take_meta(self, meta: KvferryMetadata) -> None:
        now = time.monotonic()
        for rid, spec in meta.send.items():
            self._on_send(rid, spec, now)
        for rid, spec in meta.recv.items():
            self._on_recv(rid, spec)
        for rid, reason in meta.abort.items():
            self._on_scheduler_abort(rid, reason)
        for rid, remote in meta.refuse.items():
            self._on_refuse(rid, remote)

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        self.poll()
        for rid in finished_req_ids:
            o = self.owned.get(rid)
            if o is not None and o.book.state is OwnerState.DECODING:
                self._feed_owner(o, OwnerEvent.FINISHED)
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def take_stats(self) -> KvferryStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KvferryStats()
        return out

    # ------------------------------------------------------------ the loop
    def poll(self) -> None:
        """Progress the engine, act on messages, settled batches, handshakes and timers."""
        self.engine.progress(0)
        for msg in self.engine.take_messages():
            try:
                self._on_message(msg)
            except wire.MalformedMessage as exc:
                self.stats.count("malformed_messages")
                log.warning(
                    "kvferry: dropped a malformed message from %s: %s", msg.sender_name, exc
                )
        for job in list(self.jobs.values()):
            self._settle(job)
        for key, hs, err in self.fetcher.take():
            if hs is None:
                self.handshake_errors[key] = err
            else:
                self.handshakes[key] = hs
        if self._pending_aborts:
            waiting, self._pending_aborts = self._pending_aborts, []
            for o in waiting:
                self._abort_writers(o)
        now = time.monotonic()
        for o in list(self.owned.values()):
            self._owner_tick(o, now)
        for job in list(self.jobs.values()):
            if job.book.state is WriterState.KV_READY and now >= job.hold_until:
                self._fail_job(
                    job,
                    AbortSource.TRANSFER,
                    f"no plan from a decode within {self.settings.hold_timeout_s} s",
                )
        if len(self.tombstones) > 4096:
            cut = now - TOMBSTONE_S
            self.tombstones = {r: t for r, t in self.tombstones.items() if t > cut}

    def _on_message(self, msg: Any) -> None:
        m = wire.decode(msg.payload)
        kind = m["k"]
        if kind == wire.PLAN:
            self._on_plan(msg, m)
        elif kind == wire.ABORT:
            o = self._owned_from(msg, m)
            if o is not None:  # a writer's own abort, to us as its owner
                self._on_writer_abort_owner(o, m)
            else:
                self._on_owner_abort(msg, m)
        elif kind == wire.NOTICE:
            self._on_notice(msg, m)
        elif kind == wire.ABORT_ACK:
            self._on_ack(msg, m)

    # ============================================================ the writer (prefill)
    def _job(self, rid: str) -> _Job | None:
        if rid in self.tombstones:
            return None
        job = self.jobs.get(rid)
        if job is None:
            job = self.jobs[rid] = _Job(rid)
        return job

    def _feed_writer(self, job: _Job, event: WriterEvent) -> None:
        self.writer_driver.feed(job, event)

    def _writer_settled(self, job: _Job, move: Any) -> None:
        if job.book.state in (WriterState.DONE, WriterState.ABORTED):
            self.jobs.pop(job.rid, None)

    def _do_writer(self, do: WriterDo, job: _Job) -> None:
        D = WriterDo
        if do is D.START_PREFILL:
            # vLLM computed the KV already: checksum the source blocks, then KV_READY.
            assert self.regions is not None and job.src is not None
            data = self.regions.block_bytes_of(job.src)
            job.checksums = page_checksums(data, list(range(len(job.src)))).tolist()
            self._feed_writer(job, WriterEvent.KV_READY)
        elif do is D.POST_WRITES:
            self._post_writes(job)
        elif do is D.POST_NEXT:
            self._post_next(job)
        elif do is D.SEND_NOTICE:
            self._send_notice(job)
        elif do is D.STOP_POSTING:
            job.queue = []
        elif do is D.TOMBSTONE:
            self.tombstones[job.rid] = time.monotonic()
        elif do is D.TELL_ABORT:
            log.error(
                "request %s: prefill worker tp%d failed: %s", job.rid, self.tp_rank, job.reason
            )
            self.stats.abort(job.source.value)
            if job.peer is not None:
                self._send(
                    job.peer,
                    wire.encode(
                        wire.ABORT,
                        rid=job.rid,
                        orid=job.orid,
                        source=job.source.value,
                        reason=job.reason,
                    ),
                )
        elif do is D.SEND_ACK:
            ack = self._notify(job.peer, wire.encode(wire.ABORT_ACK, rid=job.rid, orid=job.orid))
            if ack is None:
                self._feed_writer(job, WriterEvent.ACK_FLUSHED)
            else:
                job.inflight.append(
                    (ack, lambda b: self._feed_writer(job, WriterEvent.ACK_FLUSHED))
                )
        elif do is D.ACK_NOW:
            self._notify(job.peer, wire.encode(wire.ABORT_ACK, rid=job.rid, orid=job.orid))
        elif do is D.FREE_SOURCE:
            if job.src is not None:
                self.finished_sending.add(job.rid)
        elif do is D.REPORT_NOTHING_HELD:
            pass  # vLLM is told when (if ever) the scheduler hands this request over
        else:  # pragma: no cover - the enum is closed
            raise AssertionError(do)

    def _on_send(self, rid: str, spec: dict[str, Any], now: float) -> None:
        job = self._job(rid)
        if job is None:  # aborted before the scheduler handed it over: nothing was posted
            self.finished_sending.add(rid)
            return
        job.src, job.tokens = list(spec["blocks"]), int(spec["tokens"])
        job.hold_until = now + self.settings.hold_timeout_s
        self._feed_writer(job, WriterEvent.PROMPT)

    def _peer(self, address: bytes) -> Peer:
        peer = self.peers.get(address)
        if peer is None or not self.engine.peer_alive(peer):
            peer = self.peers[address] = self.engine.connect(address)
        return peer

    def _on_plan(self, msg: Any, m: dict[str, Any]) -> None:
        rid = m["rid"]
        peer = self._peer(msg.sender_address)
        job = self._job(rid)
        if job is None:  # ended here (and flushed): fail the load, and ack at once
            self._send(
                peer,
                wire.encode(
                    wire.ABORT,
                    rid=rid,
                    orid=m["orid"],
                    source=AbortSource.PREFILL.value,
                    reason=f"request {rid} already ended at prefill worker tp{self.tp_rank}",
                ),
            )
            self._notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=m["orid"]))
            return
        job.peer, job.orid, job.plan = peer, m["orid"], m
        if m["tp_size"] != self.tp_size or m["tp_rank"] != self.tp_rank:
            self._fail_job(
                job,
                AbortSource.TRANSFER,
                f"plan from decode TP {m['tp_rank']}/{m['tp_size']} at prefill TP "
                f"{self.tp_rank}/{self.tp_size}: heterogeneous TP is not supported",
            )
            return
        try:
            key = msg.sender_incarnation
            if key not in self.remote_segments:
                regions = KVRegions.from_wire(m["regions"])
                rsegs = [
                    self.engine.open_segment(peer, SegmentDescriptor.unpack(bytes(d)))
                    for d in m["descs"]
                ]
                self.remote_segments[key] = (regions, rsegs)
            job.dst, job.rsegs = self.remote_segments[key]
        except (TransferError, LayoutError, ValueError, KeyError) as exc:
            self._fail_job(job, AbortSource.TRANSFER, f"plan unusable: {exc}")
            return
        self._feed_writer(job, WriterEvent.PLAN)

    def _post_writes(self, job: _Job) -> None:
        assert job.plan is not None and job.src is not None and job.dst is not None
        assert self.regions is not None
        dst = job.plan["blocks"]
        if len(dst) > len(job.src) or not dst:
            self._fail_job(
                job,
                AbortSource.PREFILL,
                f"plan holds {len(dst)} blocks; the prompt's KV fills {len(job.src)}",
            )
            return
        if (self.regions.layout, self.regions.signature()) != (job.dst.layout, job.dst.signature()):
            self._fail_job(
                job,
                AbortSource.TRANSFER,
                f"KV layouts differ: prefill {self.regions.layout} "
                f"{self.regions.signature()[:1]} vs decode {job.dst.layout} "
                f"{job.dst.signature()[:1]}",
            )
            return
        src = job.src[len(job.src) - len(dst) :]
        per = max(1, self.settings.max_batch_bytes // max(1, self.regions.block_bytes))
        job.queue = []
        for lo in range(0, len(dst), per):
            for i in range(len(self.regions.buffers)):
                job.queue.append(
                    (i, self.regions.triples(i, src[lo : lo + per], job.dst, dst[lo : lo + per]))
                )
        job.posted_bytes = len(dst) * self.regions.block_bytes
        job.checksums = job.checksums[len(job.src) - len(dst) :]
        self._post_next(job)

    def _post_next(self, job: _Job) -> None:
        if not job.queue:
            return
        (i, triples), job.queue = job.queue[0], job.queue[1:]
        assert job.peer is not None
        try:
            batch = self.engine.write(job.peer, self.segments[i], job.rsegs[i], triples)
        except TransferError as exc:
            self._fail_job(job, AbortSource.TRANSFER, f"write refused: {exc}")
            return
        wc.on_posted(job.book)
        job.batches_posted += 1
        self.stats.add(bytes=int(triples[:, 2].sum()))
        job.inflight.append((batch, lambda b: self._written(job, b)))

    def _written(self, job: _Job, batch: Batch) -> None:
        ok = batch.peek() is BatchStatus.COMPLETED
        if not ok and job.book.state is WriterState.WRITING:
            job.source, job.reason = AbortSource.TRANSFER, f"write failed: {batch.error}"
        self._feed_writer(job, wc.on_settled(job.book, ok, bool(job.queue)))

    def _settle(self, job: _Job) -> None:
        """Run the continuation of every batch of ``job`` that settled."""
        current, job.inflight = job.inflight, []
        kept = []
        for batch, then in current:
            if self.engine.poll(batch) is BatchStatus.PENDING:
                kept.append((batch, then))
            else:
                then(batch)
        job.inflight = kept + job.inflight

    def _send_notice(self, job: _Job) -> None:
        assert job.plan is not None
        payload = wire.encode(
            wire.NOTICE,
            rid=job.rid,
            orid=job.orid,
            tokens=job.tokens,
            blocks=list(job.plan["blocks"]),
            gens=list(job.plan["gens"]),
            checksums=[int(c) for c in job.checksums],
            bytes=job.posted_bytes,
        )
        notice = self._notify(job.peer, payload)
        if notice is None:
            self._fail_job(job, AbortSource.TRANSFER, "the notice could not be sent")
            return
        self.stats.add(pages=len(job.plan["blocks"]))
        job.inflight.append((notice, lambda b: self._feed_writer(job, WriterEvent.NOTICE_FLUSHED)))

    def _fail_job(self, job: _Job, source: AbortSource, reason: str) -> None:
        job.source, job.reason = source, reason
        self._feed_writer(job, wc.on_failure(job.book))

    def _on_owner_abort(self, msg: Any, m: dict[str, Any]) -> None:
        """An ABORT from the owner (decode) for one of our jobs."""
        rid = m["rid"]
        job = self.jobs.get(rid)
        if job is None and rid in self.tombstones:
            # Ended here already (and flushed): ack again, nothing is in flight.
            peer = self._peer(msg.sender_address)
            self._notify(peer, wire.encode(wire.ABORT_ACK, rid=rid, orid=m["orid"]))
            return
        if job is None:
            job = self.jobs[rid] = _Job(rid)
        if job.peer is None:
            job.peer, job.orid = self._peer(msg.sender_address), m["orid"]
        self.stats.abort(m["source"])
        self._feed_writer(job, wc.on_abort(job.book))

    def _send(self, peer: Peer | None, payload: bytes) -> Batch | None:
        if peer is None:
            return None
        try:
            return self.engine.send(peer, payload)
        except TransferError as exc:
            log.warning("kvferry: message to %s not sent: %s", peer.name, exc)
            return None

    def _notify(self, peer: Peer | None, payload: bytes) -> Batch | None:
        if peer is None:
            return None
        try:
            return self.engine.notify(peer, payload)
        except TransferError as exc:
            log.warning("kvferry: notice to %s not sent: %s", peer.name, exc)
            return None

    # ============================================================ the owner (decode)
    def _feed_owner(self, o: _Owned, event: OwnerEvent) -> None:
        self.owner_driver.feed(o, event)

    def _owner_settled(self, o: _Owned, move: Any) -> None:
        if o.book.state is OwnerState.CLOSED:
            self.owned.pop(o.rid, None)

    def _report(self, o: _Owned) -> None:
        """Hand the request back to vLLM (its blocks are vLLM's to free or read now)."""
        if o.reported:
            return
        o.reported = True
        self.finished_recving.add(o.rid)
        if o.failed and not o.scheduler_aborted:
            self.failed_recving.add(o.rid)
            self.load_errors.update(o.blocks)
            log.error("request %s: KV load failed: %s", o.rid, o.error)
        self.stats.add(transfer_ms=1e3 * (time.monotonic() - o.started))

    def _do_owner(self, do: OwnerDo, o: _Owned) -> None:
        D = OwnerDo
        now = time.monotonic()
        if do is D.STAMP_CANARIES:
            assert self.gens is not None and self.canaries is not None
            idx = torch.tensor(o.blocks, dtype=torch.int64)
            self.gens[idx] += 1
            o.gens = self.gens[idx].tolist()
            h = request_id_hash(o.rid)
            self.canaries[idx] = torch.tensor(
                [[h, g, i] for i, g in enumerate(o.gens)], dtype=torch.int64
            )
        elif do is D.SEND_PLAN:
            assert self.regions is not None
            payload = wire.encode(
                wire.PLAN,
                rid=o.remote["rid"],
                orid=o.rid,
                blocks=o.blocks,
                gens=o.gens,
                tokens=o.tokens,
                regions=self.regions.to_wire(),
                descs=[s.descriptor().pack() for s in self.segments],
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
            if self._send(o.peer, payload) is None:
                o.failed, o.error = True, "the plan could not be sent"
            if self.settings.unsafe:  # BROKEN MODE: the load is reported before it lands
                self._report(o)
        elif do is D.ARM_TRANSFER_TIMER:
            o.timer_at = now + self.settings.transfer_timeout_s
        elif do is D.CANCEL_TIMER:
            o.timer_at = None
        elif do is D.VERIFY:
            self._verify(o)
        elif do is D.TOMBSTONE:
            self.tombstones[o.rid] = now
        elif do is D.REPORT_FAILED:
            o.failed = True
        elif do is D.REPORT_FINISHED:
            pass
        elif do is D.ABORT_WRITERS:
            o.abort_writers_pending = True
            self._abort_writers(o)
        elif do is D.REPORT_NOTHING_HELD:
            self._report(o)
        elif do is D.FREE:
            self._report(o)
        elif do is D.QUARANTINE:
            self.stats.add(quarantined_blocks=len(o.blocks))
        elif do is D.ASK_ACKS:
            self._send(
                o.peer,
                wire.encode(
                    wire.ABORT,
                    rid=o.remote["rid"],
                    orid=o.rid,
                    source=o.abort_source.value,
                    reason=o.error or "aborted",
                ),
            )
        elif do is D.ARM_RETRY:
            o.retry_at = now + self.settings.ack_retry_s
        elif do is D.ARM_DEADLINE:
            o.deadline_at = now + self.settings.abort_deadline_s
        elif do is D.SEVER_PENDING:
            o.retry_at = o.retry_at if o.book.state is OwnerState.FENCED else None
            if o.peer is not None:
                self.engine.close(o.peer, force=True)
                self.peers.pop(o.peer.address, None)
            self.stats.add(severed_peers=1)
            log.warning(
                "request %s: prefill worker severed (pid %d): %s", o.rid, o.peer_pid, o.error
            )
        elif do is D.CHECK_PROOF:
            self._check_proof(o, now)
        elif do is D.ARM_PROOF_CHECK:
            o.proof_at = now + PROOF_CHECK_S
        elif do in (D.RELEASE_ACKED, D.RELEASE_SEVERED):
            log.info("request %s: %d blocks released (%s)", o.rid, len(o.blocks), do.name)
            self._report(o)
        elif do is D.RELEASE_UNSAFE:
            log.error("UNSAFE: request %s: blocks released without proof", o.rid)
            self._report(o)
        elif do is D.COUNT_INTEGRITY:
            self.stats.add(checksum_failures=1)
        else:  # pragma: no cover - the enum is closed
            raise AssertionError(do)

    def _writer_gone(self, o: _Owned, now: float) -> Proof | None:
        """The proof that the writer is gone, by the protocol's rule
        (:func:`kvferry.engine.protocol.gone_proof`): its process exited on this host and
        the drain passed. A prefill on another host is never proven gone here (no exit
        records reach a connector), so its pages wait for its ack."""
        if not o.peer_local or o.peer_pid < 0 or not process_gone(o.peer_pid):
            o.gone_since = None
            return None
        o.gone_since = o.gone_since or now
        facts = GoneFacts(
            same_host=True, process_gone=True, gone_for_s=now - o.gone_since, drain_s=DRAIN_S
        )
        return gone_proof(facts)

    def _check_proof(self, o: _Owned, now: float) -> None:
        if o.book.state is not OwnerState.FENCED:
            return
        proof = self._writer_gone(o, now)
        self._feed_owner(o, oc.on_proof_check(o.book, {WRITER: proof} if proof else {}))

    def _owner_tick(self, o: _Owned, now: float) -> None:
        state = o.book.state
        if state is OwnerState.NEW:
            self._try_assign(o)
            return
        pid_gone = o.peer_local and o.peer_pid >= 0 and process_gone(o.peer_pid)
        if state is OwnerState.AWAITING:
            if pid_gone:
                o.abort_source = AbortSource.PEER
                o.error = (
                    f"prefill worker tp{self.tp_rank} of engine {o.remote['engine']} "
                    f"(pid {o.peer_pid}) exited before its notice"
                )
                self.stats.abort(AbortSource.PEER.value)
                self._feed_owner(o, oc.on_failure(o.book))
            elif o.timer_at is not None and now >= o.timer_at:
                o.timer_at = None
                o.abort_source = AbortSource.TRANSFER
                o.error = (
                    f"no notice within the {self.settings.transfer_timeout_s} s transfer timeout"
                )
                self.stats.abort(AbortSource.TRANSFER.value)
                self._feed_owner(o, oc.on_failure(o.book))
            return
        if state is OwnerState.QUARANTINED:
            if pid_gone:  # its ack can never come: fence it now, release on proof
                self._feed_owner(o, oc.on_deadline(o.book))
            elif o.deadline_at is not None and now >= o.deadline_at:
                o.deadline_at = None
                self._feed_owner(o, oc.on_deadline(o.book))
            elif o.retry_at is not None and now >= o.retry_at:
                self._feed_owner(o, OwnerEvent.RETRY)
            return
        if state is OwnerState.FENCED:
            if o.proof_at is not None and now >= o.proof_at:
                o.proof_at = None
                self._check_proof(o, now)

    def _on_recv(self, rid: str, spec: dict[str, Any]) -> None:
        if rid in self.owned or rid in self.tombstones:
            return
        remote = {k: spec[k] for k in ("engine", "host", "port", "rid", "tp_size")}
        o = self.owned[rid] = _Owned(rid, remote, list(spec["blocks"]), int(spec["tokens"]))
        self.fetcher.ask((remote["host"], remote["port"]))
        self._try_assign(o)

    def _worker_card(self, remote: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        key = (remote["host"], remote["port"])
        if key in self.handshake_errors:
            return None, f"handshake with {key[0]}:{key[1]} failed: {self.handshake_errors[key]}"
        hs = self.handshakes.get(key)
        if hs is None:
            return None, ""
        if hs["tp_size"] != self.tp_size:
            return None, (
                f"heterogeneous TP refused at handshake: prefill engine {hs['engine_id']} has "
                f"TP size {hs['tp_size']}, this decode engine {self.tp_size}"
            )
        card = hs["workers"].get(self.tp_rank)
        if card is None:
            return None, f"prefill engine {hs['engine_id']} has no TP rank {self.tp_rank}"
        assert self.regions is not None
        if card["layout"] != self.regions.layout or card["signature"] != self.regions.signature():
            return None, (
                f"KV layouts refused at handshake: prefill {card['layout']} vs decode "
                f"{self.regions.layout} (per-block runs differ)"
            )
        return card, ""

    def _try_assign(self, o: _Owned) -> None:
        card, err = self._worker_card(o.remote)
        if card is None and not err:
            return  # the handshake is on its way
        if card is None:
            o.error = err
            log.error("request %s: %s", o.rid, err)
            self._feed_owner(o, oc.on_assign(o.book, (WRITER,), granted=False))
            return
        o.peer = self._peer(bytes(card["address"]))
        info = decode_address(bytes(card["address"]))
        o.peer_pid = int(card["pid"])
        o.peer_local = (info.host, info.boot_id, info.pidns) == (
            self.me.host,
            self.me.boot_id,
            self.me.pidns,
        )
        self._feed_owner(o, oc.on_assign(o.book, (WRITER,), granted=True))

    def _abort_writers(self, o: _Owned) -> None:
        key = (o.remote["host"], o.remote["port"])
        hs = self.handshakes.get(key)
        if hs is None:
            if key not in self.handshake_errors:
                self.fetcher.ask(key)
                self._pending_aborts.append(o)
            return
        ranks = [self.tp_rank]
        if self.tp_rank == 0:  # ranks this decode has no worker for
            ranks += [r for r in hs["workers"] if r >= self.tp_size]
        for r in ranks:
            w = hs["workers"].get(r)
            if w is None:
                continue
            self._send(
                self._peer(bytes(w["address"])),
                wire.encode(
                    wire.ABORT,
                    rid=o.remote["rid"],
                    orid=o.rid,
                    source=AbortSource.DECODE.value,
                    reason=o.error or "rejected at the decode",
                ),
            )
        o.abort_writers_pending = False

    def _on_refuse(self, rid: str, remote: dict[str, Any]) -> None:
        """Never allocated here: the owner refuses, and the prefill is told to free."""
        if rid in self.owned or rid in self.tombstones or not remote.get("rid"):
            return
        o = _Owned(rid, remote, [], 0)
        o.error = "rejected at the decode before allocation"
        o.reported = True  # vLLM holds nothing for it: no report
        self.stats.abort(AbortSource.DECODE.value)
        self._feed_owner(o, oc.on_assign(o.book, (WRITER,), granted=False))

    def _on_scheduler_abort(self, rid: str, reason: str) -> None:
        o = self.owned.get(rid)
        if o is None:
            return
        o.scheduler_aborted = True
        o.abort_source = AbortSource.CLIENT
        o.error = o.error or reason
        self.stats.abort(AbortSource.CLIENT.value)
        # Before the plan (NEW) nothing can land: the table closes it and tells the writer.
        self._feed_owner(o, oc.on_abort(o.book, writers_told=False))

    def _owned_from(self, msg: Any, m: dict[str, Any]) -> _Owned | None:
        o = self.owned.get(m["orid"])
        if o is None or o.peer is None:
            return None
        if msg.sender_incarnation != o.peer.incarnation:
            self.stats.count("stale_messages")
            return None
        return o

    def _on_notice(self, msg: Any, m: dict[str, Any]) -> None:
        o = self._owned_from(msg, m)
        if o is None:
            return
        if o.book.state is OwnerState.AWAITING:
            o.notice = m
        self._feed_owner(o, oc.on_notice(o.book, WRITER, whole=True))

    def _on_ack(self, msg: Any, m: dict[str, Any]) -> None:
        o = self._owned_from(msg, m)
        if o is None:
            return
        if o.book.state in (OwnerState.AWAITING, OwnerState.VERIFYING):
            o.failed = True  # the writer ended the request on its side
            o.error = o.error or "the prefill worker acked an abort this decode did not send"
        self._feed_owner(o, oc.on_ack(o.book, WRITER, severed=o.book.state is OwnerState.FENCED))

    def _on_writer_abort_owner(self, o: _Owned, m: dict[str, Any]) -> None:
        o.failed = True
        o.abort_source = AbortSource.PREFILL
        o.error = f"prefill worker aborted ({m['source']}): {m['reason']}"
        self._feed_owner(o, oc.on_abort(o.book, writers_told=True))

    def _verify(self, o: _Owned) -> None:
        """I5, by :mod:`kvferry.engine.verify` as a decode rank checks it: length, blocks
        and generations, bytes, canaries, checksums."""
        assert self.regions is not None and self.canaries is not None
        n = o.notice
        err = ""
        if self.settings.unsafe:
            pass
        elif n is None:
            err = "no notice"
        else:
            regions, canaries = self.regions, self.canaries
            planned = Planned(
                o.rid, o.tokens, o.blocks, o.gens, len(o.blocks) * regions.block_bytes, "block"
            )
            notice = VerifyNotice(
                WRITER, n["tokens"], n["blocks"], n["gens"], n["checksums"], n["bytes"]
            )

            def checksums_of(blocks: Sequence[int]) -> torch.Tensor:
                return page_checksums(regions.block_bytes_of(blocks), list(range(len(blocks))))

            integrity = self.settings.integrity
            try:
                check_all(
                    planned,
                    notice,
                    canaries[torch.tensor(o.blocks)] if integrity else None,
                    checksums_of if integrity else None,
                )
            except IntegrityError as exc:
                err = exc.reason
        if err:
            o.error = f"integrity check failed: {err}"
            self._feed_owner(o, OwnerEvent.CORRUPT)
        else:
            self._feed_owner(o, OwnerEvent.VERIFIED)
            self._report(o)

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # pragma: no cover
            log.exception("kvferry: engine shutdown")
