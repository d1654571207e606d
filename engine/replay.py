"""The replay model: hand-built, deterministic weights whose answer is its own prompt.

Keys encode positions, values encode tokens, and decode step ``t`` queries position ``t``
of the context through :func:`paged_decode_attention` (softmax and all), so a request with
``max_tokens == len(prompt)`` answers with its prompt, and longer answers cycle through it
again (position ``L + i`` holds the token emitted at step ``i``, which is ``prompt[i]``).
Any page decode reads that this request did not write shows up as foreign text.

Codes. The key of position ``p`` is the sign code of its binary digits: dimension ``i``
holds ``+1`` if bit ``i`` of ``p`` is set, else ``-1`` (dimensions past the position bits
are 0). The query for target ``t`` is the code of ``t``, and attention runs with a scale
``s``. Then ``q . k_p = nbits - 2 * hamming(t, p)``: the target scores ``s * nbits`` and
every other position at least ``2s`` less, exactly, in any pool dtype (the entries are
+-1, 0, exact in bf16/fp16/fp32, and the sums are small integers in fp32). With ``N``
positions the softmax weight left for all wrong positions is below ``N * exp(-2s)``; the
model picks ``s = (ln(max_positions) + 24) / 2`` so that weight stays below ``e^-24``
(about 4e-11) for every context up to ``max_positions`` (default 2^20; a 64k context needs
16 position bits and a scale of about 17.5). Separability therefore does not erode with
length: it is a fixed margin in the logits, not a resolution of angles.

Values hold the 9 bits of the token id as +-1 in their first dimensions. The output's
signs give the token back; every layer and query head must agree, and any disagreement or
ambiguous sign (|x| < 0.5) gives the special ``CONFLICT`` token, so a page whose heads
were partly overwritten is visible too.

Decode needs only the pages, the prompt length, and the input token at its position (see
:mod:`.models`).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from .attention import write_kv_pages, write_kv_tokens
from .kernels import paged_decode_attention  # Triton on CUDA tensors, the torch reference elsewhere
from .kernels.ownership import PageOwnership
from .pool import PoolConfig, check_pool_shape
from .stepwise import PrefillByLayers, chunk_bounds, kv_token_bytes
from .tokenizer import CONFLICT, TOKEN_BITS, VOCAB_SIZE

PREFILL_CHUNK_TOKENS = 1 << 16  # tokens a prefill step writes (a long prompt yields between)


@dataclass(frozen=True)
class ReplayConfig:
    layers: int = 1
    kv_heads: int = 1
    q_per_kv: int = 1
    head_dim: int = 32
    max_positions: int = 1 << 20
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS  # a long prompt yields between them

    @property
    def position_bits(self) -> int:
        return max(1, (self.max_positions - 1).bit_length())


def sign_code(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``[n, dim]`` fp32: +1/-1 for each of the low ``bits`` bits of ``values``, 0 after."""
    values = values.to(torch.int64)
    shifts = torch.arange(bits, device=values.device)
    bit = (values[:, None] >> shifts) & 1
    code = torch.zeros(values.numel(), dim, dtype=torch.float32, device=values.device)
    code[:, :bits] = bit.float() * 2 - 1
    return code


def vote(bits: torch.Tensor) -> torch.Tensor:
    """The token each sequence's attention outputs read as: ``bits`` ``[layers, batch,
    heads, TOKEN_BITS]`` (the outputs' token dimensions) -> ``[batch]`` int64. Every layer
    and head must agree and every sign be clear (``|x| >= 0.5``), or the token is
    ``CONFLICT``: a page whose heads or layers were partly overwritten shows."""
    weights = 1 << torch.arange(TOKEN_BITS, device=bits.device)
    per_head = ((bits > 0).long() * weights).sum(-1)  # [layers, B, qh]
    first = per_head[0, :, 0]
    agree = (per_head == first[None, :, None]).all(dim=2).all(dim=0)
    clear = (bits.abs() >= 0.5).all(dim=-1).all(dim=-1).all(dim=0)
    ok = agree & clear & (first < VOCAB_SIZE)
    return torch.where(ok, first, torch.full_like(first, CONFLICT))


class FirstRead:
    """One query's softmax attention over keys and values that come a chunk at a time
    (the running maximum, weight and weighted sum of an online softmax), fp32: how the
    prefill reads its first answer token while it writes the prompt's K/V, without a
    second pass over the pages. ``query`` ``[d]``; ``add`` takes ``[n, d]`` keys and
    values. The running figures stay on the keys' device (no host sync a chunk)."""

    def __init__(self, query: torch.Tensor, scale: float) -> None:
        self.query = query.float()
        self.scale = scale
        self.top: torch.Tensor | None = None  # the largest score so far (None: no key yet)
        self.weight: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not keys.shape[0]:
            return
        scores = (keys.float() @ self.query.to(keys.device)) * self.scale  # [n]
        top = scores.max() if self.top is None else torch.maximum(self.top, scores.max())
        p = torch.exp(scores - top)
        weight, acc = p.sum(), p @ values.float()
        if self.top is not None and self.weight is not None and self.acc is not None:
            carry = torch.exp(self.top - top)
            weight, acc = self.weight * carry + weight, self.acc * carry + acc
        self.top, self.weight, self.acc = top, weight, acc

    def token(self) -> int:
        """The token the attention's output reads as (``CONFLICT`` when nothing was
        added or a sign is not clear)."""
        if self.weight is None or self.acc is None:
            return CONFLICT
        out = self.acc / self.weight
        return int(vote(out[None, None, None, :TOKEN_BITS])[0])


