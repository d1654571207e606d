"""kvferry.engine: what one rank does with pages (no processes, no transport).

The paged KV pool and its allocator, the request life cycle, admission (I1), the start-up
capacity check (I3), page integrity (I5), the paged attention reference, the replay and
random Llama-style models, and a monolithic engine that is the oracle for the
disaggregated path.
"""

from . import tokenizer
from .admission import AdmissionLimits, AdmissionRejected, admit, pages_needed, pool_capacity_tokens
from .allocator import (
    AllocatorError,
    AllocatorInvariantError,
    OutOfPages,
    PageAllocator,
    PageGrant,
    PageOwnershipError,
    PageState,
)
from .attention import (
    dense_attention,
    gather_kv,
    paged_decode_attention,
    write_kv_pages,
    write_kv_tokens,
)
from .capacity import (
    CapacityError,
    CapacityReport,
    check_capacity,
    enforce_startup_capacity,
    measure_capacity,
)
from .decode import DecodeSlot, decode_step
from .integrity import (
    Canary,
    CanaryTable,
    IntegrityError,
    TransferLengthError,
    check_transferred_length,
    expected_canaries,
    page_checksums,
    request_id_hash,
    verify_pages,
)
from .lifecycle import (
    LIVE,
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Request,
    RequestState,
    is_live,
    live_requests,
)
from .llama import LlamaConfig, LlamaModel
from .models import PagedModel
from .monolithic import GenerationResult, IntegrityPolicy, MonolithicEngine
from .pool import DTYPES, KVPool, PoolConfig, PoolShapeError, parse_dtype
from .replay import ReplayConfig, ReplayModel

__all__ = [name for name in dir() if not name.startswith("_")]
