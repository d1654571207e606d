"""The connector's ``kv_connector_extra_config`` keys (README: "vLLM with kvferry")."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Settings:
    transports: str | None = None  # "shm", "tcp", "rdma" or None (UCX picks)
    side_channel_host: str = "127.0.0.1"  # where this engine serves its workers' addresses
    side_channel_port: int = 0  # 0: any free port (it goes out in kv_transfer_params)
    handshake_timeout_s: float = 5.0  # fetching a prefill's handshake
    transfer_timeout_s: float = 60.0  # decode: a plan's wait for the notice, then it fails
    abort_deadline_s: float = 10.0  # decode: waiting for acks before severing the writer
    ack_retry_s: float = 1.0  # decode: how often an abort is sent again while unacked
    hold_timeout_s: float = 480.0  # prefill: how long computed KV waits for a plan
    max_batch_bytes: int = 8 << 20  # prefill: bytes per posted batch (an abort stops within one)
    integrity: bool = True  # decode: checksums and canaries (I5) before finished_recving
    unsafe: bool = False  # BROKEN MODE, for tests only: report loads before they land

    @classmethod
    def from_extra(cls, kv_transfer_config: Any) -> Settings:
        extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kvferry connector: unknown kv_connector_extra_config keys {unknown}; "
                f"known: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            default = getattr(cls, name)
            if isinstance(default, bool):
                values[name] = value if isinstance(value, bool) else str(value).lower() == "true"
            elif isinstance(default, int):
                values[name] = int(value)
            elif isinstance(default, float):
                values[name] = float(value)
            else:
                values[name] = None if value in (None, "") else str(value)
        return cls(**values)
