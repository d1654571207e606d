"""kvferry as a vLLM 0.33 KV connector: the prefill pushes a prompt's KV one-sided into
the decode's blocks, and the decode gives a block back to vLLM only with proof that no
write can land in it any more.

One class, :class:`KvferryConnector`, in each of vLLM's processes: role SCHEDULER in the
engine core (it must not block: it stages block ids and keeps the books of what vLLM
holds), role WORKER in each TP worker (it owns a kvferry ``TransferEngine`` and runs the
protocol).

The protocol is kvferry's own, not a copy: each decode worker hosts the owner's driver
(:class:`~kvferry.engine.protocol.owner_driver.OwnerDriver`, :mod:`.owner_host`) and each
prefill worker the writer's (:class:`~kvferry.engine.protocol.writer_driver.WriterDriver`,
:mod:`.writer_host`), the same code the service's ranks run, over ports of vLLM's: the
blocks vLLM holds until ``finished_recving``/``finished_sending``, the worker's transfer
engine as the wire (:mod:`.link`), and timers fired from the connector's own polls
(:mod:`.loop`). This module turns vLLM's calls into theirs.

Decode TP worker ``r`` is the owner of its share of a request's blocks; its writers are
the prefill workers that hold its heads (:mod:`.reshape`: with equal TP sizes the prefill
worker of the same rank, else one or several, each writing the heads it is assigned).
The two engines may differ in TP size, block size and KV layout: rows that do not sit
alike on both sides move as runs planned once per request, checked per decode block.
A decode request loads only from ``kv_transfer_params`` whose ticket the prefill's
scheduler sealed for that very prompt (:mod:`.params`): the parameters are a client's
input, and no client can name another request's KV.
vLLM's ``KVOutputAggregator`` reports a request to the scheduler only once every TP
worker reported it, so the abort-ack protocol holds across every TP worker of both
engines: each decode worker quarantines until each of its writers acked after its flush
or is proven gone, and each prefill worker gives its blocks back once each decode worker
that plans from it has ended its job.

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
from dataclasses import dataclass
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

from kvferry.cluster.clock import MonotonicClock
from kvferry.cluster.receive import SeqWindow
from kvferry.cluster.trust import Unauthenticated
from kvferry.transfer import TransferConfig, TransferEngine, decode_address

from . import wire
from .layout import KVRegions, LayoutError
from .link import Link
from .loop import PollTimers, Tombstones
from .metrics import KvferryPromMetrics, KvferryStats
from .owner_host import Load, OwnerHost
from .params import TICKET, BadRemoteParams, check_id, checked, prompt_digest, seal
from .parts import WorkerParts
from .settings import Settings
from .sidechannel import SideChannel
from .staging import Staging
from .writer_host import WriterHost

log = logging.getLogger("kvferry.vllm")

MAX_SENDERS = 4096  # sender engine incarnations whose sequence numbers are remembered


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
    kv_heads: int = 0  # the engine's KV heads in all
    regions: dict[str, Any] | None = None  # KVRegions.to_wire(): where each row lives


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


def _kv_heads(vllm_config: Any) -> int:
    """The model's KV heads in all (0 when vLLM's config does not say: then the worker's
    own times the TP size)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):  # a config without a model (test drivers)
        return 0


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
        self.remotes: dict[str, dict[str, Any]] = {}  # decode: tickets checked, not yet staged
        self.matched: dict[str, int] = {}  # decode: external tokens matched, not yet staged
        self.side: SideChannel | None = None

    def _remote(self, request: Any) -> dict[str, Any]:
        """The prefill decode ``request`` loads from, its ticket checked against its prompt
        once (vLLM asks again each step the request waits for blocks)."""
        rid = request.request_id
        if rid not in self.remotes:
            params = request.kv_transfer_params or {}
            key = self.settings.key.ticket_key
            self.remotes[rid] = checked(key, params, rid, request.prompt_token_ids)
        return self.remotes[rid]

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.is_consumer and params.get("do_remote_prefill"):
            try:
                self._remote(request)
            except BadRemoteParams as exc:  # a client's own: the prompt is computed here
                log.error("request %s: no remote prefill: %s", request.request_id, exc)
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids) - num_computed
            if count > 0:
                self.matched[request.request_id] = count
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        params = request.kv_transfer_params or {}
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return
        params["do_remote_prefill"] = False  # staged once, even if vLLM calls twice
        rid = request.request_id
        remote = self._remote(request)  # checked by get_num_new_matched_tokens
        self.remotes.pop(rid, None)
        matched = self.matched.pop(rid, None)
        if num_external > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()
            load = {**remote, "blocks": list(groups[0]), "tokens": len(request.prompt_token_ids)}
            # kvferry writes the prompt's last blocks with the whole prompt's KV: anything
            # else would put KV at the wrong positions, so the load fails here (vLLM
            # computes the prompt) rather than the engine stopping inside its schedule
            if len(groups) != 1:
                load["refused"] = f"{len(groups)} KV cache groups; kvferry moves one"
            elif num_external != matched:
                load["refused"] = (
                    f"vLLM allocated for {num_external} external tokens where {matched} were "
                    "matched; kvferry loads the whole rest of the prompt"
                )
            self.meta.recv[rid] = load
            self.staged.add(rid)
            if "refused" in load:
                log.error("request %s: remote prefill refused: %s", rid, load["refused"])
                self.meta.refuse[rid] = remote  # the prefill frees the prompt's blocks
        else:  # everything hit locally: the prefill's blocks can go at once
            self.meta.refuse[rid] = remote

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
        remote = self.remotes.pop(rid, None)
        self.matched.pop(rid, None)
        if rid in self.staged:
            # Aborted while WAITING_FOR_REMOTE_KVS: vLLM keeps the blocks until the
            # workers report the request, which they do only with proof (I4).
            self.meta.abort[rid] = f"request finished as {request.status.name} while loading"
            return False, None
        if self.is_consumer and params.get("do_remote_prefill"):
            # Rejected (or aborted) before any block was allocated: the prefill still
            # holds the prompt's blocks and must be told.
            params["do_remote_prefill"] = False
            try:  # only a ticket's prefill request is told: never another's, a client named
                self.meta.refuse[rid] = remote or self._remote(request)
            except BadRemoteParams as exc:
                log.error("request %s: the prefill cannot be told to free: %s", rid, exc)
            self.remotes.pop(rid, None)
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted at the prefill: no decode will ask for it
        try:
            check_id("request id", rid)
            digest = prompt_digest(request.prompt_token_ids)
        except BadRemoteParams as exc:
            log.error("request %s: not sent to a decode: %s", rid[:64], exc)
            return False, None
        tokens = len(request.prompt_token_ids)
        blocks = list(block_ids[0])[: -(-tokens // self.block_size)]
        if any(len(g) for g in block_ids[1:]):
            log.error("request %s: more than one KV cache group; not sent", rid)
            return False, None
        self.meta.send[rid] = {"blocks": blocks, "tokens": tokens}
        self.holding.add(rid)
        remote = {
            "engine": self.engine_id,
            "host": self.side.host if self.side else self.settings.side_channel_host,
            "port": self.side.port if self.side else self.settings.side_channel_port,
            "rid": rid,
            "tp_size": self.tp_size,
            "src": blocks,
        }
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": remote["engine"],
            "remote_host": remote["host"],
            "remote_port": remote["port"],
            "remote_request_id": rid,
            "remote_block_ids": blocks,
            "tp_size": self.tp_size,
            TICKET: seal(self.settings.key.ticket_key, remote, digest),
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
                "regions": m.regions,
            }
            for rank, m in metadata.items()
        }
        heads = {int(getattr(m, "kv_heads", 0)) for m in metadata.values()}
        blob = {
            "engine_id": self.engine_id,
            "wire": wire.CODEC.version,  # a decode of another version refuses at once
            "tp_size": self.tp_size,
            "kv_heads": max(heads, default=0),
            "workers": workers,
        }
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


