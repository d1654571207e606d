"""Memory types of segments (host, CUDA) and the check that UCX can really move CUDA
memory before a CUDA segment is registered.

UCX's ``ucp_mem_map`` with ``memory_type = UCS_MEMORY_TYPE_CUDA`` reports success even
when no memory domain can register CUDA memory (its registration loop skips the domains
that lack the type), and a put from such a key then reads a device pointer as host
memory. So the engine asks the context (``ucp_context_query`` -> ``memory_types``) first
and refuses with :class:`~kvferry.transfer.errors.CudaMemoryUnavailableError`, naming
what is missing, in this order:

- ``"ucx-build"``: the UCX library has no CUDA module (``ucx/libuct_cuda.so`` beside
  ``libucp``): it was built without ``--with-cuda`` (Debian's UCX, for one);
- ``"cuda-transports"``: the module is there but its transports are not loaded (the CUDA
  driver libraries it needs, ``libcuda.so.1`` / ``libnvidia-ml.so.1``, do not load, with
  the loader's message), or ``UCX_TLS`` names no CUDA transport;
- ``"device"``: the transports are loaded but UCX found no usable CUDA device.

Nothing here bounces device memory through host memory: a CUDA segment is mapped as CUDA
memory or refused. CUDA itself is initialised (a current context on the device) before
``ucp_init`` when a config asks for CUDA memory (:func:`init_cuda`): UCX's cuda
transports take the context that is current when the worker is created.
"""

from __future__ import annotations

import ctypes
import enum
import os
from dataclasses import dataclass
from typing import Any

from .errors import CudaMemoryUnavailableError


class MemoryType(enum.StrEnum):
    """A segment's memory (the wire word of a descriptor's ``memory_type``)."""

    HOST = "host"
    CUDA = "cuda"


# ucs_memory_type_t values common to UCX 1.13 .. 1.22, as UCS_BIT positions.
UCS_MEMORY_TYPE_NAMES = {0: "host", 1: "cuda", 2: "cuda-managed", 3: "rocm", 4: "rocm-managed"}
# The kvf_memory_type_t of each MemoryType (kvf_ucp.h).
NATIVE_TYPE = {MemoryType.HOST: 0, MemoryType.CUDA: 1}
CUDA_TLS = ("cuda_copy", "cuda_ipc", "gdr_copy", "cuda")
CUDA_DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


def parse(value: str | MemoryType) -> MemoryType:
    try:
        return MemoryType(value)
    except ValueError:
        raise ValueError(
            f"unknown memory type {value!r}; use one of {[m.value for m in MemoryType]}"
        ) from None


def ucs_type_names(ucs_mask: int) -> list[str]:
    """The names of the ``UCS_BIT(ucs_memory_type_t)`` bits set in ``ucs_mask``."""
    return [
        UCS_MEMORY_TYPE_NAMES.get(bit, f"type {bit}") for bit in range(64) if ucs_mask & (1 << bit)
    ]


def cuda_module(library_path: str) -> str | None:
    """The path of UCX's CUDA transport module beside ``libucp`` (None: not built)."""
    if not library_path:
        return None
    path = os.path.join(os.path.dirname(library_path), "ucx", "libuct_cuda.so")
    return path if os.path.exists(path) else None


def driver_load_errors() -> list[str]:
    """The loader's message for each CUDA driver library the module needs that does not
    load (empty when all load). Loads only the driver libraries, never UCX's module."""
    errors = []
    for name in CUDA_DRIVER_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    return errors


def tls_names_cuda(tls: str | None) -> bool:
    """Whether a UCX_TLS list (None or "all": UCX's default) lets a CUDA transport in."""
    if tls is None or tls in ("all", ""):
        return True
    words = [w.strip().lstrip("^") for w in tls.split(",")]
    if tls.startswith("^"):  # an exclusion list
        return not any(w in CUDA_TLS for w in words)
    return any(w in CUDA_TLS for w in words)


@dataclass(frozen=True)
class UcxMemoryReport:
    """What a UCX context says about memory types, and where to look when CUDA is
    missing. ``kvf_mask``: bits ``1 << kvf_memory_type_t``; ``ucs_mask``: UCX's own."""

    kvf_mask: int
    ucs_mask: int
    ucx_version: str
    ucx_library: str
    tls: str | None
    components: tuple[str, ...]

    def supports(self, memory_type: MemoryType) -> bool:
        return bool(self.kvf_mask & (1 << NATIVE_TYPE[memory_type]))

    def cuda_components(self) -> list[str]:
        return [c for c in self.components if c.startswith(("cuda", "gdr"))]


