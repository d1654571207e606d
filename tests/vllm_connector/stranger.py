"""A decode engine a stranger runs, for the wrong-secret case: its scheduler takes any
``kv_transfer_params`` as they parse and checks no ticket (cluster/vllm/params.py: with
another secret none would check), so that what it meets next is the prefill's side
channel. Loaded by module path in the decode engine; nothing else in the process is
changed."""

from typing import Any

from kvferry.cluster.vllm import params
from kvferry.cluster.vllm.connector import KvferryConnector as _Base


def take_tickets_unchecked(connector: _Base) -> None:
    """The connector's scheduler side plans loads from whatever parameters parse."""
    if connector._sched is not None:
        connector._sched._remote = lambda request: params.parse(  # type: ignore[method-assign]
            request.kv_transfer_params or {}, request.request_id
        )


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        take_tickets_unchecked(self)
