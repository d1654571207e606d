"""The cluster's secret at work (kvferry.cluster.trust): nobody without it reads a usable
address or memory key from the store, writes a card or an exit record that counts, or has
a control message acted on; replays are refused; the front door wants its API key; the
store listens where it is told.

Each test runs a broken mode it must catch:
- cards stored in the clear: a store reader gets the address and the segment descriptor;
- cards read without their MAC: a stranger's card is adopted;
- the message MAC not checked: a forged ABORT_ACK releases a quarantine held for a live
  writer, a forged PLAN or NOTICE is handled;
- a runtime that remembers no sequence number: a replayed message is taken twice;
- exit records read without their MAC: a stranger's record proves a live writer gone;
- a front door without the key check: /status answers a stranger;
- the store as torch creates it: reachable through another address of this host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import msgpack
import pytest
from test_protocol_units import _card, _routed

from kvferry.cluster import messages as m
from kvferry.cluster import rendezvous
from kvferry.cluster import runtime as runtime_mod
from kvferry.cluster import trust as trusts
from kvferry.cluster.chunks import PAGES_PER_CHUNK, TOKENS_PER_CHUNK
from kvferry.cluster.decode import DecodeRank
from kvferry.cluster.frontdoor import FrontDoor
from kvferry.cluster.harness import localcluster
from kvferry.cluster.launch import use_cluster_interface
from kvferry.cluster.receive import DEDUP_WINDOW, SeqWindow
from kvferry.cluster.rendezvous import (
    CardRefused,
    ExitRecord,
    RankCard,
    RendezvousError,
    card_key,
    exit_key,
    gather,
    publish,
    publish_exit,
    publish_failure,
)
from kvferry.cluster.runtime import RankRuntime
from kvferry.cluster.trust import MESSAGE_TAG_BYTES, TAG_BYTES, Trust
from kvferry.engine.models import ReplayConfig, ReplayModel
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol.proof import Proof
from kvferry.engine.protocol.words import Kind
from kvferry.transfer import BatchStatus, TransferConfig, TransferEngine
from kvferry.transfer.protocol import MAX_PAYLOAD

SEGMENT = b"segment-descriptor:base=0x7f00,rkey=SECRET-RKEY-0123456789"
ADDRESS = b"ucx-worker-address:10.0.0.7:SECRET-0123456789"


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _stranger(store):
    """A plain torch TCPStore client of the cluster's store: no secret, no kvferry."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))


class _Done:
    error = None

    def peek(self) -> BatchStatus:
        return BatchStatus.COMPLETED


class _Engine:
    """What RankRuntime asks of its transfer engine; what it sends is kept."""

    incarnation = 7

    def __init__(self) -> None:
        self.sent: list[tuple[object, bytes]] = []
        self.handler = None
        self.counters = SimpleNamespace(malformed_messages=0)

    def set_message_handler(self, fn) -> None:
        self.handler = fn

    def connect(self, address: bytes, name: str = "") -> object:
        return address

    def peer_alive(self, peer) -> bool:
        return True

    def send(self, peer, payload: bytes) -> _Done:
        self.sent.append((peer, payload))
        return _Done()

    notify = send

    def quiesce(self, peer) -> _Done:
        return _Done()

    def progress(self, timeout_s: float = 0, stay_awake: bool = False, drain_us: int = 0) -> int:
        return 0

    def close(self, peer, force: bool = False) -> None:
        pass

    def failure_horizon(self):
        return SimpleNamespace(seconds=4.0)


def _cards(writer_host: str = "h") -> dict[int, RankCard]:
    cards = {r: dataclasses.replace(_card(r, role), incarnation=7) for r, role in
             ((0, "router"), (1, "prefill"), (2, "decode"))}  # fmt: skip
    cards[0] = dataclasses.replace(cards[0], address=b"r0")
    cards[1] = dataclasses.replace(cards[1], host=writer_host, pid=os.getpid(), address=b"w1")
    cards[2] = dataclasses.replace(cards[2], address=b"d2")
    return cards


