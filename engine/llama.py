"""A small Llama-style model with random weights, for realistic shapes and timing.

Pre-norm decoder: RMSNorm, attention with rotary embeddings and grouped-query heads
(``q_heads`` a multiple of ``kv_heads``), SwiGLU MLP, tied nothing, greedy decoding.
Weights are drawn from a seeded generator, so every process builds the same model.

Prefill runs dense causal attention over the prompt and writes each layer's K/V into pool
pages (only the KV heads of ``head_range`` for a tensor-parallel shard; the K/V it attends
over are rounded to the pool dtype first, so prefill sees what decode will read). Decode
reads K/V only through the page table. The prefill returns the first answer token (the
last position's logits); decode needs the pages, the prompt length and that token (see
:mod:`.models`).

Tolerance: decode over fp32 pages matches :meth:`LlamaModel.forward_dense` (no pages)
within 1e-4 absolute on the logits (tests check this); with bf16 pages, within 5e-2. Two
runs over bit-identical pages with the same batch give bit-identical logits on one device.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from .attention import write_kv_pages
from .headgroup import LayerQuery, attend_held
from .kernels.ownership import PageOwnership
from .pool import PoolConfig, check_pool_shape
from .stepwise import PrefillByLayers, run_to_end
from .tokenizer import EOS, VOCAB_SIZE


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = VOCAB_SIZE
    hidden: int = 128
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class LlamaModel(PrefillByLayers):
    stop_token: int | None = EOS
    attention_mixes_heads = True  # a layer's output reads every head: a split decode combines

    def __init__(
        self,
        config: LlamaConfig = LlamaConfig(),
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.layers = config.layers
        self.prefill_chunk_tokens: int | None = None  # a layer is written whole
        self.kv_heads = config.kv_heads
        self.q_heads = config.q_heads
        self.head_dim = config.head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)
            return w.to(device=self.device, dtype=dtype)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(c.hidden, generator=gen)).to(
                device=self.device, dtype=dtype
            )

        self.embed = torch.randn(c.vocab_size, c.hidden, generator=gen).to(
            device=self.device, dtype=dtype
        )
        self.blocks = [
            _Layer(
                attn_norm=norm(),
                wq=weight(c.hidden, c.q_heads * c.head_dim),
                wk=weight(c.hidden, c.kv_heads * c.head_dim),
                wv=weight(c.hidden, c.kv_heads * c.head_dim),
                wo=weight(c.q_heads * c.head_dim, c.hidden),
                mlp_norm=norm(),
                w_gate=weight(c.hidden, c.intermediate),
                w_up=weight(c.hidden, c.intermediate),
                w_down=weight(c.intermediate, c.hidden),
            )
            for _ in range(c.layers)
        ]
        self.final_norm = norm()
        self.lm_head = weight(c.hidden, c.vocab_size)
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(half, dtype=torch.float32, device=self.device) / half)
        )

    def pool_config(
        self,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> PoolConfig:
        return PoolConfig(
            self.layers, self.kv_heads, self.head_dim, page_size, num_pages, dtype, device
        )

    # --- pieces -----------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)).to(
            x.dtype
        ) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: ``[T, heads, head_dim]``, positions ``[T]``; rotate halves."""
        angles = (
            positions.to(self.device, torch.float32)[:, None] * self._inv_freq[None, :]
        )  # [T, half]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def _qkv(
        self, block: _Layer, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        x = self._rms(h, block.attn_norm)
        q = (x @ block.wq).view(-1, c.q_heads, c.head_dim)
        k = (x @ block.wk).view(-1, c.kv_heads, c.head_dim)
        v = (x @ block.wv).view(-1, c.kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _mlp(self, block: _Layer, h: torch.Tensor) -> torch.Tensor:
        x = self._rms(h, block.mlp_norm)
        return (torch.nn.functional.silu(x @ block.w_gate) * (x @ block.w_up)) @ block.w_down

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return (self._rms(h, self.final_norm) @ self.lm_head).float()

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, qh, d]``, k/v ``[T, kvh, d]`` -> ``[T, qh*d]`` (fp32 accumulation)."""
        group = self.q_heads // self.kv_heads
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), kf, vf, is_causal=True, scale=1.0 / math.sqrt(self.head_dim)
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1).to(self.dtype)

    # --- reference without pages -----------------------------------------------------------
    def forward_dense(
        self, tokens: Sequence[int] | torch.Tensor, kv_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` (fp32) of every position, no pages involved. ``kv_dtype``
        rounds K/V as a pool of that dtype would."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device).reshape(-1)
        positions = torch.arange(tokens.numel(), device=self.device)
        h = self.embed[tokens]
        for block in self.blocks:
            q, k, v = self._qkv(block, h, positions)
            if kv_dtype is not None:
                k, v = k.to(kv_dtype).to(self.dtype), v.to(kv_dtype).to(self.dtype)
            h = h + self._causal(q, k, v) @ block.wo
            h = h + self._mlp(block, h)
        return self._logits(h)

    # --- paged ------------------------------------------------------------------------
    def _check_pool(self, kv: torch.Tensor) -> None:
        check_pool_shape(kv, self.layers, self.kv_heads, self.head_dim)

    def prefill_layers(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> Generator[int, None, int]:
        """Write the prompt's K/V (heads ``head_range``) into pages one layer at a time:
        yields each layer's index once its K/V is in the pages, returns the first answer
        token (greedy, from the last position's logits, which every shard computes whole).
        A caller that stops early (an abort) has written the layers yielded so far and
        computed nothing more. ``prefill`` (same arguments) runs them all."""
        logits = yield from self._prefill_layers(kv, tokens, page_row, head_range=head_range)
        return int(logits.argmax())

    def prefill_logits(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``prefill``, returning the last position's logits ``[vocab]`` fp32."""
        logits: torch.Tensor = run_to_end(
            self._prefill_layers(kv, tokens, page_row, head_range=head_range)
        )
        return logits

    def _prefill_layers(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> Generator[int, None, torch.Tensor]:
        self._check_pool(kv)
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device).reshape(-1)
        lo, hi = head_range or (0, self.kv_heads)
        positions = torch.arange(tokens.numel(), device=self.device)
        h = self.embed[tokens]
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, h, positions)
            write_kv_pages(
                kv,
                layer,
                k[:, lo:hi].to(kv.device),
                v[:, lo:hi].to(kv.device),
                page_row,
                0,
                head_lo=lo,
            )
            yield layer
            k, v = k.to(kv.dtype).to(self.dtype), v.to(kv.dtype).to(self.dtype)
            h = h + self._causal(q, k, v) @ block.wo
            h = h + self._mlp(block, h)
        return self._logits(h[-1:])[0]

    def decode_layers(
        self, positions: torch.Tensor, tokens: torch.Tensor
    ) -> Generator[LayerQuery, torch.Tensor, torch.Tensor]:
        """A decode step with each layer's attention left to the caller: yields the
        layer's :class:`~.headgroup.LayerQuery` (every head of the input tokens at
        ``positions`` ``[batch]``) and takes back its attention ``[batch, q_heads,
        head_dim]``; returns the logits ``[batch, vocab]`` fp32. A decode group whose
        members each hold some of the heads answers each layer from all of them
        (:mod:`.headgroup`); :meth:`decode_logits` answers from one pool."""
        positions = positions.to(device=self.device, dtype=torch.int64)
        tokens = tokens.to(device=self.device, dtype=torch.int64)
        h = self.embed[tokens]
        for layer, block in enumerate(self.blocks):
            q, k, v = self._qkv(block, h, positions)
            attn = yield LayerQuery(layer, q, k, v)
            h = h + attn.to(self.device).reshape(h.shape[0], -1) @ block.wo
            h = h + self._mlp(block, h)
        return self._logits(h)

    def decode_logits(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        ownership: PageOwnership | None = None,
    ) -> torch.Tensor:
        """Write each input token's K/V at its position, attend over ``0 .. position``;
        logits ``[batch, vocab]`` fp32. With ``ownership`` every page read is checked, in the
        first layer's attention (every layer reads the same pages through the same table,
        and canaries change only between steps)."""
        self._check_pool(kv)
        step = self.decode_layers(positions, tokens)
        query = next(step)
        while True:
            attn = attend_held(
                kv, query, page_table, positions, ownership if query.layer == 0 else None
            )
            try:
                query = step.send(attn)
            except StopIteration as end:
                logits: torch.Tensor = end.value
                return logits

    def decode_step(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        prompt_lens: torch.Tensor | None = None,
        ownership: PageOwnership | None = None,
    ) -> torch.Tensor:
        """Greedy next token per sequence, ``[batch]`` int64. ``ownership``: as
        :meth:`decode_logits` (flags read by the caller after the step)."""
        return self.decode_logits(kv, page_table, positions, tokens, ownership).argmax(dim=-1)
