"""Loads the native UCX binding ``kvferry.transfer._ucp``.

The module is linked against UCX with an rpath. When it was built against the ``libucx``
wheel (its file says ``kvferry-ucx-origin=wheel``), the wheel's libraries are loaded first
with ``libucx.load_library()``: a build isolated by pip leaves an rpath that no longer
exists, and the dynamic loader would then resolve ``libucp.so.0`` to a system UCX if one is
installed. A UCX older than the one the module was built against is refused here, with
both versions.

The flag and field-mask constants of ``native/kvf_ucp.h`` are mirrored here once, from
the compiled module, under their names without the ``KVF_`` prefix (``lib`` and ``ffi``
are cffi objects, typed ``Any``).
"""

from __future__ import annotations

import importlib.util

ORIGIN_WHEEL = b"kvferry-ucx-origin=wheel"


def _built_against_wheel() -> bool:
    spec = importlib.util.find_spec(f"{__package__}._ucp")
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, "rb") as f:
        return ORIGIN_WHEEL in f.read()


def _load_wheel() -> bool:
    try:
        import libucx
    except ImportError:
        return False
    libucx.load_library()
    return True


if _built_against_wheel():
    _load_wheel()
# ffi and lib are cffi objects (typed Any: the compiled module has no stubs).
try:
    from ._ucp import ffi, lib
except ImportError as first_error:
    if not _load_wheel():
        raise first_error from None
    from ._ucp import ffi, lib


def _check_versions() -> None:
    v = [ffi.new("unsigned *") for _ in range(5)]
    lib.kvf_ucx_versions(*v)
    built, running = (int(v[0][0]), int(v[1][0])), (int(v[2][0]), int(v[3][0]))
    if running < built:
        raise ImportError(
            f"kvferry's UCX binding was built against UCX {built[0]}.{built[1]} "
            f"({ffi.string(lib.kvf_ucx_source()).decode()}) but loaded UCX "
            f"{ffi.string(lib.kvf_version_string()).decode()} from "
            f"{ffi.string(lib.kvf_library_path()).decode()}: rebuild it against that UCX "
            "(KVFERRY_UCX=system or a prefix) or fix LD_LIBRARY_PATH"
        )


_check_versions()

# kvf_worker_params_t.field_mask
WORKER_PARAM_FIELD_OPTIONS: int = lib.KVF_WORKER_PARAM_FIELD_OPTIONS
WORKER_PARAM_FIELD_MAX_SENDER: int = lib.KVF_WORKER_PARAM_FIELD_MAX_SENDER
WORKER_PARAM_FIELD_MAX_PAYLOAD: int = lib.KVF_WORKER_PARAM_FIELD_MAX_PAYLOAD
WORKER_PARAM_FIELD_BUSY_POLL_US: int = lib.KVF_WORKER_PARAM_FIELD_BUSY_POLL_US
WORKER_PARAM_FIELD_SPIN_US: int = lib.KVF_WORKER_PARAM_FIELD_SPIN_US
WORKER_PARAM_FIELD_BAD_OPTION: int = lib.KVF_WORKER_PARAM_FIELD_BAD_OPTION
# kvf_worker_wait, kvf_ep_close, kvf_mem_map flags
WAIT_FLAG_STAY_AWAKE: int = lib.KVF_WAIT_FLAG_STAY_AWAKE
EP_CLOSE_FLAG_FORCE: int = lib.KVF_EP_CLOSE_FLAG_FORCE
MEM_MAP_FLAG_ALLOCATE: int = lib.KVF_MEM_MAP_FLAG_ALLOCATE
# kvf_mem_map_params_t.field_mask, kvf_memory_type_t
MEM_MAP_PARAM_FIELD_ADDRESS: int = lib.KVF_MEM_MAP_PARAM_FIELD_ADDRESS
MEM_MAP_PARAM_FIELD_FLAGS: int = lib.KVF_MEM_MAP_PARAM_FIELD_FLAGS
MEM_MAP_PARAM_FIELD_MEMORY_TYPE: int = lib.KVF_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
MEMORY_TYPE_HOST: int = lib.KVF_MEMORY_TYPE_HOST
MEMORY_TYPE_CUDA: int = lib.KVF_MEMORY_TYPE_CUDA
# kvf_rma_param_t.field_mask
RMA_PARAM_FIELD_DIRECT_BASE: int = lib.KVF_RMA_PARAM_FIELD_DIRECT_BASE
RMA_PARAM_FIELD_STREAMING_MIN_BYTES: int = lib.KVF_RMA_PARAM_FIELD_STREAMING_MIN_BYTES
RMA_PARAM_FIELD_SKIP_PAGE: int = lib.KVF_RMA_PARAM_FIELD_SKIP_PAGE
RMA_PARAM_FIELD_NOTICE: int = lib.KVF_RMA_PARAM_FIELD_NOTICE
RMA_PARAM_FIELD_PEER_PROCESS: int = lib.KVF_RMA_PARAM_FIELD_PEER_PROCESS
RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE: int = lib.KVF_RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE
# kvf_msg_param_t.flags, kvf_envelope_t.flags, kvf_memcpy_pages flags
MSG_FLAG_NOTICE: int = lib.KVF_MSG_FLAG_NOTICE
MSG_FLAG_FLUSH: int = lib.KVF_MSG_FLAG_FLUSH
ENVELOPE_FLAG_FLUSHED: int = lib.KVF_ENVELOPE_FLAG_FLUSHED
COPY_FLAG_STREAMING: int = lib.KVF_COPY_FLAG_STREAMING

__all__ = [
    "COPY_FLAG_STREAMING",
    "ENVELOPE_FLAG_FLUSHED",
    "EP_CLOSE_FLAG_FORCE",
    "MEMORY_TYPE_CUDA",
    "MEMORY_TYPE_HOST",
    "MEM_MAP_FLAG_ALLOCATE",
    "MEM_MAP_PARAM_FIELD_ADDRESS",
    "MEM_MAP_PARAM_FIELD_FLAGS",
    "MEM_MAP_PARAM_FIELD_MEMORY_TYPE",
    "MSG_FLAG_FLUSH",
    "MSG_FLAG_NOTICE",
    "RMA_PARAM_FIELD_DIRECT_BASE",
    "RMA_PARAM_FIELD_NOTICE",
    "RMA_PARAM_FIELD_PEER_PROCESS",
    "RMA_PARAM_FIELD_SKIP_PAGE",
    "RMA_PARAM_FIELD_STREAMING_MIN_BYTES",
    "WAIT_FLAG_STAY_AWAKE",
    "WORKER_PARAM_FIELD_BAD_OPTION",
    "WORKER_PARAM_FIELD_BUSY_POLL_US",
    "WORKER_PARAM_FIELD_MAX_PAYLOAD",
    "WORKER_PARAM_FIELD_MAX_SENDER",
    "WORKER_PARAM_FIELD_OPTIONS",
    "WORKER_PARAM_FIELD_SPIN_US",
    "ffi",
    "lib",
]