def _forged(kind, src: int = 1, inc: int = 7, seq: int = 1, key: Trust | None = None, **fields):
    """What a stranger sends: a well-formed message claiming to be rank ``src``, with a tag
    made without the cluster's secret (another key's, or 32 random bytes)."""
    encoded = m.encode(kind.make(src=src, inc=inc, seq=seq, **fields))
    if key is not None:
        return key.seal(2, 7, encoded)
    return encoded + os.urandom(MESSAGE_TAG_BYTES)


def _unchecked(monkeypatch) -> None:
    """Broken mode: the receiver strips the tag without checking it."""
    monkeypatch.setattr(
        Trust, "opener", lambda self, dst, inc: lambda payload: payload[:-MESSAGE_TAG_BYTES]
    )


FIELDS = {
    "ABORT_ACK": dict(rid="r1"),
    "PLAN": dict(rid="r1", offset=0, total=1, pages=[3], generations=[1]),
    "NOTICE": dict(
        rid="r1", tokens=16, offset=0, total=1, pages=[3], generations=[1], checksums=[],
        bytes=64,
    ),
}  # fmt: skip


# ---------------------------------------------------------------- the envelope
def test_a_sealed_message_opens_only_at_its_destination_incarnation():
    trust, other = Trust.generate(), Trust.generate()
    data = m.encode(m.ABORT_ACK.make(src=1, inc=7, seq=1, rid="r"))
    sealed = trust.seal(2, 7, data)
    assert len(sealed) == len(data) + MESSAGE_TAG_BYTES
    assert bytes(trust.opener(2, 7)(sealed)) == data
    assert trust.opener(2, 8)(sealed) is None  # a restarted receiver: a replay to it
    assert trust.opener(3, 7)(sealed) is None  # another rank: recorded on its way to 2
    assert other.opener(2, 7)(sealed) is None  # another cluster's secret
    assert trust.opener(2, 7)(data) is None  # no tag at all
    flipped = bytearray(sealed)
    flipped[5] ^= 1
    assert trust.opener(2, 7)(bytes(flipped)) is None
    assert "fingerprint" in repr(trust) and trust.fingerprint != other.fingerprint


def test_a_short_secret_is_refused_and_never_shown(tmp_path):
    with pytest.raises(trusts.TrustError, match="at least 32") as info:
        Trust(b"hunter2-hunter2")
    assert "hunter2" not in str(info.value)
    with pytest.raises(trusts.TrustError, match="no cluster secret"):
        trusts.load(None, env={})
    path = tmp_path / "secret"
    path.write_text(trusts.generate_secret() + "\n")
    path.chmod(0o644)
    data, warning = trusts.read_secret_file(str(path))
    assert len(data) == 64 and warning is not None and "chmod 600" in warning
    loaded, source = trusts.load(None, env={trusts.SECRET_FILE_ENV: str(path)})
    assert source == str(path) and loaded.fingerprint == Trust(data).fingerprint


def test_the_largest_control_message_fits_with_its_tag():
    """The tag's 32 bytes never push a chunked message past the engine's 4 MiB limit."""
    big = [2**63 - 1] * PAGES_PER_CHUNK
    worst = 2**63 - 1
    rid = "r" * m.MAX_REQUEST_ID
    header = dict(src=2**31, inc=2**64 - 1, seq=2**64 - 1)
    for msg in (
        m.PREFILL.make(**header, rid=rid, tokens=b"\xff" * (4 * TOKENS_PER_CHUNK), offset=worst,
                       total=worst, owner=worst, owner_inc=2**64 - 1),
        m.PLAN.make(**header, rid=rid, offset=worst, total=worst, pages=big, generations=big),
        m.NOTICE.make(**header, rid=rid, tokens=worst, offset=worst, total=worst, pages=big,
                      generations=big, checksums=big, bytes=worst, prefill_ms=1e300),
    ):  # fmt: skip
        assert len(m.encode(msg)) + MESSAGE_TAG_BYTES < MAX_PAYLOAD, msg.kind


