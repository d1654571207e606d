"""A deliberately broken connector for the gone-prefill case's broken mode: its decode
connects to the prefill's worker outside any catch, as before transfer errors there were
caught (a prefill killed after its handshake raises out of ``start_load_kv``). Loaded by
module path."""

from typing import Any

from kvferry.cluster.vllm.connector import KvferryConnector as _Base
from kvferry.cluster.vllm.owner_host import Load, OwnerHost


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._worker is not None:
            owner = self._worker.owner
            assign = owner._try_assign

            def uncaught(o: Load, owner: OwnerHost = owner) -> None:
                links, _ = owner._links(o)
                for link in links or ():
                    owner.link.peer(bytes(link.card["address"]))
                assign(o)

            owner._try_assign = uncaught  # type: ignore[method-assign]
