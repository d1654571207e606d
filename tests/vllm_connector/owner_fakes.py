"""A decode worker's host (cluster/vllm/owner_host.py) over fakes: a side channel that
records what is sent, a prefill's handshake given by hand, the writers' clock. For the
owner's tests; needs vLLM (the connector's modules import it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from writer_fakes import BLOCKS, HEADS, TOKENS, Clock, caches

from kvferry.cluster.vllm import owner_host, wire
from kvferry.cluster.vllm.layout import KVRegions
from kvferry.cluster.vllm.loop import PollTimers, Tombstones
from kvferry.cluster.vllm.metrics import KvferryStats
from kvferry.cluster.vllm.parts import WorkerParts
from kvferry.cluster.vllm.settings import Settings
from kvferry.transfer.protocol import ADDRESS, CODEC

KEY = ("127.0.0.1", 5600)  # the prefill's side channel
W_INC = 0x1234
W_PID = 4242
# the prefill worker's transfer address, as its engine encodes it: on another host
W_ADDR = CODEC.encode(
    ADDRESS.make(
        ucx=b"ucx", incarnation=W_INC, name="prefill0", host="h2", boot_id="b2", pidns=1, pid=W_PID
    )
)


class FakeLink:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, dict]] = []
        self.peers: dict[bytes, Any] = {}

    def peer(self, address: bytes) -> Any:
        if address not in self.peers:
            self.peers[address] = SimpleNamespace(
                address=address, incarnation=W_INC, name="prefill0"
            )
        return self.peers[address]

    def send(self, peer: Any, payload: bytes, rid: str) -> object | None:
        if peer is None:
            return None
        self.sent.append((peer.address, wire.decode(payload)))
        return object()

    notify = send

    def send_to(self, address: bytes, payload: bytes, rid: str) -> object | None:
        return self.send(self.peer(address), payload, rid)

    def sever(self, peer: Any) -> None:
        pass

    def of(self, kind: wire.Kind) -> list[dict]:
        return [m for _, m in self.sent if m["k"] is kind]


class HandFetcher:
    """Handshakes as the test hands them in: what was asked, and results to take."""

    def __init__(self) -> None:
        self.asks: list[tuple[tuple[str, int], bool]] = []
        self.results: list[tuple[tuple[str, int], dict | None, str]] = []

    def ask(self, key: tuple[str, int], again: bool = False) -> None:
        self.asks.append((key, again))

    def take(self) -> list[tuple[tuple[str, int], dict | None, str]]:
        out, self.results = self.results, []
        return out


class _Segment:
    def descriptor(self) -> Any:
        return SimpleNamespace(pack=lambda: b"desc")


def make_owner(**settings: Any) -> SimpleNamespace:
    """A TP 1 decode worker (NHD, HEADS heads) whose prefill (one TP 1 worker on this
    host) has not given its handshake yet: ``handshake()`` is the one it would give."""
    clock = Clock()
    link = FakeLink()
    parts = WorkerParts(
        Settings(**settings),
        link,  # type: ignore[arg-type]
        KvferryStats(),
        Tombstones(clock),  # type: ignore[arg-type]
        clock,  # type: ignore[arg-type]
        0,
        1,
    )
    host = owner_host.OwnerHost(
        parts,
        PollTimers(clock, on_error=lambda rid, exc: None),  # type: ignore[arg-type]
        SimpleNamespace(host="h", boot_id="b", pidns=1),
    )
    dst = KVRegions.from_kv_caches(caches(HEADS, None), BLOCKS, "NHD")
    host.attach(dst, [_Segment()], HEADS)  # type: ignore[list-item]
    host.fetcher = HandFetcher()  # type: ignore[assignment]
    src = KVRegions.from_kv_caches(caches(HEADS, 7), BLOCKS, "NHD")

    def handshake() -> dict:
        card = dict(
            tp_rank=0, tp_size=1, address=W_ADDR, pid=W_PID, layout="NHD",
            signature=src.signature(), regions=src.to_wire(),
        )  # fmt: skip
        return {
            "engine_id": "prefill-0",
            "wire": wire.CODEC.version,
            "tp_size": 1,
            "kv_heads": HEADS,
            "workers": {0: card},
        }

    return SimpleNamespace(host=host, link=link, clock=clock, handshake=handshake)


def spec(prid: str = "p-r") -> dict:
    """A load's spec as the scheduler stages it: 4 blocks of TOKENS tokens."""
    return {
        "engine": "prefill-0", "host": KEY[0], "port": KEY[1], "rid": prid, "tp_size": 1,
        "src": [5, 2, 7, 0], "blocks": [1, 6, 3, 4], "tokens": TOKENS,
    }  # fmt: skip
