"""The transports' failure horizons: how long a connected but silent peer (partitioned,
hung host) can stay "connected" before its transport declares it dead, and how that
compares with the abort deadline (an owner severs writers that have not acked by then).

- tcp: keep-alive (idle + interval x count) for an idle connection, ``TCP_USER_TIMEOUT``
  for one with data in flight; without ``TCP_USER_TIMEOUT`` (UCX before it had the
  option) the kernel retransmits for ``net.ipv4.tcp_retries2`` rounds (15: about 15 min).
- RC (rc_verbs, rc_mlx5, dc_mlx5): the NIC retransmits an unacknowledged packet after
  the local ACK timeout ``RC_TIMEOUT``, ``RC_RETRY_COUNT`` times, then fails the QP. The
  timeout is programmed as 4.096 us x 2^n, n rounded up here, so the horizon is
  ``4.096 us x 2^ceil(log2(T / 4.096 us)) x (retries + 1)``.
- shared memory: no transport timeout; a writer's death is seen through its process.

Values are what the worker was created with (the engine's options or the operator's
``UCX_*`` environment, else UCX's defaults as this UCX reports them).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

IB_TIME_UNIT_S = 4.096e-6
TCP_RETRIES2_PATH = "/proc/sys/net/ipv4/tcp_retries2"
_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "m": 60.0, "h": 3600.0}


def parse_seconds(text: str) -> float | None:
    """A UCX time value ("4s", "0.5s", "10000000.00us", "500ms") in seconds; None for
    "inf", "auto" or anything unparsable."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[-+]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)]


def ib_timeout_s(timeout_s: float) -> float:
    """The local ACK timeout a NIC runs for a requested one: 4.096 us x 2^n, n rounded up
    (the larger, so the horizon stays an upper bound), n in 0..31."""
    n = max(0, min(31, math.ceil(math.log2(max(timeout_s, IB_TIME_UNIT_S) / IB_TIME_UNIT_S))))
    return IB_TIME_UNIT_S * (1 << n)


def rc_horizon_s(timeout_s: float, retry_count: int) -> float:
    return ib_timeout_s(timeout_s) * (retry_count + 1)


def tcp_retries2_horizon_s(retries2: int) -> float:
    """Linux's retransmission limit for an established connection: backoff from the
    200 ms minimum RTO, doubling up to the 120 s maximum, over retries2 + 1 intervals."""
    total, rto = 0.0, 0.2
    for _ in range(retries2 + 1):
        total += rto
        rto = min(rto * 2, 120.0)
    return total


def read_tcp_retries2() -> int:
    try:
        with open(TCP_RETRIES2_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 15


@dataclass(frozen=True)
class FailureHorizon:
    """``seconds``: the longest a silent connected peer counts as alive (None: no
    transport timeout applies, as over shared memory); ``how``: the numbers behind it."""

    transport: str
    seconds: float | None
    how: str

    def log_record(self, abort_deadline_s: float) -> tuple[int, str]:
        """(level, message) for the start-up log: the horizon and whether the abort
        deadline lies past it (WARNING when it does not)."""
        head = f"failure horizon ({self.transport}): {self.how}"
        if self.seconds is None:
            return logging.INFO, (
                f"{head}; --abort-deadline {abort_deadline_s:g} s only "
                "bounds the wait for abort acks"
            )
        if abort_deadline_s > self.seconds:
            return logging.INFO, (
                f"{head}; --abort-deadline {abort_deadline_s:g} s lies past "
                "it: a connected writer has acked or been declared dead "
                "by its transport when its owner severs it"
            )
        return logging.WARNING, (
            f"{head}; --abort-deadline {abort_deadline_s:g} s does NOT "
            f"lie past it: raise it above {self.seconds:.1f} s or "
            "shorten the transport's timeouts"
        )


def tcp_horizon(
    keepidle: str | None,
    keepintvl: str | None,
    keepcnt: str | None,
    user_timeout: str | None,
    user_timeout_supported: bool,
) -> FailureHorizon:
    """The tcp horizon from the option values the worker read (None: not known)."""
    idle, intvl = parse_seconds(keepidle or ""), parse_seconds(keepintvl or "")
    count = int(keepcnt) if keepcnt is not None and keepcnt.isdigit() else None
    keepalive = (
        idle + intvl * count
        if idle is not None and intvl is not None and count is not None
        else None
    )
    ka_text = (
        f"keep-alive {idle:g} s + {intvl:g} s x {count} = {keepalive:g} s"
        if keepalive is not None
        else f"keep-alive {keepidle} + {keepintvl} x {keepcnt} (not all set)"
    )
    user = parse_seconds(user_timeout or "") if user_timeout_supported else None
    if user is not None:
        seconds = max(user, keepalive or 0.0)
        return FailureHorizon(
            "tcp",
            seconds,
            f"{ka_text} when idle, TCP_USER_TIMEOUT {user:g} s with data in flight: {seconds:g} s",
        )
    retries2 = read_tcp_retries2()
    kernel = tcp_retries2_horizon_s(retries2)
    why = (
        "this UCX has no TCP_USER_TIMEOUT option"
        if not user_timeout_supported
        else f"TCP_USER_TIMEOUT is {user_timeout or 'unset'}"
    )
    return FailureHorizon(
        "tcp",
        max(kernel, keepalive or 0.0),
        f"{ka_text} when idle; with data in flight the kernel's "
        f"retransmission limit (net.ipv4.tcp_retries2={retries2}: about "
        f"{kernel:.0f} s), since {why}",
    )


def rc_horizon(timeout: str | None, retry_count: str | None) -> FailureHorizon:
    t = parse_seconds(timeout or "")
    r = int(retry_count) if retry_count is not None and retry_count.isdigit() else None
    if t is None or r is None:
        return FailureHorizon(
            "rc",
            None,
            f"RC_TIMEOUT {timeout} x RC_RETRY_COUNT {retry_count}: not a bounded horizon",
        )
    seconds = rc_horizon_s(t, r)
    return FailureHorizon(
        "rc",
        seconds,
        f"RC_TIMEOUT {timeout} (the NIC runs "
        f"{ib_timeout_s(t) * 1e3:.0f} ms) x "
        f"(RC_RETRY_COUNT {r} + 1) = {seconds:.1f} s",
    )


SHM_HORIZON = FailureHorizon(
    "shm",
    None,
    "shared memory has no transport timeout; a writer's death is seen through its process",
)


def combine(horizons: list[FailureHorizon]) -> FailureHorizon:
    """The horizon of a transport mix: the longest bounded one (None only if all are)."""
    bounded = [(h.seconds, h) for h in horizons if h.seconds is not None]
    if not bounded:
        return horizons[0] if horizons else SHM_HORIZON
    worst = max(bounded, key=lambda sh: sh[0])[1]
    if len(horizons) == 1:
        return worst
    return FailureHorizon(
        "+".join(h.transport for h in horizons),
        worst.seconds,
        "; ".join(f"{h.transport}: {h.how}" for h in horizons),
    )