# ---------------------------------------------------------------- the store
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "broken-plain"])
def test_a_store_reader_without_the_secret_learns_no_address_or_key(sealed, store, monkeypatch):
    if not sealed:
        monkeypatch.setattr(rendezvous, "seal_card", lambda card, trust: card.pack())
    trust = Trust.generate()
    card = dataclasses.replace(_card(2, "decode"), address=ADDRESS, segment=SEGMENT)
    publish(store, card, trust)
    raw = bytes(_stranger(store).get(card_key(2)))
    if not sealed:
        leaked = RankCard.unpack(raw)  # the test sees what a stranger would take
        assert leaked.segment == SEGMENT and leaked.address == ADDRESS
        return
    for plain in (ADDRESS, SEGMENT, b"SECRET-RKEY", b"capacity_tokens"):
        assert plain not in raw
    with pytest.raises(RendezvousError):
        RankCard.unpack(raw)
    form, sealed_bytes = msgpack.unpackb(raw[:-TAG_BYTES])
    assert form == rendezvous.SEALED_CARD and isinstance(sealed_bytes, bytes)
    with pytest.raises(CardRefused):
        rendezvous.open_card(raw, Trust.generate(), 2)  # another secret opens nothing
    assert rendezvous.open_card(raw, trust, 2) == card


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_a_card_written_without_the_secret_is_refused_and_counted(checked, store, monkeypatch):
    if not checked:  # a store with no trust in it: cards in the clear, read as they are
        monkeypatch.setattr(rendezvous, "seal_card", lambda card, trust: card.pack())
        monkeypatch.setattr(
            rendezvous, "open_card", lambda data, trust, rank: RankCard.unpack(bytes(data))
        )
    trust = Trust.generate()
    cards = _cards()
    for card in cards.values():
        publish(store, card, trust)
    rt = RankRuntime(2, _Engine(), dict(cards), store=store, trust=trust)
    forged = dataclasses.replace(cards[1], incarnation=9, address=b"stranger", pid=1)
    stranger = _stranger(store)
    stranger.set(card_key(1), forged.pack())  # a card in the clear, as a stranger can write
    stranger.add(rendezvous.EPOCH_KEY, 1)
    replaced = rt.refresh_cards()
    if not checked:
        assert replaced == [1] and rt.cards[1].address == b"stranger"  # the test sees it
        return
    assert replaced == [] and rt.cards[1].address == b"w1"
    assert rt.counters.cards_refused == 1
    with pytest.raises(CardRefused, match="rank 1's card"):
        gather(store, 3, timeout_s=1, trust=trust)
    # another cluster's secret is a stranger too
    publish(store, forged, Trust.generate())
    assert rt.refresh_cards() == [] and rt.counters.cards_refused == 2


def test_a_failure_record_without_the_secret_stops_no_start(store):
    trust = Trust.generate()
    for card in _cards().values():
        publish(store, card, trust)
    _stranger(store).set(f"{rendezvous.FAIL_PREFIX}1", b"stop, says a stranger")
    assert sorted(gather(store, 3, timeout_s=5, trust=trust)) == [0, 1, 2]
    publish_failure(store, 1, "pool too small", trust)
    with pytest.raises(RendezvousError, match="rank 1: pool too small"):
        gather(store, 3, timeout_s=5, trust=trust)