# ====================================================================== worker side
class _WorkerSide:
    """One TP worker: its transfer engine, vLLM's KV buffers registered with it, and the
    two hosts of the protocol (the owner's for loads, the writer's for sends) fed from
    what the scheduler says and what arrives, and polled from vLLM's calls."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: Settings) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        # an ABORT no load of ours claims is an owner's for our send only where we send
        self.sends = vllm_config.kv_transfer_config.kv_role in ("kv_producer", "kv_both")
        self.tp_rank, self.tp_size = _tp(vllm_config)
        self.kv_heads = _kv_heads(vllm_config)
        self.layout = str(getattr(vllm_config.cache_config, "kv_cache_layout", None) or "?")
        if settings.unsafe:
            log.error("kvferry connector in UNSAFE mode: loads reported before they land")
        self.engine = TransferEngine(
            TransferConfig(
                transports=settings.transports,
                name=f"kvferry-{self.engine_id}-tp{self.tp_rank}",
                max_message_bytes=wire.MESSAGE_BYTES,
            )
        )
        self.key = settings.key
        self.link = Link(self.engine, self.key)
        self._unauthenticated_from: set[bytes] = set()  # senders logged once (bounded)
        self._windows: dict[bytes, SeqWindow] = {}  # by sender address (_fresh)
        self.clock = MonotonicClock()
        self.stats = KvferryStats()
        self.tombstones = Tombstones(self.clock)
        self.regions: KVRegions | None = None
        parts = WorkerParts(
            settings, self.link, self.stats, self.tombstones, self.clock, self.tp_rank, self.tp_size
        )
        self.owner = OwnerHost(
            parts,
            PollTimers(self.clock, on_error=self._owner_timer_failed),
            decode_address(self.engine.address),
        )
        self.writer = WriterHost(parts, PollTimers(self.clock, on_error=self._writer_timer_failed))

    def _owner_timer_failed(self, rid: str | None, exc: Exception) -> None:
        self.owner.fail_request(rid, exc)

    def _writer_timer_failed(self, rid: str | None, exc: Exception) -> None:
        self.writer.fail_request(rid, exc)

    # ------------------------------------------------------------ registration
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self.kv_cache_config.num_blocks)
        self.regions = KVRegions.from_kv_caches(kv_caches, num_blocks, self.layout)
        segments = [self.engine.register(b.tensor) for b in self.regions.buffers]
        local = self.regions.layers[0].heads
        if not self.kv_heads:
            self.kv_heads = local * self.tp_size
        if local != max(1, self.kv_heads // self.tp_size):
            raise LayoutError(
                f"worker tp{self.tp_rank}/{self.tp_size} holds {local} KV heads of "
                f"{self.kv_heads}; vLLM splits them {max(1, self.kv_heads // self.tp_size)} "
                "a worker"
            )
        staging = None
        devices = {b.tensor.device for b in self.regions.buffers}
        if self.settings.staging_slots > 0 and len(devices) == 1:
            # host buffers gather natively; CUDA buffers on their device (torch)
            staging = Staging(
                self.engine,
                self.settings.max_batch_bytes,
                self.settings.staging_slots,
                device=devices.pop(),
            )
        self.owner.attach(self.regions, segments, self.kv_heads)
        self.writer.attach(self.regions, segments, self.kv_heads, staging)
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
            self.kv_heads,
            self.regions.to_wire(),
        )

    # ------------------------------------------------------------ the scheduler's word
    def take_meta(self, meta: KvferryMetadata) -> None:
        for rid, spec in meta.send.items():
            self.writer.on_send(rid, spec)
        for rid, spec in meta.recv.items():
            self.owner.on_recv(rid, spec)
        for rid, reason in meta.abort.items():
            self.owner.on_scheduler_abort(rid, reason)
        for rid, remote in meta.refuse.items():
            self.owner.on_refuse(rid, remote)

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        self.poll()
        self.owner.finished(finished_req_ids)
        o, w = self.owner, self.writer
        out = (w.finished_sending, o.finished_recving, o.failed_recving)
        w.finished_sending, o.finished_recving, o.failed_recving = set(), set(), set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self.owner.load_errors = self.owner.load_errors, set()
        return out

    def take_stats(self) -> KvferryStats | None:
        if self.stats.is_empty():
            return None
        out = KvferryStats(data=self.stats.data)
        self.stats.reset()  # a new dict: the hosts keep adding to this object
        return out

    # ------------------------------------------------------------ the loop
    def poll(self) -> None:
        """Progress the engine; act on messages, settled batches, handshakes, writers'
        exits and due timers (the protocol's timers are checked here, nowhere else)."""
        self.engine.progress(0)
        for msg in self.engine.take_messages():
            try:
                self._on_message(msg)
            except wire.MalformedMessage as exc:
                self.stats.count("malformed_messages")
                log.warning(
                    "kvferry: dropped a malformed message from %s: %s", msg.sender_name, exc
                )
        self.writer.settle()
        self.owner.poll()
        self.owner.timers.fire_due()
        self.writer.timers.fire_due()
        self.tombstones.sweep()

    def _on_message(self, msg: Any) -> None:
        """One message, decoded (MalformedMessage otherwise) and acted on. One that
        decodes but that a host cannot act on (an exception of its own) fails the request
        it names on the host it went to, through the protocol, and the loop goes on."""
        try:
            seq, payload = self.key.open_message(
                self.engine.incarnation, msg.sender_address, msg.payload
            )
        except Unauthenticated as exc:
            self.stats.count("unauthenticated_messages")
            if msg.sender_address not in self._unauthenticated_from:
                if len(self._unauthenticated_from) >= 1024:
                    self._unauthenticated_from.clear()
                self._unauthenticated_from.add(msg.sender_address)
                log.warning(
                    "kvferry: dropped a message from %s: %s (further ones from it are "
                    "counted, not logged)",
                    msg.sender_name,
                    exc,
                )
            return
        if not self._fresh(msg, seq):
            return
        m = wire.decode(payload)
        side = ""
        try:
            side, found = self._route(msg, m)
            self._act_on(msg, m, side, found)
        except Exception as exc:
            self.stats.count("internal_errors")
            log.error(
                "kvferry: request %s (decode) / %s (prefill): a %s from %s could not be acted "
                "on: %s: %s",
                m.get("orid"), m.get("rid"), m["k"].name, msg.sender_name, type(exc).__name__, exc,
            )  # fmt: skip
            # the writer keys its jobs by the prefill's request id, the owner its loads by
            # the decode's: each fails only its own (a kv_both engine hosts both)
            if side == "writer":
                self.writer.fail_request(m.get("rid"), exc)
            elif side == "owner":
                self.owner.fail_request(m.get("orid"), exc)

    def _fresh(self, msg: Any, seq: int) -> bool:
        """Whether the authenticated message numbered ``seq`` by its sender is new: the
        sender's address names one engine incarnation (and the tag covers it), so each
        address has one window of numbers (:class:`SeqWindow`; out of order within it is
        taken). A replay is refused, counted and logged with the sender and the numbers.
        The windows of the senders heard from least lately are dropped past
        :data:`MAX_SENDERS` (engines restarted long ago)."""
        window = self._windows.pop(msg.sender_address, None)
        if window is None:
            window = SeqWindow()
            if len(self._windows) >= MAX_SENDERS:
                del self._windows[next(iter(self._windows))]
        self._windows[msg.sender_address] = window  # the most lately heard from, last
        if window.take(0, seq):
            return True
        self.stats.count("replayed_messages")
        log.warning(
            "kvferry: refused a replayed message from %s: sequence number %d seen already "
            "(every number at or below %d counts as seen, and the last %d above it)",
            msg.sender_name, seq, window.floor(0), window.size,
        )  # fmt: skip
        return False

    def _route(self, msg: Any, m: dict[str, Any]) -> tuple[str, tuple[Load, int] | None]:
        """The host a message goes to ("writer", "owner", or "" when none claims it) and,
        for the owner, the load and writer it is from."""
        kind = m["k"]
        if kind == wire.PLAN:
            return "writer", None
        found = self.owner.load_from(msg, m)
        if found is not None:  # a writer's message to us as its owner
            return "owner", found
        if kind == wire.ABORT and self.sends:  # an owner's abort of one of our sends
            return "writer", None
        if kind == wire.ABORT:  # a writer's, late (its load ended here) or of another incarnation
            self.stats.count("stale_messages")
        return "", None

    def _act_on(
        self, msg: Any, m: dict[str, Any], side: str, found: tuple[Load, int] | None
    ) -> None:
        kind = m["k"]
        if side == "writer":
            if kind == wire.PLAN:
                self.writer.on_plan(msg, m)
            else:
                self.writer.on_owner_abort(msg, m)
        elif side == "owner" and found is not None:
            o, w = found
            if kind == wire.ABORT:
                self.owner.on_writer_abort(o, w, m)
            elif kind == wire.NOTICE_PART:
                self.owner.on_notice_part(o, w, m)
            elif kind == wire.NOTICE:
                self.owner.on_notice(o, w, m)
            elif kind == wire.ABORT_ACK:
                self.owner.on_ack(o, w)

    def shutdown(self) -> None:
        if self.writer.staging is not None:
            self.writer.staging.close()
        try:
            self.engine.shutdown()
        except Exception:  # pragma: no cover
            log.exception("kvferry: engine shutdown")
