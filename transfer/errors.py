"""Exceptions of the transfer engine, and every UCX ``ucs_status_t`` as a named class.

Each error carries the numbers that explain it (peer name, status code, offsets) so that
callers above (engine, cluster) can log and count it (I6: every fault is visible).
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by ``kvferry.transfer``."""


class UcxError(TransferError):
    """A UCX call returned an error status. ``status`` is the raw ``ucs_status_t``."""

    status: int = -1
    ucs_name: str = "UCS_ERR_UNKNOWN"

    def __init__(self, message: str, status: int | None = None, peer: str | None = None):
        if status is not None:
            self.status = status
        self.peer = peer
        super().__init__(
            f"{message}: {self.ucs_name} ({self.status})" + (f" [peer {peer}]" if peer else "")
        )


class PeerFailedError(TransferError):
    """The peer died, its endpoint failed, or it was severed; ``peer`` names it."""

    def __init__(self, peer: str, reason: str, status: int | None = None):
        self.peer = peer
        self.reason = reason
        self.status = status
        super().__init__(
            f"peer {peer!r} failed: {reason}"
            + (f" (ucs status {status})" if status is not None else "")
        )


class UnflushableError(TransferError):
    """A notice (or flush) to a remote engine whose writes can no longer be ordered: an
    endpoint to it was closed or failed while writes posted through it were not flushed.
    Those writes may still land (UCX over tcp delivers what it had queued after a force
    close), and a flush on another endpoint does not wait for them, so no notice to that
    engine can say they are done. ``peer`` names it; ``reason`` says what was pending."""

    def __init__(self, peer: str, reason: str):
        self.peer = peer
        self.reason = reason
        super().__init__(f"no notice to {peer!r} can follow its writes: {reason}")


class DeadlineExceeded(TransferError):
    """A bounded wait ran out. The operation may still complete later (UCX cannot
    cancel a posted put): callers that must prove no more writes land sever the peer."""

    def __init__(self, what: str, timeout_s: float, peer: str | None = None):
        self.what = what
        self.timeout_s = timeout_s
        self.peer = peer
        super().__init__(
            f"{what} did not complete within {timeout_s:.3f} s"
            + (f" [peer {peer}]" if peer else "")
        )


class RdmaUnavailableError(TransferError):
    """``transports="rdma"`` cannot run here. ``missing`` names what is absent: "verbs"
    (this UCX was built without them), "device" (no RDMA device, or none that
    UCX_NET_DEVICES allows) or "transport" (devices without rc/ud/dc)."""

    def __init__(self, message: str, missing: str):
        self.missing = missing
        super().__init__(message)


class CudaMemoryUnavailableError(TransferError):
    """CUDA memory cannot be registered or moved by this engine's UCX (never bounced
    through host memory instead). ``missing`` names what is absent: ``"ucx-build"`` (the
    UCX library was built without CUDA support), ``"cuda-transports"`` (its CUDA
    transports are not loaded, or UCX_TLS leaves them out) or ``"device"`` (no usable CUDA
    device); ``ucx_version`` and ``ucx_library`` say which UCX answered."""

    def __init__(self, message: str, missing: str, ucx_version: str, ucx_library: str):
        self.missing = missing
        self.ucx_version = ucx_version
        self.ucx_library = ucx_library
        super().__init__(message)


class SegmentBoundsError(TransferError, ValueError):
    """A page (local offset, remote offset, length) falls outside a segment."""

    def __init__(
        self,
        index: int,
        local_off: int,
        remote_off: int,
        length: int,
        local_len: int,
        remote_len: int,
        why: str,
    ):
        self.index = index
        self.local_off, self.remote_off, self.length = local_off, remote_off, length
        self.local_len, self.remote_len = local_len, remote_len
        super().__init__(
            f"page {index} (local_off={local_off}, remote_off={remote_off}, length={length}) "
            f"{why}: local segment {local_len} B, remote segment {remote_len} B; nothing posted"
        )


class StaleIncarnationError(TransferError):
    """A descriptor or message carries an incarnation other than the one expected."""

    def __init__(self, what: str, got: int, expected: int):
        self.got = got
        self.expected = expected
        super().__init__(f"{what}: incarnation {got:#018x} is not the expected {expected:#018x}")