# ---------------------------------------------------------------- exit records
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_an_exit_record_without_a_valid_mac_fences_nothing(checked, store, monkeypatch):
    """A live writer on another host: a stranger's exit record for it (in the clear, or
    MAC'd with another secret) is no proof it is gone, and marks nothing exited. Broken
    mode: records read without their MAC, and the stranger fences the live writer."""
    if not checked:
        monkeypatch.setattr(
            rendezvous, "open_exit", lambda value, trust: ExitRecord.unpack(bytes(value)[:-32])
        )
    clock = [1000.0]
    monkeypatch.setattr(runtime_mod.time, "monotonic", lambda: clock[0])
    trust = Trust.generate()
    rt = RankRuntime(2, _Engine(), _cards(writer_host="far"), store=store, trust=trust)
    record = ExitRecord(
        rank=1, incarnation=7, pid=os.getpid(), host="far", status=-9, at=time.time()
    )  # the writer's card: this process's pid, on host "far"
    stranger = _stranger(store)
    for n, value in enumerate(
        (record.pack() + b"\0" * 32, rendezvous.sign_exit(record, Trust.generate()))
    ):
        stranger.set(exit_key(1, 7), value)
        stranger.set(f"{rendezvous.EXIT_LOG_PREFIX}{n + 1}", value)
        stranger.add(rendezvous.EXIT_COUNT_KEY, 1)
        fresh = rt.poll_exits()
        clock[0] += 100
        proof = rt.write_path_closed(1, 7)
        clock[0] += 100
        proof = proof or rt.write_path_closed(1, 7)
        if not checked:
            assert fresh and rt.process_exited(1) and proof is Proof.EXIT_RECORD  # caught
            return
        assert fresh == [] and not rt.process_exited(1) and proof is None
    assert rt.exit_log.refused == 2 and rt.counters.exit_records_refused >= 2
    publish_exit(store, record, trust)  # the writer's own launcher says so
    assert [r.rank for r in rt.poll_exits()] == [1] and rt.process_exited(1)


# ---------------------------------------------------------------- control messages
@pytest.mark.parametrize("kind", [m.ABORT_ACK, m.PLAN, m.NOTICE], ids=lambda k: k.name)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_a_forged_message_is_dropped_counted_and_logged_once_per_sender(
    kind, checked, monkeypatch, caplog
):
    if not checked:
        _unchecked(monkeypatch)
    rt = RankRuntime(2, _Engine(), _cards(), trust=Trust.generate())
    handled: list[str] = []
    rt.set_handlers({k: lambda msg: handled.append(msg.kind) for k in Kind}, role="test")
    with caplog.at_level(logging.WARNING, logger="kvferry.cluster"):
        rt._on_payload(b"stranger-a", _forged(kind, seq=1, **FIELDS[kind.name]))
        rt._on_payload(
            b"stranger-a", _forged(kind, seq=2, key=Trust.generate(), **FIELDS[kind.name])
        )
        rt._on_payload(
            b"stranger-b", _forged(kind, seq=3, **FIELDS[kind.name])[:-MESSAGE_TAG_BYTES]
        )
    if not checked:
        assert handled == [kind.name] * 2  # the test sees forged messages acted on
        return
    assert handled == [] and rt.counters.dropped_unauthenticated == 3
    assert rt.dropped()["unauthenticated"] == 3 and rt.counters.received == 0
    logged = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(logged) == 2  # once per sender address
    # the same message from a rank with the secret is taken
    rt._on_payload(
        b"rank1", rt.seal_to_self(m.encode(kind.make(src=1, inc=7, seq=4, **FIELDS[kind.name])))
    )
    assert handled == [kind.name]


