"""The connector's ``kv_connector_extra_config`` keys (README: "vLLM with kvferry")."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from .sidechannel import HandshakeKey, load_key

log = logging.getLogger("kvferry.vllm")


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
    # prefill: a load of more bytes goes in parts of about this many, each with a
    # NOTICE_PART once it landed, checked (and turned) by the decode while the next lands
    part_bytes: int = 8 << 20
    # prefill: batches of rows scattered here and contiguous at the decode are gathered
    # into this many slots of max_batch_bytes of registered memory, each while the batch
    # before it is on the wire (on the KV buffers' device: host or CUDA memory; 0: posted
    # as they lie)
    staging_slots: int = 4
    integrity: bool = True  # decode: checksums and canaries (I5) before finished_recving
    unsafe: bool = False  # BROKEN MODE, for tests only: report loads before they land
    # the handshake secret's file (else KVFERRY_SECRET_FILE, else KVFERRY_SECRET): a path,
    # never the secret itself (`vllm serve` logs kv_transfer_config with its arguments)
    secret_file: str | None = None

    @cached_property
    def key(self) -> HandshakeKey:
        """The side channel's key. Loaded by :meth:`from_extra`, so that an engine without
        a usable secret refuses to start rather than serve its addresses to anyone."""
        key, source = load_key(self.secret_file)
        log.info(
            "kvferry connector: handshake secret from %s (fingerprint %s)", source, key.fingerprint
        )
        return key

    @classmethod
    def from_extra(cls, kv_transfer_config: Any) -> Settings:
        extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
        known = {f.name: f for f in fields(cls)}
        if "secret" in extra:
            raise ValueError(
                "kvferry connector: kv_connector_extra_config takes secret_file (a path), not "
                "the secret itself (`vllm serve` logs kv_transfer_config with its arguments); "
                "or set KVFERRY_SECRET_FILE or KVFERRY_SECRET in vLLM's environment"
            )
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
        settings = cls(**values)
        settings.key  # noqa: B018 - no secret, no engine (TrustError names where to put one)
        return settings
