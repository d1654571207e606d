"""A deliberately broken connector for the many-writer abort case's broken mode: its
decode takes one writer's ABORT_ACK for every writer's, so a load whose first writer
acked goes back to vLLM while another writer may still write its blocks (vLLM #56104,
where the first failed transfer handle freed the blocks its siblings were writing).
Loaded by module path."""

from typing import Any

from kvferry.cluster.vllm.connector import KvferryConnector as _Base
from kvferry.cluster.vllm.owner_host import Load


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._worker is not None:
            owner = self._worker.owner
            on_ack = owner.on_ack

            def first_ack_for_all(o: Load, w: int) -> None:
                o.book.acked.update(o.book.writers)  # BROKEN: one ack taken for all
                on_ack(o, w)

            owner.on_ack = first_ack_for_all  # type: ignore[method-assign]
