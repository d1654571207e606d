"""Builds the model and the pool shape every rank of a cluster agrees on."""

from __future__ import annotations

import dataclasses

from kvferry.engine.models import LlamaConfig, LlamaModel, PagedModel, ReplayConfig, ReplayModel
from kvferry.engine.pool import PoolConfig, parse_dtype
from kvferry.engine.replay import PREFILL_CHUNK_TOKENS
from kvferry.engine.reshard import Order

from .config import ServeConfig


def build_model(cfg: ServeConfig, kv_heads: int | None = None) -> PagedModel:
    """The same weights on every rank: the replay model is hand-built, the Llama-style
    model is seeded, so prefill and decode ranks compute consistent KV. ``kv_heads``: the
    heads a member of a decode group holds (default all of ``cfg.kv_heads``); only the
    replay model splits its decode (each head answers alone, the router combines)."""
    if cfg.model != "replay" and cfg.decode_tp > 1 and not cfg.kv_replicated:
        raise ValueError(
            f"--decode-tp {cfg.decode_tp} with --model {cfg.model}: a llama decode step needs "
            "the attention of every KV head at each layer (an all-reduce across the decode "
            "group), which kvferry's decode ranks do not run; use --model replay, "
            "--decode-tp 1, or --kv-replicated (every member holds every head)"
        )
    if cfg.model == "replay":
        return ReplayModel(
            ReplayConfig(
                layers=cfg.layers,
                kv_heads=kv_heads or cfg.kv_heads,
                q_per_kv=max(1, cfg.q_heads // cfg.kv_heads),
                head_dim=cfg.head_dim,
                max_positions=max(2, cfg.context_length),
                prefill_chunk_tokens=cfg.prefill_chunk_tokens or PREFILL_CHUNK_TOKENS,
            )
        )
    if cfg.prefill_chunk_tokens is not None:
        raise ValueError(
            f"--prefill-chunk-tokens {cfg.prefill_chunk_tokens}: the llama model writes each "
            "layer's KV whole, so its prompts go in one part; leave the option out"
        )
    return LlamaModel(
        LlamaConfig(
            layers=cfg.layers, q_heads=cfg.q_heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim
        ),
        dtype=parse_dtype(cfg.dtype),
    )


def pool_config(cfg: ServeConfig, model: PagedModel, *, prefill: bool = False) -> PoolConfig:
    """The pool of a decode rank, or of a prefill rank (``prefill``: its own page size,
    ``--prefill-page-size``, when given)."""
    page_size = (cfg.prefill_page_size or cfg.page_size) if prefill else cfg.page_size
    layout = (cfg.prefill_kv_layout or cfg.kv_layout) if prefill else cfg.kv_layout
    pages = max(1, cfg.pool_tokens // page_size)
    config = model.pool_config(page_size, pages, dtype=parse_dtype(cfg.dtype))
    return dataclasses.replace(config, order=Order(layout))
