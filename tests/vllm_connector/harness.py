"""vLLM's real Scheduler with the kvferry connector loaded by module path, its worker side
driven the way the model runner drives it, on CPU KV tensors in vLLM's own layouts.

One :class:`Side` is one vLLM engine: a Scheduler (its SCHEDULER connector) and ``tp``
WORKER connectors, each with its own KV buffers made by vLLM's ``create_kv_cache_views``,
in the side's own block size and KV layout; the model's 4 KV heads are split over ``tp``
as vLLM splits them (replicated when ``tp`` exceeds them). :meth:`Side.step` is one
engine step: schedule, the "model runner" (each K|V row, one layer's head at one token,
from a seed per request: :func:`rows`, so that any two shapes compare row by row), each
worker's connector calls in the model runner's order, vLLM's ``KVOutputAggregator``,
``update_from_output``. The prefill runs in another
process (:func:`prefill_main`), so pages move by real kvferry transfers between processes.
"""

from __future__ import annotations

import json
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvferry.cluster.vllm.layout import KVRegions

BLOCK = 16
LAYERS = 2
KV_HEADS = 4  # the model's, over the TP workers
HEAD = 32
ROW_BYTES = 2 * HEAD * 2  # one K|V row in fp16
EOS = 999
MODULE = "kvferry.cluster.vllm.connector"
_hash_ready = False


def model_dir(root: Path, kv_heads: int = KV_HEADS) -> str:
    d = root / ("tiny-llama" if kv_heads == KV_HEADS else f"tiny-llama-kv{kv_heads}")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": kv_heads,
                "num_hidden_layers": LAYERS,
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
                "eos_token_id": EOS,
            }
        )
    )
    return str(d)


def vllm_config(
    model: str,
    role: str,
    engine_id: str,
    extra: dict[str, Any],
    tp: int,
    module: str = MODULE,
    connector: str = "KvferryConnector",
    block: int = BLOCK,
) -> VllmConfig:
    mc = ModelConfig(model=model, dtype="float16", seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=block, gpu_memory_utilization=0.5, enable_prefix_caching=False)
    cc.kv_cache_layout = "LBNHC"
    ktc = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module,
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
        kv_load_failure_policy="fail",
    )
    cfg = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    cfg.parallel_config.tensor_parallel_size = tp
    return cfg


def heads_per_worker(tp: int, kv_heads: int = KV_HEADS) -> int:
    return max(1, kv_heads // tp)


def heads_of(tp: int, rank: int, kv_heads: int = KV_HEADS) -> tuple[int, int]:
    """The model's KV heads ``[lo, hi)`` TP worker ``rank`` holds, as vLLM splits them
    (more workers than heads: consecutive workers hold one head each, replicated)."""
    n = heads_per_worker(tp, kv_heads)
    lo = rank * n if tp <= kv_heads else rank * kv_heads // tp
    return lo, lo + n


def kv_cache_config(
    num_blocks: int, tp: int = 2, block: int = BLOCK, kv_heads: int = KV_HEADS
) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block,
        num_kv_heads=heads_per_worker(tp, kv_heads),
        head_size=HEAD,
        dtype=torch.float16,
    )
    names = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def kv_caches(kcc: KVCacheConfig, layout: str) -> dict[str, torch.Tensor]:
    """The layers' views, as vLLM's model runner makes them: one raw buffer, one 4-D view
    per layer, strides from the layout (layer-outermost, or cross-layer BL*)."""
    group = kcc.kv_cache_groups[0]
    spec, names, n = group.kv_cache_spec, group.layer_names, kcc.num_blocks
    lay = KVCacheLayout[layout]
    page = spec.page_size_bytes
    if lay.is_layer_compact:
        stride_l, stride_b = page * n, page
    else:
        stride_l, stride_b = page, page * len(names)
    t = KVCacheTensor(
        size=page * n * len(names), layers=list(names), layer_stride=stride_l, block_stride=stride_b
    )
    raw = torch.zeros(t.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, n, lay, t)
    return dict(zip(names, views, strict=True))


