"""A deliberately broken connector for the in-flight abort case's broken mode: its decode's
QUARANTINE gives the blocks back to vLLM at once, as FREE does (the request is reported in
``finished_recving`` while its writer may still write them). Loaded by module path."""

from typing import Any

from kvferry.cluster.vllm.connector import KvferryConnector as _Base


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._worker is not None:
            owner = self._worker.owner
            owner.quarantine = owner.hand_back  # type: ignore[method-assign]
