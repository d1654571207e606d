"""A deliberately broken connector for the tests' broken modes: a decode that never tells
the prefill about a request it rejected (the prefill keeps its blocks until its hold
timeout). Loaded by module path ``broken`` like any out-of-tree connector."""

from kvferry.cluster.vllm.connector import KvferryConnector as _Base
from kvferry.cluster.vllm.connector import KvferryMetadata


class KvferryConnector(_Base):
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, KvferryMetadata)
        meta.refuse.clear()
        return meta