def _quarantined_owner(trust: Trust) -> tuple[DecodeRank, RankRuntime, _Engine]:
    """Decode rank 2 over a real RankRuntime: request r1 assigned (writer 1, alive on
    this host), then aborted by the router: its pages quarantined until writer 1 acks."""
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    engine = _Engine()
    rt = RankRuntime(2, engine, _cards(), trust=trust)
    owner = DecodeRank.serving(
        rt, model, KVPool(model.pool_config(16, 64)), router=0, transfer_timeout_s=30,
        abort_deadline_s=30, integrity=False,
    )  # fmt: skip

    def from_router(kind, seq: int, **fields) -> None:
        rt._on_payload(
            b"rank0", rt.seal_to_self(m.encode(kind.make(src=0, inc=7, seq=seq, **fields)))
        )

    from_router(m.ASSIGN, 1, rid="r1", prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    from_router(m.ABORT, 2, rid="r1", owner=2, writers=[1], source="client", reason="gone")
    for _ in range(3):
        rt.pump(0)
    assert owner.allocator.counts()["quarantined"] == 3
    return owner, rt, engine


def _sent_kinds(trust: Trust, engine: _Engine, rt: RankRuntime) -> list[str]:
    kinds = []
    for peer, payload in engine.sent:
        rank = next(r for r, c in rt.cards.items() if c.address == peer)
        kinds.append(m.decode(bytes(trust.opener(rank, 7)(payload))).kind)
    return kinds


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_a_forged_abort_ack_leaves_the_quarantine_held(checked, monkeypatch):
    """The attack of the issue: a stranger who read a card acks the abort as the live
    writer. Dropped and counted, the pages stay quarantined. Broken mode (the MAC not
    checked): the forged ack releases them while the writer may still write."""
    if not checked:
        _unchecked(monkeypatch)
    trust = Trust.generate()
    owner, rt, engine = _quarantined_owner(trust)
    engine.sent.clear()
    rt._on_payload(b"stranger", _forged(m.ABORT_ACK, src=1, inc=7, seq=1, rid="r1"))
    for _ in range(3):
        rt.pump(0)
    if not checked:
        assert owner.allocator.counts()["quarantined"] == 0  # the test sees the release
        return
    assert owner.allocator.counts()["quarantined"] == 3
    assert rt.counters.dropped_unauthenticated == 1
    assert "RELEASED" not in _sent_kinds(trust, engine, rt)
    # the writer's own ack, sealed with the secret, releases them
    rt._on_payload(
        b"rank1", rt.seal_to_self(m.encode(m.ABORT_ACK.make(src=1, inc=7, seq=1, rid="r1")))
    )
    for _ in range(3):
        rt.pump(0)
    assert owner.allocator.counts()["quarantined"] == 0
    assert "RELEASED" in _sent_kinds(trust, engine, rt)


@pytest.mark.parametrize("remembered", [True, False], ids=["remembered", "broken-forgets"])
def test_a_replayed_message_is_refused(remembered, monkeypatch):
    """A message sent by a rank with the secret, recorded and delivered again, is refused
    by the sequence checks: at once (the dedup window) and after more messages than the
    window holds (the floor under it). Broken mode: a runtime that remembers no sequence
    number takes the replay again."""
    if not remembered:
        monkeypatch.setattr(SeqWindow, "take", lambda self, inc, seq: True)
    trust = Trust.generate()
    rt = RankRuntime(2, _Engine(), _cards(), trust=trust)
    handled: list[int] = []
    rt.set_handlers({k: lambda msg: handled.append(msg.seq) for k in Kind}, role="test")
    writer = RankRuntime(1, _Engine(), _cards(), trust=trust)
    recorded = writer._fill(2, m.ABORT_ACK, dict(rid="r1"))  # as it goes on the wire
    rt._on_payload(b"rank1", recorded)
    rt._on_payload(b"rank1", recorded)
    if not remembered:
        assert handled == [1, 1]  # the test sees the replay taken
        return
    assert handled == [1] and rt.counters.dropped_duplicate == 1
    for _ in range(DEDUP_WINDOW + 10):
        rt._on_payload(b"rank1", writer._fill(2, m.ABORT_ACK, dict(rid="r1")))
    assert len(handled) == DEDUP_WINDOW + 11
    rt._on_payload(b"rank1", recorded)  # older than the window holds
    assert len(handled) == DEDUP_WINDOW + 11 and rt.counters.dropped_duplicate == 2
    # sealed for rank 2: refused by rank 3, and by a restarted rank 2
    for rank, incarnation in ((3, 7), (2, 8)):
        engine = _Engine()
        engine.incarnation = incarnation
        other = RankRuntime(rank, engine, _cards(), trust=trust)
        other.set_handlers({k: lambda msg: handled.append(-1) for k in Kind}, role="test")
        other._on_payload(b"rank1", writer._fill(2, m.ABORT_ACK, dict(rid="r2")))
        assert other.counters.dropped_unauthenticated == 1
    assert -1 not in handled


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-unchecked"])
def test_a_forged_message_over_a_real_endpoint_is_dropped(checked, monkeypatch):
    """A stranger's engine connects to a rank's UCX address (read from an old card, say)
    and sends a PLAN and an ABORT_ACK as rank 1: dropped and counted on arrival. A rank with
    the secret, over the same endpoint, is heard."""
    if not checked:
        _unchecked(monkeypatch)
    trust = Trust.generate()
    with (
        TransferEngine(TransferConfig(transports="shm", name="stranger")) as a,
        TransferEngine(TransferConfig(transports="shm", name="rank2")) as b,
    ):
        cards = _cards()
        cards[2] = dataclasses.replace(cards[2], incarnation=b.incarnation, address=b.address)
        cards[1] = dataclasses.replace(cards[1], incarnation=a.incarnation, address=a.address)
        rt = RankRuntime(2, b, cards, trust=trust)
        handled: list[str] = []
        rt.set_handlers({k: lambda msg: handled.append(msg.kind) for k in Kind}, role="test")
        peer = a.connect(b.address)
        forged = [
            _forged(m.PLAN, src=1, inc=a.incarnation, seq=1, **FIELDS["PLAN"]),
            _forged(m.ABORT_ACK, src=1, inc=a.incarnation, seq=2, **FIELDS["ABORT_ACK"]),
        ]
        for payload in forged:
            a.send(peer, payload)
        deadline = time.monotonic() + 10
        while rt.counters.dropped_unauthenticated + len(handled) < 2:
            assert time.monotonic() < deadline, "not delivered within 10 s"
            a.progress(0)
            rt.pump(0)
        if not checked:
            assert handled == ["PLAN", "ABORT_ACK"]  # the test sees them handled
            return
        assert handled == [] and rt.counters.dropped_unauthenticated == 2
        insider = trust.seal(
            2, b.incarnation, m.encode(m.ABORT_ACK.make(src=1, inc=a.incarnation, seq=3, rid="r"))
        )
        a.send(peer, insider)
        while not handled:
            assert time.monotonic() < deadline, "not delivered within 10 s"
            a.progress(0)
            rt.pump(0)
        assert handled == ["ABORT_ACK"]


# ---------------------------------------------------------------- listeners
def _other_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for addr in out.split():
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", addr) and not addr.startswith("127."):
            return addr
    return None


def _refused(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=3):
            return False
    except (ConnectionRefusedError, TimeoutError, OSError):
        return True


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "broken-torch-default"])
def test_the_store_listens_on_loopback_only(bound, tmp_path):
    addr = _other_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address to connect from")
    if not bound:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        assert not _refused(addr, store.port)  # torch's own listens everywhere: caught
        return
    port = localcluster.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry.cluster.store", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while _refused("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() < deadline, "the store never listened"
            time.sleep(0.2)
        assert _refused(addr, port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_cluster_interface_is_every_rank_ucx_devices():
    env: dict[str, str] = {"UCX_NET_DEVICES": "lo"}
    warning = use_cluster_interface("mlx5_0:1,lo", env)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1,lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert warning is not None and "replaces UCX_NET_DEVICES=lo" in warning
    untouched: dict[str, str] = {}
    assert use_cluster_interface(None, untouched) is None and untouched == {}


# ---------------------------------------------------------------- the front door
async def _get(url: str, path: str, key: str | None = None, method: str = "GET") -> int:
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, url + path, headers=headers, json={"prompt": "hi"} if method == "POST" else None
        ) as resp,
    ):
        return resp.status


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "broken-open"])
def test_the_front_door_answers_401_without_the_key(keyed):
    router, _ = _routed()
    submitted: list = []

    async def submit(prompt, max_tokens):
        submitted.append(prompt)
        raise RuntimeError("not reached in this test")

    router.submit = submit  # type: ignore[method-assign]

    async def run() -> dict:
        from aiohttp import web

        out = {}
        for open_metrics in (False, True):
            door = FrontDoor(router, api_key="k-123" if keyed else None, open_metrics=open_metrics)
            runner = web.AppRunner(door.app)
            await runner.setup()
            port = localcluster.free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            url = f"http://127.0.0.1:{port}"
            try:
                out[open_metrics] = {
                    "health": await _get(url, "/health"),
                    "status": await _get(url, "/status"),
                    "metrics": await _get(url, "/metrics"),
                    "capacity": await _get(url, "/capacity"),
                    "wrong": await _get(url, "/status", key="k-12"),
                    "keyed": await _get(url, "/status", key="k-123"),
                    "post": await _get(url, "/v1/completions", method="POST"),
                }
                addr = _other_address()
                out[open_metrics]["elsewhere"] = addr is None or _refused(addr, port)
            finally:
                await runner.cleanup()
        return out

    got = asyncio.run(run())
    if not keyed:
        assert got[False]["status"] == 200  # the test sees a stranger served
        return
    closed, opened = got[False], got[True]
    assert closed["health"] in (200, 503)  # always open
    assert [closed[k] for k in ("status", "metrics", "capacity", "wrong", "post")] == [401] * 5
    assert closed["keyed"] == 200 and closed["elsewhere"]
    assert [opened[k] for k in ("status", "metrics", "capacity")] == [200] * 3
    assert opened["post"] == 401 and submitted == []