def require(memory_type: MemoryType, report: UcxMemoryReport) -> None:
    """Raise :class:`CudaMemoryUnavailableError` unless ``report``'s context can map and
    move ``memory_type`` (host always passes)."""
    if memory_type is MemoryType.HOST or report.supports(memory_type):
        return
    where = f"UCX {report.ucx_version} at {report.ucx_library or '?'}"
    module = cuda_module(report.ucx_library)
    if module is None:
        missing = "ucx-build"
        why = (
            "this UCX build lacks CUDA memory support (no ucx/libuct_cuda.so beside its "
            "libucp: built without --with-cuda); use a UCX built with CUDA, such as the "
            "libucx-cu12/-cu13 wheels (KVFERRY_UCX=wheel)"
        )
    elif not report.cuda_components():
        missing = "cuda-transports"
        load = driver_load_errors()
        why = f"UCX's CUDA transports are not loaded ({module} found, but " + (
            f"the CUDA driver does not load: {'; '.join(load)}: no CUDA driver here)"
            if load
            else "UCX did not load it: UCX_MODULES may exclude it; UCX_LOG_LEVEL=debug says why)"
        )
    elif not tls_names_cuda(report.tls):
        missing = "cuda-transports"
        why = (
            f"UCX_TLS={report.tls} names no CUDA transport: add cuda_copy,cuda_ipc "
            "(or ask TransferConfig for memory_types=('host', 'cuda'), which does)"
        )
    else:
        missing = "device"
        why = (
            f"UCX's CUDA transports are loaded ({', '.join(report.cuda_components())}) but it "
            "found no usable CUDA device (CUDA_VISIBLE_DEVICES, a driver without a device, "
            "or CUDA not initialised before the engine was created)"
        )
    raise CudaMemoryUnavailableError(
        f"cannot register {memory_type.value} memory: {where} can map only "
        f"{', '.join(ucs_type_names(report.ucs_mask)) or 'no'} memory; {why}; refused "
        "(kvferry never bounces device memory through host memory)",
        missing=missing,
        ucx_version=report.ucx_version,
        ucx_library=report.ucx_library,
    )


# --------------------------------------------------------------------- CUDA runtime
_CU_DRIVER: Any = None


def _driver() -> Any:
    global _CU_DRIVER
    if _CU_DRIVER is None:
        _CU_DRIVER = ctypes.CDLL("libcuda.so.1")
    return _CU_DRIVER


def init_cuda(device: int | None) -> str:
    """Make a CUDA context current on ``device`` (None: torch's current device, else 0)
    before ``ucp_init``; returns how. Through torch when it is importable and has CUDA,
    else the driver API (``cuInit``, the device's primary context). Raises
    :class:`CudaMemoryUnavailableError` (``missing="device"``) when neither can."""
    reasons = []
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device() if device is None else device
            torch.cuda.set_device(index)
            torch.empty(1, device=f"cuda:{index}")  # creates the primary context
            return f"torch {torch.__version__}: cuda:{index} ({torch.cuda.get_device_name(index)})"
        reasons.append(
            f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})"
        )
    except ImportError:
        reasons.append("torch is not installed")
    try:
        cu = _driver()
        index = 0 if device is None else device
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for call, args in (
            ("cuInit", (0,)),
            ("cuDeviceGet", (ctypes.byref(dev), index)),
            ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)),
            ("cuCtxSetCurrent", (ctx,)),
        ):
            rc = getattr(cu, call)(*args)
            if rc != 0:
                raise OSError(f"{call} returned CUresult {rc}")
        return f"CUDA driver: device {index} (primary context)"
    except OSError as exc:
        reasons.append(f"CUDA driver: {exc}")
    raise CudaMemoryUnavailableError(
        "CUDA memory was asked for (TransferConfig.memory_types) but no CUDA device can be "
        "initialised: " + "; ".join(reasons),
        missing="device",
        ucx_version="",
        ucx_library="",
    )


def synchronize(device: int | None, stream: Any = None) -> str:
    """Wait until the producer of a CUDA segment's bytes is done, before UCX's own
    streams copy them: ``stream`` (anything with ``synchronize()``: a torch or CuPy
    stream or event recorded after the producing kernels, the cheapest) or, when None,
    torch's current stream of ``device`` (the driver's ``cuCtxSynchronize`` without torch).
    Returns what it waited on."""
    if stream is not None:
        stream.synchronize()
        return "stream"
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.current_stream(device).synchronize()
            return "current stream"
    except ImportError:
        pass
    try:
        rc = _driver().cuCtxSynchronize()
    except OSError as exc:
        rc = f"no driver: {exc}"
    if rc != 0:
        raise CudaMemoryUnavailableError(
            f"cannot wait for a CUDA segment's producer: cuCtxSynchronize: {rc}", "device", "", ""
        )
    return "context"


def cuda_pointer(buf: Any) -> tuple[int, int, int | None] | None:
    """(address, nbytes, device) of contiguous CUDA memory: a CUDA torch tensor or an
    object with ``__cuda_array_interface__`` (CuPy, Numba); None for anything else."""
    device = getattr(buf, "device", None)
    if hasattr(buf, "data_ptr") and getattr(device, "type", None) == "cuda":
        if not buf.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        index = getattr(device, "index", None)
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size()), index
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is None:
        return None
    if iface.get("strides") is not None:
        raise ValueError("register: CUDA array must be C-contiguous (strides None)")
    itemsize = int(iface["typestr"][2:])
    n = 1
    for dim in iface["shape"]:
        n *= int(dim)
    dev = getattr(getattr(buf, "device", None), "id", None)
    return int(iface["data"][0]), n * itemsize, dev