def request(
    rid: str,
    prompt_len: int,
    params: dict[str, Any] | None,
    max_tokens: int,
    block: int = BLOCK,
    prompt_of: str | None = None,
) -> Request:
    """A request of ``prompt_len`` tokens: the prompt of request ``prompt_of`` (default
    ``rid``; a decode request names its prefill's, whose ticket binds that prompt)."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    seed = sum(map(ord, prompt_of or rid))
    req = Request(
        request_id=rid,
        prompt_token_ids=[(seed * 7 + i) % 900 + 1 for i in range(prompt_len)],
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block, sha256),
    )
    req.kv_transfer_params = params
    return req


ROWS_TOKENS = 1024  # the longest request the cases make, in tokens


def rows(marker: str, tokens: int) -> torch.Tensor:
    """What the prefill's "model" writes for a request: ``[layers, KV_HEADS, tokens,
    ROW_BYTES]`` uint8, its own bytes for every row of the model, whatever the shape (a
    token's rows do not depend on ``tokens``; a model of fewer heads uses the first)."""
    if tokens > ROWS_TOKENS:
        raise ValueError(f"{tokens} tokens: the cases make at most {ROWS_TOKENS}")
    g = torch.Generator().manual_seed(zlib.crc32(marker.encode()))
    full = torch.randint(
        0, 256, (LAYERS, KV_HEADS, ROWS_TOKENS, ROW_BYTES), generator=g, dtype=torch.uint8
    )
    return full[:, :, :tokens]


def _row_index(view: torch.Tensor, blocks: list[int], block: int, tokens: int):
    """(kernel block, slot) of each token ``0 .. tokens-1`` of a request's blocks."""
    kt = view.shape[2]
    ratio = block // kt
    t = torch.arange(tokens)
    kernel = torch.tensor(blocks, dtype=torch.int64)[t // block] * ratio + (t % block) // kt
    return kernel, t % kt


class Side:
    """One vLLM engine: the real Scheduler and ``tp`` worker connectors."""

    def __init__(
        self,
        model: str,
        role: str,
        engine_id: str,
        extra: dict[str, Any],
        *,
        tp: int = 2,
        num_blocks: int = 64,
        layout: str = "LBNHC",
        module: str = MODULE,
        connector: str = "KvferryConnector",
        block: int = BLOCK,
    ) -> None:
        self.tp, self.block = tp, block
        self.cfg = vllm_config(model, role, engine_id, extra, tp, module, connector, block)
        self.cfg.cache_config.kv_cache_layout = layout
        self.kv_heads = int(self.cfg.model_config.get_total_num_kv_heads())
        self.kcc = kv_cache_config(num_blocks, tp, block, self.kv_heads)
        self.cfg.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(
            vllm_config=self.cfg,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(self.cfg),
            block_size=block,
            log_stats=True,
        )
        self.workers = []
        self.regions: list[KVRegions] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            self.cfg.parallel_config.rank = rank
            w = KVConnectorFactory.create_connector(self.cfg, KVConnectorRole.WORKER, self.kcc)
            caches = kv_caches(self.kcc, layout)
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.caches.append(caches)
            self.regions.append(KVRegions.from_kv_caches(caches, num_blocks, layout))
        self.cfg.parallel_config.rank = 0
        self.sched.connector.set_xfer_handshake_metadata(
            {w._worker.tp_rank: w.get_handshake_metadata() for w in self.workers}
        )
        self.agg = KVOutputAggregator(tp)
        self.outputs: dict[str, Any] = {}  # rid -> its last EngineCoreOutput
        self.scheduled: dict[str, int] = {}  # rid -> tokens scheduled so far
        self.first_read: dict[str, list[torch.Tensor]] = {}  # bytes when first scheduled
        self.on_first_schedule = None

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def blocks_of(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def write_rows(self, blocks: list[int], data: torch.Tensor) -> None:
        """``data`` (:func:`rows`) into ``blocks``: each worker its own heads."""
        tokens = data.shape[2]
        for rank, caches in enumerate(self.caches):
            lo, hi = heads_of(self.tp, rank, self.kv_heads)
            for layer, view in enumerate(caches.values()):
                kernel, slot = _row_index(view, blocks, self.block, tokens)
                raw = view.view(torch.uint8)
                raw[kernel, :, slot, :] = data[layer, lo:hi].permute(1, 0, 2)

    def read_rows(self, blocks: list[int], tokens: int) -> list[torch.Tensor]:
        """Per worker ``[layers, its heads, tokens, ROW_BYTES]``: what its blocks hold."""
        out = []
        for caches in self.caches:
            per_layer = []
            for view in caches.values():
                kernel, slot = _row_index(view, blocks, self.block, tokens)
                per_layer.append(view.view(torch.uint8)[kernel, :, slot, :].permute(1, 0, 2))
            out.append(torch.stack(per_layer).clone())
        return out

    def step(self, fill: bool = False) -> None:
        so = self.sched.schedule()
        for rid, n in so.num_scheduled_tokens.items():
            first = rid not in self.scheduled
            self.scheduled[rid] = self.scheduled.get(rid, 0) + n
            if first and fill:  # the prefill's "model": this request's own bytes
                blocks = self.blocks_of(rid)
                self.write_rows(blocks, rows(rid, len(blocks) * self.block))
            if first and not fill:  # the decode's first read of the loaded blocks
                req = self.sched.requests[rid]
                tokens = len(req.prompt_token_ids)
                self.first_read[rid] = self.read_rows(self.blocks_of(rid), tokens)
        outs = []
        for w in self.workers:
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
            w.wait_for_save()
            r = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=r.finished_sending or None,
                finished_recving=r.finished_recving or None,
                failed_recving=r.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
            )
            w.clear_connector_metadata()
            ids = list(so.num_scheduled_tokens)
            outs.append(
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[7] for _ in ids],
                    kv_connector_output=kvo,
                )
            )
        out = self.agg.aggregate(outs)
        eco = self.sched.update_from_output(so, out)
        for batch in eco.values():
            for o in batch.outputs:
                self.outputs[o.request_id] = o

    def status(self, rid: str) -> RequestStatus | None:
        req = self.sched.requests.get(rid)
        return None if req is None else req.status

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched.connector.shutdown()


