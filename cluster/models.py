"""Builds the model and the pool shape every rank of a cluster agrees on."""

from __future__ import annotations

import dataclasses

from kvferry.engine.models import LlamaConfig, LlamaModel, PagedModel, ReplayConfig, ReplayModel
from kvferry.engine.monolithic import MonolithicEngine
from kvferry.engine.pool import KVPool, PoolConfig, parse_dtype
from kvferry.engine.replay import PREFILL_CHUNK_TOKENS
from kvferry.engine.reshard import Order

from .config import ServeConfig


def build_model(cfg: ServeConfig, kv_heads: int | None = None) -> PagedModel:
    """The same weights on every rank: the replay model is hand-built, the Llama-style
    model is seeded, so prefill and decode ranks compute consistent KV. ``kv_heads``: the
    heads a member of a decode group holds (default all of ``cfg.kv_heads``): the replay
    model is built for those (each head answers alone, the router combines); the llama
    model is built whole (its decode group steps together: cluster.group_decode) and the
    pool holds the member's heads (:func:`pool_config`)."""
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


def pool_config(
    cfg: ServeConfig, model: PagedModel, *, prefill: bool = False, kv_heads: int | None = None
) -> PoolConfig:
    """The pool of a decode rank, or of a prefill rank (``prefill``: its own page size,
    ``--prefill-page-size``, when given); ``kv_heads``: the heads it holds (default the
    model's)."""
    page_size = (cfg.prefill_page_size or cfg.page_size) if prefill else cfg.page_size
    layout = (cfg.prefill_kv_layout or cfg.kv_layout) if prefill else cfg.kv_layout
    pages = max(1, cfg.pool_tokens // page_size)
    config = model.pool_config(page_size, pages, dtype=parse_dtype(cfg.dtype))
    return dataclasses.replace(config, order=Order(layout), kv_heads=kv_heads or config.kv_heads)


def monolithic_engine(cfg: ServeConfig) -> MonolithicEngine:
    """The oracle a cluster served with ``cfg`` must match bit for bit: the monolithic
    engine over the same model, one pool of every head, the same context length."""
    model = build_model(cfg)
    return MonolithicEngine(
        model, KVPool(pool_config(cfg, model)), context_length=cfg.context_length
    )