class WireError(TransferError, ValueError):
    """A control message was malformed, of unknown kind or version, mistyped or too big."""


# ucs_status_t values (ucs/type/status.h) -> names; each becomes a UcxError subclass.
UCS_STATUS_NAMES: dict[int, str] = {
    -1: "UCS_ERR_NO_MESSAGE",
    -2: "UCS_ERR_NO_RESOURCE",
    -3: "UCS_ERR_IO_ERROR",
    -4: "UCS_ERR_NO_MEMORY",
    -5: "UCS_ERR_INVALID_PARAM",
    -6: "UCS_ERR_UNREACHABLE",
    -7: "UCS_ERR_INVALID_ADDR",
    -8: "UCS_ERR_NOT_IMPLEMENTED",
    -9: "UCS_ERR_MESSAGE_TRUNCATED",
    -10: "UCS_ERR_NO_PROGRESS",
    -11: "UCS_ERR_BUFFER_TOO_SMALL",
    -12: "UCS_ERR_NO_ELEM",
    -13: "UCS_ERR_SOME_CONNECTS_FAILED",
    -14: "UCS_ERR_NO_DEVICE",
    -15: "UCS_ERR_BUSY",
    -16: "UCS_ERR_CANCELED",
    -17: "UCS_ERR_SHMEM_SEGMENT",
    -18: "UCS_ERR_ALREADY_EXISTS",
    -19: "UCS_ERR_OUT_OF_RANGE",
    -20: "UCS_ERR_TIMED_OUT",
    -21: "UCS_ERR_EXCEEDS_LIMIT",
    -22: "UCS_ERR_UNSUPPORTED",
    -23: "UCS_ERR_REJECTED",
    -24: "UCS_ERR_NOT_CONNECTED",
    -25: "UCS_ERR_CONNECTION_RESET",
}
# Link failures (-40..-59) and endpoint failures (-60..-89) are ranges in UCX.
_LINK_FAILURE = range(-59, -39)
_ENDPOINT_FAILURE = range(-89, -59)


def _class_name(ucs_name: str) -> str:
    parts = ucs_name.removeprefix("UCS_ERR_").lower().split("_")
    return "Ucs" + "".join(p.capitalize() for p in parts) + "Error"


UCS_ERRORS: dict[int, type[UcxError]] = {}
for _code, _name in UCS_STATUS_NAMES.items():
    _cls = type(
        _class_name(_name),
        (UcxError,),
        {"status": _code, "ucs_name": _name, "__doc__": f"UCX status {_name} ({_code})."},
    )
    UCS_ERRORS[_code] = _cls
    globals()[_cls.__name__] = _cls


class UcsLinkFailureError(UcxError):
    """UCX status in the link-failure range (-40..-59)."""

    ucs_name = "UCS_ERR_LINK_FAILURE"


class UcsEndpointFailureError(UcxError):
    """UCX status in the endpoint-failure range (-60..-89), e.g. UCS_ERR_ENDPOINT_TIMEOUT."""

    ucs_name = "UCS_ERR_ENDPOINT_FAILURE"


# Statuses that mean "the path to the peer is gone" rather than a local mistake.
PEER_FAILURE_STATUSES = frozenset(
    {-3, -6, -16, -17, -20, -24, -25, *_LINK_FAILURE, *_ENDPOINT_FAILURE}
)


def ucx_error(status: int, message: str, peer: str | None = None) -> UcxError:
    """The named exception for ``status`` (a negative ``ucs_status_t``)."""
    if status in UCS_ERRORS:
        cls = UCS_ERRORS[status]
    elif status in _LINK_FAILURE:
        cls = UcsLinkFailureError
    elif status in _ENDPOINT_FAILURE:
        cls = UcsEndpointFailureError
    else:
        cls = UcxError
    return cls(message, status=status, peer=peer)


def status_name(status: int) -> str:
    if status == 0:
        return "UCS_OK"
    if status == 1:
        return "UCS_INPROGRESS"
    return UCS_STATUS_NAMES.get(status, ucx_error(status, "").ucs_name)