# ---------------------------------------------------------------------- the prefill process
def prefill_main(
    conn: Any,
    model: str,
    extra: dict[str, Any],
    tp: int,
    num_blocks: int,
    layout: str,
    module: str = MODULE,
    block: int = BLOCK,
) -> None:
    """A prefill engine in its own process, commanded over ``conn``."""
    side = Side(
        model,
        "kv_producer",
        "prefill",
        extra,
        tp=tp,
        num_blocks=num_blocks,
        layout=layout,
        module=module,
        block=block,
    )
    running, kill_at, pause_at = True, None, None
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll(0 if running else 0.01):
            cmd, *args = conn.recv()
            if cmd == "prefill":
                rid, n = args
                side.sched.add_request(request(rid, n, {"do_remote_decode": True}, 1, side.block))
                while rid not in side.outputs or side.outputs[rid].finish_reason is None:
                    side.step(fill=True)
                side.step(fill=True)  # hands the request to the workers (checksums)
                conn.send(side.outputs[rid].kv_transfer_params)
            elif cmd == "run":
                running = args[0]
                conn.send(True)
            elif cmd == "corrupt":  # flip bytes of a request's source blocks, after checksums
                rid = args[0]
                for w, reg in zip(side.workers, side.regions, strict=True):
                    src = w._worker.writer.prompts[rid].src
                    data = reg.block_bytes_of(src)
                    data[:, 5] ^= 0xFF
                    reg.write_block_bytes(src, data)
                conn.send(True)
            elif cmd == "corrupt_in_flight":  # flip source bytes once a job's writes are
                rid = args[0]  # checksummed (after its plan), before they are posted
                for w, reg in zip(side.workers, side.regions, strict=True):
                    _corrupt_when_planned(w._worker.writer, reg, rid)
                conn.send(True)
            elif cmd == "hold_worker":  # one TP worker stops polling its transfer engine
                w = side.workers[args[0]]._worker
                w.held_poll, w.poll = w.poll, lambda: None
                conn.send(True)
            elif cmd == "release_worker":
                w = side.workers[args[0]]._worker
                w.poll = w.held_poll
                conn.send(True)
            elif cmd == "kill_after_batches":
                kill_at = args
                conn.send(True)
            elif cmd == "pause_after_batches":  # hold still once a job posted this many
                pause_at = args
                conn.send(True)
            elif cmd == "status":
                holding = sorted(side.sched.connector._sched.holding)
                channel = side.sched.connector._sched.side
                refused = sum(channel.refusals.values()) if channel is not None else 0
                conn.send(
                    {
                        "free": side.free_blocks(),
                        "holding": holding,
                        "refused": refused,
                        "running": running,
                        "jobs": _jobs(side),
                    }
                )
            elif cmd == "exit":
                side.shutdown()
                conn.send(True)
                return
        if running:
            side.step(fill=True)
            if kill_at is not None:
                rid, k = kill_at
                if any(j.batches_posted >= k for j in _jobs_of(side, rid)):
                    os.kill(os.getpid(), signal.SIGKILL)
            if pause_at is not None:
                rid, k = pause_at
                if any(j.batches_posted >= k for j in _jobs_of(side, rid)):
                    running, pause_at = False, None
            time.sleep(0.0005)


def _corrupt_when_planned(writer: Any, regions: KVRegions, rid: str) -> None:
    """Once a job of ``rid`` at this writer has the checksums of the part it is about to
    post (whole blocks: those of vLLM's hand-over; rows: the part's regions, taken and
    its source checked as it is posted), flip a byte of every source block, once per
    request: what it posts then differs from what it checksummed, as a write torn in
    flight would."""
    original = writer._sum_part
    flipped: set[str] = set()

    def summed(job: Any, part: Any) -> bool:
        ok = original(job, part)
        if ok and job.request == rid and job.prompt.src is not None and rid not in flipped:
            flipped.add(rid)
            data = regions.block_bytes_of(job.prompt.src)
            data[:, 5] ^= 0xFF
            regions.write_block_bytes(job.prompt.src, data)
        return bool(ok)

    writer._sum_part = summed


def _jobs_of(side: Side, rid: str) -> list[Any]:
    """The writer's live jobs of request ``rid`` (one per decode worker it writes into),
    over every worker."""
    return [j for w in side.workers for j in w._worker.writer.jobs.values() if j.request == rid]


def _jobs(side: Side) -> dict[str, list[list[Any]]]:
    """Each worker's live jobs: rid -> [state, batches in flight, batches queued] per
    job."""
    out: dict[str, list[list[Any]]] = {}
    for w in side.workers:
        for job in w._worker.writer.jobs.values():
            out.setdefault(job.request, []).append(
                [job.book.state.value, job.book.in_flight, len(job.queue)]
            )
    return out
