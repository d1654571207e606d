"""``vllm.general_plugins`` entry point: makes ``"kv_connector": "KvferryConnector"`` work
without ``kv_connector_module_path``."""

from __future__ import annotations


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import (  # type: ignore[import-not-found]
        KVConnectorFactory,
    )

    name = "KvferryConnector"
    if name not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(name, "kvferry.cluster.vllm.connector", name)