# ---------------------------------------------------------------- start-up
def test_a_rank_without_a_secret_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k not in trusts.SECRET_VARIABLES}
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry.cluster.launch"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "no cluster secret" in proc.stderr, proc.stderr[-2000:]
    several = subprocess.run(
        [sys.executable, "-m", "kvferry.cluster.domains", "--nproc", "1", "--world", "3",
         "--first-rank", "1", "--store", "10.0.0.1:29400"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert several.returncode == 2 and "several hosts needs one secret" in several.stderr


# ---------------------------------------------------------------- a real cluster
@pytest.mark.slow
def test_a_cluster_of_failure_domains_serves_with_its_secret_and_key(tmp_path):
    """Through the real path (store process, launchers, sealed cards, MAC'd messages): a
    completion with the key is 200, without it 401; a store reader finds no card it can
    read, and a card it writes is refused by every rank, which keep serving."""
    cluster = localcluster.start_domains(1, 1, ["--context-length", "2048", "--pool-tokens",
                                                "8192"], tmp_path, api_key="the-key")  # fmt: skip
    try:
        ok = cluster.complete("hello there", 4)
        assert ok.status == 200, ok
        req = urllib.request.Request(
            cluster.url + "/v1/completions", data=b'{"prompt": "x"}', method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 401
        port = int(re.search(r"store listening on 127\.0\.0\.1:(\d+)", cluster.log.read_text())[1])
        stranger = _stranger(SimpleNamespace(port=port))
        for rank in range(3):
            raw = bytes(stranger.get(card_key(rank)))
            with pytest.raises(RendezvousError):
                RankCard.unpack(raw)
        forged = dataclasses.replace(_card(1, "prefill"), incarnation=99, address=b"stranger")
        stranger.set(card_key(1), forged.pack())
        stranger.add(rendezvous.EPOCH_KEY, 1)
        deadline = time.monotonic() + 20
        while cluster.status()["router"]["cards_refused"] == 0:
            assert time.monotonic() < deadline, "the router never read the forged card"
            time.sleep(0.3)
        assert cluster.complete("after the forgery", 4).status == 200
        assert "1" not in cluster.status()["unhealthy"]
        text = cluster.log.read_text()
        assert cluster.secret and cluster.secret not in text and "the-key" not in text
        assert "cluster secret from KVFERRY_SECRET (fingerprint" in text
    finally:
        cluster.stop()


def test_a_message_from_a_rank_without_a_card_is_dropped_as_stale():
    """An authenticated message naming a sender rank this rank has no card of (its card
    not read yet, or a rank of another topology) is dropped as stale, not raised out of
    the receive path."""
    rt = RankRuntime(2, _Engine(), _cards(), trust=Trust.generate())
    rt.set_handlers({k: lambda msg: None for k in Kind}, role="test")
    encoded = m.encode(m.ABORT_ACK.make(src=5, inc=7, seq=1, rid="r1"))
    rt._on_payload(b"rank5", rt.seal_to_self(encoded))
    assert rt.counters.dropped_stale == 1


@pytest.mark.parametrize("ordered", [True, False], ids=["by-publish-time", "broken-any-new"])
def test_an_old_card_written_back_does_not_take_a_live_incarnations_place(
    store, monkeypatch, ordered
):
    """A store client without the secret records rank 1's sealed card (incarnation 7),
    and once rank 1 has restarted (incarnation 9) writes it back and moves the epoch. A
    rank that knows incarnation 9 keeps it (the replayed card was published before it)
    and goes on hearing the live rank 1. Broken mode: any card of another incarnation
    adopted; 9 is retired, and the live rank's messages are dropped as stale for good."""
    if not ordered:
        monkeypatch.setattr(runtime_mod, "published_after", lambda card, old: True)
    trust = Trust.generate()
    cards = {r: dataclasses.replace(c, published_ns=1000) for r, c in _cards().items()}
    for card in cards.values():
        rendezvous.publish(store, card, trust)
    stranger = _stranger(store)
    recorded = stranger.get(rendezvous.card_key(1))  # incarnation 7, as sealed
    live = dataclasses.replace(cards[1], incarnation=9, address=b"w1-new", published_ns=2000)
    rendezvous.publish(store, live, trust)
    rt = RankRuntime(2, _Engine(), {**cards, 1: live}, store=store, trust=trust)
    handled: list[int] = []
    rt.set_handlers({k: lambda msg: handled.append(msg.src) for k in Kind}, role="test")
    stranger.set(rendezvous.card_key(1), recorded)  # the replay
    stranger.add(rendezvous.EPOCH_KEY, 1)
    rt.refresh_cards()
    writer_engine = _Engine()
    writer_engine.incarnation = 9
    writer = RankRuntime(1, writer_engine, {**cards, 1: live}, trust=trust)
    rt._on_payload(b"rank1", writer._fill(2, m.ABORT_ACK, dict(rid="r1")))
    if not ordered:
        assert rt.cards[1].incarnation == 7 and handled == []  # the test catches it
        return
    assert rt.cards[1].incarnation == 9 and handled == [1]
    assert rt.counters.cards_refused == 1


def test_a_new_card_is_published_after_the_one_it_replaces(store):
    """A rank restarted on a host whose clock is behind the last one's still publishes
    a card its peers take as newer."""
    trust = Trust.generate()
    ahead = dataclasses.replace(_cards()[1], published_ns=time.time_ns() + 10**12)
    rendezvous.publish(store, ahead, trust)
    assert rendezvous.card_after(store, 1, trust) == ahead.published_ns + 1
    assert rendezvous.card_after(store, 5, trust) <= time.time_ns()  # no card yet: now