class ReplayModel(PrefillByLayers):
    stop_token: int | None = None
    attention_mixes_heads = False  # each head answers alone: a split decode needs no combine

    def __init__(self, config: ReplayConfig = ReplayConfig()) -> None:
        if config.head_dim < max(config.position_bits, TOKEN_BITS):
            raise ValueError(
                f"head_dim {config.head_dim} cannot hold {config.position_bits} position bits "
                f"and {TOKEN_BITS} token bits"
            )
        self.config = config
        self.layers = config.layers
        self.prefill_chunk_tokens: int | None = config.prefill_chunk_tokens
        self.kv_heads = config.kv_heads
        self.q_heads = config.kv_heads * config.q_per_kv
        self.head_dim = config.head_dim
        self.scale = (math.log(config.max_positions) + 24.0) / 2.0

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

    # --- codes ----------------------------------------------------------------------
    def key_codes(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.numel() and int(positions.max()) >= self.config.max_positions:
            raise ValueError(
                f"position {int(positions.max())} beyond max_positions {self.config.max_positions}"
            )
        return sign_code(positions, self.config.position_bits, self.head_dim)

    def value_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        return sign_code(tokens, TOKEN_BITS, self.head_dim)

    def _check_pool(self, kv: torch.Tensor) -> None:
        check_pool_shape(kv, self.layers, self.kv_heads, self.head_dim)

    # --- prefill ----------------------------------------------------------------------
    def prefill_layers(
        self,
        kv: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        page_row: Sequence[int] | torch.Tensor,
        *,
        head_range: tuple[int, int] | None = None,
    ) -> Generator[int | None, None, int]:
        """Write K/V of ``tokens`` into the pages of ``page_row``, for KV heads
        ``head_range`` (default all), in pieces of up to ``prefill_chunk_tokens`` tokens
        (:func:`chunk_bounds`), each piece through every layer before the next, as an
        engine's chunked prefill runs: a piece's pages are final once its last layer is
        written, while later pieces compute. Yields after each layer of each piece: None
        in every piece but the last, then each layer's index as the last piece is written
        in it (the layer is whole). Returns the first answer token: the query of target 0
        attended over the prompt's K/V as they are written (:class:`FirstRead`), what
        decode's first step would read from the pages. ``prefill`` (same arguments)
        writes them all."""
        self._check_pool(kv)
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=kv.device).reshape(-1)
        lo, hi = head_range or (0, self.kv_heads)
        row = torch.as_tensor(page_row, dtype=torch.int64, device=kv.device)
        n = tokens.numel()
        pieces = chunk_bounds(n, self.prefill_chunk_tokens or max(n, 1), kv_token_bytes(kv))
        # every layer and head holds the same codes here: one read covers them all
        first_read = FirstRead(self.key_codes(torch.zeros(1, dtype=torch.int64))[0], self.scale)
        for first, last in pieces:
            positions = torch.arange(first, last, device=kv.device)
            for layer in range(self.layers):
                # each layer computes its own K/V, as a model's layers do (the codes are
                # the same in every layer: the cost stands for a layer's compute)
                keys, values = self.key_codes(positions), self.value_codes(tokens[first:last])
                if layer == 0:
                    first_read.add(keys, values)
                k = keys[:, None, :].expand(-1, hi - lo, -1)
                v = values[:, None, :].expand(-1, hi - lo, -1)
                write_kv_pages(kv, layer, k, v, row, first, head_lo=lo)
                yield layer if last == n else None
        return first_read.token()

    # --- decode -----------------------------------------------------------------------
    def read_positions(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        targets: torch.Tensor,
        ownership: PageOwnership | None = None,
    ) -> torch.Tensor:
        """Token stored at ``targets[b]`` of each sequence, read by attention alone: ``[batch]``.
        With ``ownership`` every page read is checked (the kernel's flags, see
        :func:`paged_decode_attention`), in the first layer's attention: every layer reads
        the same pages through the same table, and canaries change only between steps."""
        self._check_pool(kv)
        q = (
            self.key_codes(targets.to(kv.device))[:, None, :]
            .expand(-1, self.q_heads, -1)
            .contiguous()
        )
        votes = []
        for layer in range(self.layers):
            out = paged_decode_attention(
                q,
                kv,
                layer,
                page_table,
                seq_lens,
                scale=self.scale,
                ownership=ownership if layer == 0 else None,
            )  # [B, qh, d]
            votes.append(out[..., :TOKEN_BITS])
        return vote(torch.stack(votes))

    def decode_step(
        self,
        kv: torch.Tensor,
        page_table: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        prompt_lens: torch.Tensor,
        ownership: PageOwnership | None = None,
    ) -> torch.Tensor:
        """Write each input token's K/V at its position, then emit the token stored at
        ``position - (prompt_len - 1)``. Returns ``[batch]`` int64 on kv's device. With
        ``ownership`` the attention checks every page it reads against it (in the kernel
        on CUDA): the caller reads the flags after the step and drops flagged tokens."""
        self._check_pool(kv)
        device = kv.device
        positions = positions.to(device=device, dtype=torch.int64)
        tokens = tokens.to(device=device, dtype=torch.int64)
        table = page_table.to(device)
        page_size = kv.shape[4]
        pages = table.gather(1, (positions // page_size)[:, None]).squeeze(1)
        slots = positions % page_size
        k = self.key_codes(positions)[:, None, :].expand(-1, self.kv_heads, -1)
        v = self.value_codes(tokens)[:, None, :].expand(-1, self.kv_heads, -1)
        for layer in range(self.layers):
            write_kv_tokens(kv, layer, k, v, pages, slots)
        targets = positions - (prompt_lens.to(device=device, dtype=torch.int64) - 1)
        return self.read_positions(
            kv, table, (positions + 1).to(torch.int32), targets, ownership=ownership
        )
