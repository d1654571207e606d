"""Page addresses from vLLM's KV tensors: which byte runs of which buffer hold a block.

vLLM 0.33 hands the connector one 4-D view ``[blocks, kv_heads, tokens, K|V]`` per layer
into a raw buffer whose physical order is a ``KVCacheLayout`` (``LBHNC`` = HND, ``LBNHC`` =
NHD, cross-layer ``BL*`` layouts where several layers share one buffer). Nothing here
assumes a shape or an order: every address comes from the view's ``data_ptr()`` and its
strides, and the views are grouped by the storage they live in, so each underlying buffer
is registered once. A scheduler block may span several kernel blocks (``ratio``).

A block's bytes in one buffer are a list of runs (offset from the buffer's base for
block 0, length) plus a per-block stride; the runs of the layers sharing a buffer are
merged where they touch, so HND, NHD and the cross-layer layouts come out as one run per
layer and block, or one per block. Two ranks can exchange pages when their per-block run
lengths agree (:meth:`KVRegions.signature`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


class LayoutError(ValueError):
    """A KV tensor whose layout this connector cannot address (the message names it)."""


@dataclass
class _Group:
    """Layers of one buffer that share a block stride: block b's runs are
    ``runs[:, 0] + b * stride`` (offsets from the buffer's base)."""

    runs: np.ndarray  # [R, 2] int64: offset for block 0, length
    stride: int


@dataclass
class Buffer:
    """One underlying allocation (a torch storage) holding layers' pages."""

    base: int  # the storage's data_ptr
    nbytes: int
    tensor: torch.Tensor  # uint8 over the whole storage, for registration and checksums
    layers: list[str] = field(default_factory=list)
    groups: list[_Group] = field(default_factory=list)

    def block_runs(self, blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[len(blocks) * runs, 2]`` (offset, length) of the listed blocks, block-major."""
        b = np.asarray(blocks, dtype=np.int64)
        parts = [
            np.stack(
                [
                    (b[:, None] * g.stride + g.runs[None, :, 0]).reshape(len(b), -1),
                    np.broadcast_to(g.runs[None, :, 1], (len(b), len(g.runs))),
                ],
                axis=2,
            )
            for g in self.groups
        ]
        return np.concatenate(parts, axis=1).reshape(-1, 2)

    @property
    def run_lengths(self) -> list[int]:
        return [int(x) for g in self.groups for x in g.runs[:, 1]]

    @property
    def block_bytes(self) -> int:
        return sum(int(g.runs[:, 1].sum()) for g in self.groups)


def _coalesce(runs: np.ndarray) -> np.ndarray:
    """Sort (offset, length) runs and merge those that touch."""
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    out: list[list[int]] = []
    for off, length in runs.tolist():
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += length
        elif out and off < out[-1][0] + out[-1][1]:
            raise LayoutError(f"overlapping runs at byte {off}: a view aliases itself")
        else:
            out.append([off, length])
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _layer_runs(name: str, view: torch.Tensor, ratio: int, layout: str) -> tuple[np.ndarray, int]:
    """Block 0's runs of one layer view (offsets from the view's own block 0) and the
    scheduler block's stride, both in bytes."""
    if view.dim() != 4:
        raise LayoutError(
            f"layer {name}: a {view.dim()}-D KV tensor {tuple(view.shape)} in layout {layout}; "
            "kvferry addresses vLLM 0.33's 4-D [blocks, kv_heads, tokens, K|V] views "
            "(HND, NHD and the cross-layer layouts)"
        )
    if view.device.type != "cpu" and not view.is_cuda:
        raise LayoutError(f"layer {name}: KV on {view.device} (layout {layout}) is not supported")
    es = view.element_size()
    _, heads, tokens, width = view.shape
    s_b, s_h, s_n, s_c = (s * es for s in view.stride())
    if width > 1 and s_c != es:
        raise LayoutError(
            f"layer {name}: layout {layout} stores K|V with stride {s_c} bytes, not "
            f"contiguously ({es}); kvferry needs each (head, token) row contiguous"
        )
    h, n = np.meshgrid(np.arange(heads), np.arange(tokens), indexing="ij")
    offs = (h * s_h + n * s_n).reshape(-1).astype(np.int64)
    kernel = np.stack([offs, np.full_like(offs, width * es)], axis=1)
    runs = np.concatenate([kernel + [j * s_b, 0] for j in range(ratio)], axis=0)
    return _coalesce(runs), s_b * ratio


@dataclass(frozen=True)
class LayerRows:
    """Where one layer's rows live: the K|V row of (local head ``h``, token ``t`` of
    scheduler block ``b``) is ``row_bytes`` at byte

        offset + (b * ratio + t // kernel_tokens) * block_stride
               + h * head_stride + (t % kernel_tokens) * token_stride

    of buffer ``buffer`` (its index in :attr:`KVRegions.buffers`). Every vLLM layout is
    one choice of these strides (HND: ``token_stride == row_bytes``; NHD:
    ``head_stride == row_bytes``)."""

    name: str
    buffer: int
    offset: int
    block_stride: int
    head_stride: int
    token_stride: int
    heads: int
    kernel_tokens: int
    ratio: int
    row_bytes: int

    @property
    def block_tokens(self) -> int:
        """Tokens in one scheduler block."""
        return self.kernel_tokens * self.ratio

    def to_wire(self) -> list:
        return [
            self.name,
            self.buffer,
            self.offset,
            self.block_stride,
            self.head_stride,
            self.token_stride,
            self.heads,
            self.kernel_tokens,
            self.ratio,
            self.row_bytes,
        ]

    @classmethod
    def from_wire(cls, w: Sequence[Any]) -> LayerRows:
        name, *numbers = w
        return cls(str(name), *(int(x) for x in numbers))


def _layer_rows(name: str, view: torch.Tensor, ratio: int, base: int) -> LayerRows:
    """The row geometry of one 4-D ``[kernel blocks, heads, tokens, K|V]`` view (checked
    by :func:`_layer_runs`); ``buffer`` is filled in once the buffers are ordered."""
    es = view.element_size()
    _, heads, tokens, width = view.shape
    s_b, s_h, s_n, _ = (s * es for s in view.stride())
    return LayerRows(
        name, -1, view.data_ptr() - base, s_b, s_h, s_n, heads, tokens, ratio, width * es
    )


@dataclass
class KVRegions:
    """Where every scheduler block lives, per underlying buffer; ``layers``: where each
    (head, token) row of each layer lives, for reshaping between unlike engines."""

    layout: str
    num_blocks: int
    buffers: list[Buffer]
    layers: list[LayerRows] = field(default_factory=list)

    @classmethod
    def from_kv_caches(
        cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, layout: str = "?"
    ) -> KVRegions:
        if not kv_caches:
            raise LayoutError("no KV tensors to register")
        by_storage: dict[int, Buffer] = {}
        rows: list[tuple[int, LayerRows]] = []  # (storage base, geometry) per layer
        for name, view in kv_caches.items():
            storage = view.untyped_storage()
            base = storage.data_ptr()
            if view.shape[0] % num_blocks:
                raise LayoutError(
                    f"layer {name}: {view.shape[0]} kernel blocks are not a multiple of the "
                    f"scheduler's {num_blocks} blocks (layout {layout})"
                )
            ratio = view.shape[0] // num_blocks
            runs, stride = _layer_runs(name, view, ratio, layout)
            rows.append((base, _layer_rows(name, view, ratio, base)))
            runs = runs + [view.data_ptr() - base, 0]
            buf = by_storage.get(base)
            if buf is None:
                flat = torch.empty(0, dtype=torch.uint8, device=view.device)
                flat.set_(storage, 0, (storage.nbytes(),), (1,))
                buf = by_storage[base] = Buffer(base, storage.nbytes(), flat)
            buf.layers.append(name)
            same = [g for g in buf.groups if g.stride == stride]
            if same:
                same[0].runs = _coalesce(np.concatenate([same[0].runs, runs]))
            else:
                buf.groups.append(_Group(runs, stride))
        buffers = sorted(by_storage.values(), key=lambda b: b.layers[0])
        for buf in buffers:
            for g in buf.groups:
                last = (num_blocks - 1) * g.stride + int((g.runs[:, 0] + g.runs[:, 1]).max())
                if int(g.runs[:, 0].min()) < 0 or last > buf.nbytes:
                    raise LayoutError(
                        f"layers {buf.layers}: blocks reach byte {last} of a "
                        f"{buf.nbytes}-byte buffer (layout {layout})"
                    )
        index = {b.base: i for i, b in enumerate(buffers)}
        layers = [replace(r, buffer=index[base]) for base, r in rows]
        return cls(layout, num_blocks, buffers, layers)

    def to_wire(self) -> dict:
        """What a peer needs to address our blocks: per buffer its size and its runs."""
        return {
            "layout": self.layout,
            "num_blocks": self.num_blocks,
            "buffers": [
                {
                    "nbytes": b.nbytes,
                    "groups": [[g.stride, g.runs.reshape(-1).tolist()] for g in b.groups],
                }
                for b in self.buffers
            ],
            "layers": [r.to_wire() for r in self.layers],
        }

    @classmethod
    def from_wire(cls, d: dict) -> KVRegions:
        """A peer's regions (no tensors: for computing remote offsets only)."""
        buffers = []
        for b in d["buffers"]:
            groups = [
                _Group(np.asarray(runs, dtype=np.int64).reshape(-1, 2), int(stride))
                for stride, runs in b["groups"]
            ]
            buffers.append(
                Buffer(0, int(b["nbytes"]), torch.empty(0, dtype=torch.uint8), [], groups)
            )
        layers = [LayerRows.from_wire(w) for w in d.get("layers", ())]
        return cls(str(d["layout"]), int(d["num_blocks"]), buffers, layers)

    def signature(self) -> list[list[int]]:
        """Per buffer, the lengths of one block's runs: equal signatures exchange pages."""
        return [b.run_lengths for b in self.buffers]

    @property
    def block_bytes(self) -> int:
        return sum(b.block_bytes for b in self.buffers)

    def block_bytes_of(self, blocks: Sequence[int]) -> torch.Tensor:
        """``[len(blocks), block_bytes]`` uint8: each block's bytes, every buffer's runs
        (gathered through a byte index: for tests and small loads; checksums read them in
        place, :func:`.reshape.block_checksums`)."""
        if not len(blocks):
            return torch.zeros((0, self.block_bytes), dtype=torch.uint8)
        rows = []
        for buf in self.buffers:
            runs = buf.block_runs(blocks).reshape(len(blocks), -1, 2)
            per = int(runs[0, :, 1].sum()) if len(blocks) else 0
            idx = (
                np.concatenate(
                    [np.arange(o, o + n, dtype=np.int64) for o, n in runs.reshape(-1, 2).tolist()]
                )
                if len(blocks)
                else np.zeros(0, dtype=np.int64)
            )
            rows.append(buf.tensor[torch.from_numpy(idx)].reshape(len(blocks), per))
        return torch.cat(rows, dim=1)

    def write_block_bytes(self, blocks: Sequence[int], data: torch.Tensor) -> None:
        """The inverse of :meth:`block_bytes_of` (the tests' model runner uses it)."""
        col = 0
        for buf in self.buffers:
            runs = buf.block_runs(blocks).reshape(len(blocks), -1, 2)
            per = int(runs[0, :, 1].sum())
            idx = np.concatenate(
                [np.arange(o, o + n, dtype=np.int64) for o, n in runs.reshape(-1, 2).tolist()]
            )
            buf.tensor[torch.from_numpy(idx)] = data[:, col : col + per].reshape(-1)
            col += per

    def triples(
        self, index: int, src_blocks: Sequence[int], dst: KVRegions, dst_blocks: Sequence[int]
    ) -> np.ndarray:
        """``[n, 3]`` int64 (local offset, remote offset, length) moving ``src_blocks`` of
        buffer ``index`` here into ``dst_blocks`` of the same buffer of ``dst``."""
        src = self.buffers[index].block_runs(src_blocks)
        tgt = dst.buffers[index].block_runs(dst_blocks)
        if not np.array_equal(src[:, 1], tgt[:, 1]):
            raise LayoutError(f"buffer {index}: run lengths differ between the two ranks")
        return np.stack([src[:, 0], tgt[:, 0], src[:, 1]], axis=1)
