"""The paged KV pool: one contiguous tensor per rank.

Layout: ``kv[pages, layers, 2, kv_heads, page_size, head_dim]`` where index 2 of the third
axis is (0 = K, 1 = V). Heads-major inside a page means that a tensor-parallel shard of
heads ``[head_lo, head_hi)`` occupies one contiguous run of bytes per (layer, K/V) in every
page, so a prefill rank that computes only its heads writes whole runs.

A pool may store its pages token-major instead (``PoolConfig.order`` NHD: each page
``[layers, 2, page_size, kv_heads, head_dim]`` in memory, as vLLM's NHD cache is): then
:attr:`KVPool.storage` is that dense tensor and :attr:`KVPool.kv` the same memory viewed
in the order above, so that models and attention index one order whatever the memory holds.
Byte offsets (writes, run checksums) are always offsets into ``storage``.

Upholds I3: :attr:`KVPool.capacity_tokens` is measured from the tensor that was really
allocated (its shape and the bytes its storage holds), never from the configuration, on
CUDA as on the CPU.

On ``cuda`` the pool is one plain allocation: a single ``torch.empty`` of the whole pool,
with the caching allocator's expandable segments switched off around it (they map
memory with the CUDA VMM API, which cuda_ipc cannot export with a legacy IPC handle; UCX
registers the whole allocation a pointer lies in). A pool this size is a segment of its
own in torch's caching allocator (a ``cudaMalloc`` of its rounded size), never shared with
other tensors. :attr:`KVPool.allocation` says what was obtained.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .reshard import Order

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
SUPPORTED_DTYPES = frozenset(DTYPES.values())


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` (or a torch dtype among those) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported KV dtype {name}; use one of {sorted(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {sorted(DTYPES)}") from None


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PoolConfig:
    """What a rank asks for. The pool built from it reports what it really got."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    order: Order = Order.HND  # how a page's axes lie in memory (see the module docstring)

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PoolConfig.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not isinstance(self.order, Order):
            raise ValueError(f"PoolConfig.order must be an Order, got {self.order!r}")

    @classmethod
    def for_tokens(
        cls,
        pool_tokens: int,
        *,
        layers: int = 1,
        kv_heads: int = 1,
        head_dim: int = 8,
        page_size: int = 16,
        dtype: torch.dtype | str = torch.float32,
        device: str = "cpu",
    ) -> PoolConfig:
        """A config with ``pool_tokens // page_size`` pages (whole pages only)."""
        if pool_tokens < page_size:
            raise ValueError(
                f"pool of {pool_tokens} tokens is smaller than one page of {page_size}"
            )
        return cls(
            layers,
            kv_heads,
            head_dim,
            page_size,
            pool_tokens // page_size,
            parse_dtype(dtype),
            device,
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool as models index it: ``[pages, layers, 2, kv_heads, page_size, head_dim]``."""
        return (self.num_pages, self.layers, 2, self.kv_heads, self.page_size, self.head_dim)

    @property
    def storage_shape(self) -> tuple[int, int, int, int, int, int]:
        """The pool as it lies in memory (``shape``, or token-major for NHD)."""
        if self.order is Order.HND:
            return self.shape
        return (self.num_pages, self.layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return _element_size(self.dtype)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV one token occupies across all layers, K and V, all heads."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        return self.token_bytes * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def declared_tokens(self) -> int:
        """What the config asks for; compare with :attr:`KVPool.capacity_tokens`."""
        return self.num_pages * self.page_size


class PoolShapeError(ValueError):
    """A buffer handed to :class:`KVPool` cannot hold the configured pool."""


def check_pool_shape(kv: torch.Tensor, layers: int, kv_heads: int, head_dim: int) -> None:
    """Raise unless the pool tensor ``[pages, layers, 2, kv_heads, page_size, head_dim]``
    has the model's layers, KV heads and head dim."""
    if (kv.shape[1], kv.shape[3], kv.shape[5]) != (layers, kv_heads, head_dim):
        raise ValueError(
            f"pool (layers, kv_heads, head_dim) = {(kv.shape[1], kv.shape[3], kv.shape[5])}, "
            f"model needs {(layers, kv_heads, head_dim)}"
        )


def expandable_segments_requested(settings: str) -> bool:
    """Whether allocator settings (``PYTORCH_ALLOC_CONF`` syntax) turn expandable
    segments on."""
    for item in settings.replace(" ", "").lower().split(","):
        key, _, value = item.partition(":")
        if key == "expandable_segments":
            return value == "true"
    return False


def _allocator_settings() -> str:
    """The caching allocator's settings as the process set them."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return str(getter())
        except RuntimeError:
            pass
    return ",".join(
        os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    )


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(settings)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.memory._set_allocator_settings(settings)


def plain_cuda_allocation(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, zero: bool
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One ``torch.empty`` (or ``zeros``) of ``shape`` on a CUDA device as a plain
    ``cudaMalloc`` segment: expandable segments switched off for this allocation (and
    back on after it, if they were on). Returns the tensor and what the allocator says
    of it (backend, the segment's size and whether it is expandable)."""
    expandable = expandable_segments_requested(_allocator_settings())
    if expandable:
        _set_allocator_settings("expandable_segments:False")
    try:
        make = torch.zeros if zero else torch.empty
        kv = make(shape, dtype=dtype, device=device)
    finally:
        if expandable:
            _set_allocator_settings("expandable_segments:True")
    info: dict[str, Any] = {
        "kind": "cuda",
        "backend": torch.cuda.memory.get_allocator_backend(),
        "expandable_segments_were_on": expandable,
    }
    base = kv.data_ptr()
    snapshot: list[dict[str, Any]] = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    for seg in snapshot:
        start, size = int(seg.get("address", -1)), int(seg.get("total_size", 0))
        if start <= base < start + size:
            info.update(
                segment_address=start,
                segment_bytes=size,
                segment_expandable=bool(seg.get("is_expandable", False)),
            )
            break
    return kv, info


RELAYOUT_PIECE_BYTES = 512 << 10  # pages turned per gather and scatter on a CPU (cache-sized)
DEVICE_PIECE_BYTES = 64 << 20  # on a GPU: few launches, a bounded temporary


def piece_bytes(device: torch.device) -> int:
    """Bytes a turn (:meth:`KVPool.relayout`) gathers and scatters at a time on
    ``device``: a CPU's cache, or on a GPU enough to keep its launches few."""
    return RELAYOUT_PIECE_BYTES if device.type == "cpu" else DEVICE_PIECE_BYTES


def turn_rows(rows: torch.Tensor, index: torch.Tensor, landed: tuple[int, ...], axis: int) -> None:
    """Swap axes ``axis`` and ``axis + 1`` of the rows ``index`` lists, in place: ``rows``
    is ``[n, row]`` (each row dense), each listed row holding a tensor of shape
    ``landed`` that becomes the same with those two axes swapped (a row listed twice is
    turned once). What a pool's pages
    (:meth:`KVPool.relayout`) and a vLLM cache's layer spans go through when they landed
    in another layout. On a CPU with the native turn built (``kvferry.transfer._turn``,
    ``transfer/native/kvf_turn.c``), each array passes once through a scratch that stays
    in cache: one read and one write of each byte, with the GIL released; elsewhere
    :func:`turn_rows_reference`. Both give the same bytes (a property test holds them to
    it)."""
    if _native_turn_fits(rows, index, landed):
        turn_rows_native(rows, index, landed, axis)
    else:
        turn_rows_reference(rows, index, landed, axis)


def turn_rows_reference(
    rows: torch.Tensor, index: torch.Tensor, landed: tuple[int, ...], axis: int
) -> None:
    """:func:`turn_rows` in torch, on any device: per piece of rows (:func:`piece_bytes`),
    a gather, the transpose and a scatter back, each element moved as the widest integer
    that divides a vector (:func:`widest_view`)."""
    index = torch.unique(index.reshape(-1))
    n = rows.shape[0]
    wide = widest_view(rows.view(n, -1, landed[-1])).view(n, -1)  # a vector's width decides
    shape = (*landed[:-1], -1)  # the last axis counted in wide elements
    per = max(1, piece_bytes(rows.device) // max(1, rows.shape[1] * rows.element_size()))
    for lo in range(0, index.numel(), per):
        piece = index[lo : lo + per]
        turned = wide.index_select(0, piece).view(len(piece), *shape).transpose(axis + 1, axis + 2)
        wide.index_copy_(0, piece, turned.reshape(len(piece), -1))


@functools.cache
def _native_turn() -> tuple[Any, Any] | None:
    """The native turn's cffi ``(ffi, lib)`` (``kvf_turn_rows``, see
    ``transfer/native/kvf_turn.h``), or None when the module is not built."""
    try:
        module = importlib.import_module("kvferry.transfer._turn")
    except (ImportError, OSError):
        return None
    return module.ffi, module.lib


def _native_turn_fits(rows: torch.Tensor, index: torch.Tensor, landed: tuple[int, ...]) -> bool:
    return (
        rows.device.type == "cpu"
        and index.device.type == "cpu"
        and rows.dim() == 2
        and rows.stride(1) == 1
        and math.prod(landed) == rows.shape[1]
        and _native_turn() is not None
    )


def turn_rows_native(
    rows: torch.Tensor, index: torch.Tensor, landed: tuple[int, ...], axis: int
) -> None:
    """:func:`turn_rows` by ``kvf_turn_rows`` (CPU rows, each dense and exactly ``landed``;
    the module built). Rows outside ``rows`` raise IndexError before any is touched."""
    if not _native_turn_fits(rows, index, landed):
        raise ValueError(
            f"the native turn takes CPU rows [n, row] dense inside, each exactly {landed}; "
            f"got {tuple(rows.shape)} strides {rows.stride()} on {rows.device}"
        )
    native = _native_turn()
    assert native is not None  # _native_turn_fits
    ffi, lib = native
    size = rows.element_size()
    # each row turns alone: in increasing address order the hardware prefetcher streams
    # (a million-token prompt's pages at random: 6.4 GB/s; sorted: several times that)
    index = torch.unique(index.to(torch.int64).reshape(-1)).contiguous()
    outer = math.prod(landed[:axis])
    vec_bytes = math.prod(landed[axis + 2 :]) * size
    bad = lib.kvf_turn_rows(
        ffi.cast("void *", rows.data_ptr()),
        rows.stride(0) * size,
        rows.shape[0],
        ffi.cast("const int64_t *", index.data_ptr()),
        index.numel(),
        outer,
        landed[axis],
        landed[axis + 1],
        vec_bytes,
    )
    if bad >= 0:
        raise IndexError(f"row {int(index[bad])} outside [0, {rows.shape[0]}): nothing turned")
    if bad == -2:
        raise MemoryError(
            f"the native turn could not take arrays of {landed[axis]} x {landed[axis + 1]} "
            f"x {vec_bytes} bytes: nothing turned"
        )


def widest_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last (dense) axis viewed as the widest integer type that divides
    its bytes, its offset and every other axis's stride: the same memory, fewer and wider
    elements to move."""
    nbytes = t.shape[-1] * t.element_size()
    offset = t.storage_offset() * t.element_size()
    strides = [s * t.element_size() for s in t.stride()[:-1]]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if size > t.element_size() and all(x % size == 0 for x in (nbytes, offset, *strides)):
            return t.view(dtype)
    return t


class KVPool:
    """The rank's KV pages.

    ``kv`` is ``[pages, layers, 2, kv_heads, page_size, head_dim]``: the contiguous
    ``storage`` itself (HND), or a view of it (NHD storage, see the module docstring).
    The storage is either allocated here (``torch.empty``: pages are never zeroed, like a
    real pool, so stale KV stays until overwritten; on CUDA one plain allocation, see the
    module docstring) or viewed over a caller's buffer (for instance memory the transfer
    engine registered), see :meth:`from_buffer`.
    """

    def __init__(
        self, config: PoolConfig, storage: torch.Tensor | None = None, *, zero: bool = False
    ) -> None:
        self.config = config
        self.allocation: dict[str, Any] = {"kind": "host"}
        if storage is None and torch.device(config.device).type == "cuda":
            self.storage, self.allocation = plain_cuda_allocation(
                config.storage_shape, config.dtype, config.device, zero
            )
        elif storage is None:
            make = torch.zeros if zero else torch.empty
            self.storage = make(config.storage_shape, dtype=config.dtype, device=config.device)
        else:
            self.allocation = {"kind": "caller's buffer", "device": str(storage.device)}
            self.storage = self._view_storage(config, storage)
            if zero:
                self.storage.zero_()
        if not self.storage.is_contiguous():
            raise PoolShapeError("KV pool storage must be contiguous")
        self.order = config.order
        self.kv = self.storage if self.order is Order.HND else self.storage.transpose(3, 4)

    @classmethod
    def from_buffer(cls, config: PoolConfig, buffer: torch.Tensor) -> KVPool:
        """View a flat buffer (any dtype, typically uint8) as the pool tensor, without copying."""
        return cls(config, storage=buffer)

    @staticmethod
    def _view_storage(config: PoolConfig, storage: torch.Tensor) -> torch.Tensor:
        if not storage.is_contiguous():
            raise PoolShapeError("pool storage must be contiguous")
        if tuple(storage.shape) == config.storage_shape and storage.dtype == config.dtype:
            return storage
        flat = storage.reshape(-1).view(torch.uint8)
        if flat.numel() < config.total_bytes:
            raise PoolShapeError(
                f"buffer of {flat.numel()} bytes cannot hold {config.num_pages} pages of "
                f"{config.page_bytes} bytes ({config.total_bytes} bytes)"
            )
        if flat.data_ptr() % config.element_size:
            raise PoolShapeError(f"buffer is not aligned to {config.element_size} bytes")
        return flat[: config.total_bytes].view(config.dtype).view(config.storage_shape)

    # --- measured figures (I3): from the tensor, not from the config -----------------
    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def layers(self) -> int:
        return self.kv.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.kv.shape[3]

    @property
    def page_size(self) -> int:
        return self.kv.shape[4]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[5]

    @property
    def page_format(self) -> tuple[int, Order]:
        """(tokens per page, axis order): what :func:`~.reshard.page_for_page` compares."""
        return self.page_size, self.order

    @property
    def page_bytes(self) -> int:
        return self.kv.stride(0) * self.kv.element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the allocated tensor can hold: whole pages backed by real storage."""
        backed_bytes = (
            self.kv.untyped_storage().nbytes() - self.kv.storage_offset() * self.kv.element_size()
        )
        backed_pages = min(self.num_pages, backed_bytes // self.page_bytes)
        return backed_pages * self.page_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    # --- addressing -------------------------------------------------------------------
    def page_view(self, page: int) -> torch.Tensor:
        """``[layers, 2, kv_heads, page_size, head_dim]`` view of one page (in the
        model's order, whatever the storage's)."""
        self._check_page(page)
        return self.kv[page]

    def page_byte_range(self, page: int) -> tuple[int, int]:
        """``(byte_offset, nbytes)`` of a whole page inside kv's storage."""
        self._check_page(page)
        base = int(self.kv.storage_offset()) * self.kv.element_size()
        return base + page * self.page_bytes, self.page_bytes

    def laid_as(self, order: Order, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """The pool's memory read as pages laid in ``order`` (whatever this pool's own):
        ``[pages, layers, 2, heads, page_size, head_dim]`` for HND, ``[pages, layers, 2,
        page_size, heads, head_dim]`` for NHD, of heads ``[lo, hi)`` (numbered in this
        pool; all by default). A writer of one page size and another order writes its
        pages as they lie in its own memory (:func:`~.reshard.page_for_page`): this is
        what lands, what its checksums are of, and what :meth:`relayout` turns into this
        pool's order."""
        lo, hi = heads if heads is not None else (0, self.kv_heads)
        if not 0 <= lo < hi <= self.kv_heads:
            raise IndexError(f"heads [{lo}, {hi}) outside the pool's {self.kv_heads} KV heads")
        if order is self.order:
            laid = self.storage
        else:
            laid = self.storage.view(
                self.storage.shape[:3] + self.storage.shape[3:5][::-1] + self.storage.shape[5:]
            )
        return laid[:, :, :, lo:hi] if order is Order.HND else laid[:, :, :, :, lo:hi]

    def relayout(self, pages: Sequence[int] | torch.Tensor, laid: Order) -> None:
        """Turn ``pages``, whose bytes lie in order ``laid`` (:meth:`laid_as`, every
        head), into this pool's order, in place (:func:`turn_rows`, on any device). Pages
        already in this pool's order are left as they are."""
        if laid is self.order:
            return
        index = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).to(self.storage.device)
        if index.numel() == 0:
            return
        if bool(((index < 0) | (index >= self.num_pages)).any()):
            raise IndexError(f"pages outside [0, {self.num_pages})")
        landed = tuple(self.laid_as(laid).shape[1:])  # [layers, 2, a, b, head_dim]
        turn_rows(self.storage.view(self.num_pages, -1), index, landed, axis=2)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside pool of {self.num_pages} pages")

    def __repr__(self) -> str:
        return (
            f"KVPool(pages={self.num_pages}, layers={self.layers}, kv_heads={self.kv_heads}, "
            f"page_size={self.page_size}, head_dim={self.head_dim}, order={self.order.value}, "
            f"dtype={self.dtype}, "
            f"device={self.device}, capacity_tokens={self.capacity_tokens})"
        )
