"""A deliberately broken connector for the pipelined load's broken mode: its decode
takes every NOTICE_PART's blocks as checked without reading them, so the whole notice's
check skips them too, and a block torn in an early part is read as if it were the
prefill's. Loaded by module path."""

from typing import Any

from kvferry.cluster.vllm.connector import KvferryConnector as _Base
from kvferry.cluster.vllm.owner_host import Load


class KvferryConnector(_Base):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._worker is not None:
            data = self._worker.owner.driver.ports.data

            def trusted(o: Load, w: int, m: dict[str, Any]) -> str:
                return ""  # BROKEN: a part's blocks taken as checked, unread

            data._check_part = trusted
