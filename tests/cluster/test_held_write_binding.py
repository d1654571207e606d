"""A write in flight is bound to the owner incarnation it was posted to (I4, I5).

Real processes and real endpoints, no cluster: the test process is a writer rank (its
``RankRuntime`` over a real engine and a rendezvous store); the owner is a target
process (``tests/transfer/transfer_peer.py``) that is killed and replaced by a new
incarnation, whose pages then hold request B. The order that once made the fault
suite's safe row leak is forced here, step by step, instead of raced: A's second half
held in flight, the owner killed, the new incarnation published and adopted, B placed
on the same pages, then A's held half lands. B must stay B. Broken mode: a held write
that re-resolves its owner at landing (``HeldWrite.rebind_at_landing``) lands A's bytes
in B's pages, and the test sees B foreign.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from kvferry.cluster.faults import FaultPlan, HeldWrite
from kvferry.cluster.rendezvous import RankCard, publish
from kvferry.cluster.runtime import RankRuntime
from kvferry.engine.tokenizer import encode
from kvferry.transfer import BatchStatus, SegmentDescriptor, TransferConfig, TransferEngine
from kvferry.transfer.errors import TransferError

_spec = importlib.util.spec_from_file_location(
    "transfer_targets", Path(__file__).resolve().parents[1] / "transfer" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_targets = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _targets  # dataclasses look the module up by name
_spec.loader.exec_module(_targets)  # the transfer tests' target process
start_target, stop = _targets.start_target, _targets.stop

PAGE = 4096
PAGES = 8
MARK = "~held.binding~"
A_BYTE, B_BYTE = 0xA5, 0x5B


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _card(rank: int, role: str, address: bytes, segment: bytes | None, inc: int, pid: int):
    return RankCard(
        rank=rank,
        role=role,
        address=address,
        incarnation=inc,
        segment=segment,
        num_pages=PAGES,
        page_size=16,
        capacity_tokens=0,
        context_length=0,
        host=socket.gethostname(),
        pid=pid,
    )


def _owner_card(target) -> RankCard:
    seg = bytes.fromhex(target.hello["segment"])
    inc = SegmentDescriptor.unpack(seg).incarnation
    return _card(1, "decode", target.address, seg, inc, target.hello["pid"])


def _wait(rt: RankRuntime, batch, what: str) -> BatchStatus:
    for _ in range(2000):
        status = batch.peek()
        if status is not BatchStatus.PENDING:
            return status
        rt.engine.progress(0.005)
    raise TimeoutError(f"{what} did not settle within 10 s")


def _pages_at(rt: RankRuntime, triples: np.ndarray) -> np.ndarray:
    """What the owner's current incarnation holds at the triples' remote offsets."""
    dst = rt.engine.allocate(PAGE * PAGES)
    reads = triples.copy()
    reads[:, 0] = reads[:, 1]  # read each remote page to the same offset here
    batch = rt.engine.read(rt.peer(1), dst, rt.remote_segment(1), reads)
    assert _wait(rt, batch, "the read-back") is BatchStatus.COMPLETED
    view = dst.as_numpy()
    return np.concatenate([view[r : r + n] for _, r, n in reads.tolist()])


@pytest.mark.parametrize("transports", ["tcp", "shm"])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "broken-rebinds-at-landing"])
def test_a_held_write_never_lands_in_a_restarted_owner(bound, transports, store, monkeypatch):
    if not bound:
        monkeypatch.setattr(HeldWrite, "rebind_at_landing", True)
    first = start_target(transports, size=PAGE * PAGES)
    second = None
    eng = TransferEngine(TransferConfig(transports=transports, name="writer"))
    try:
        cards = {1: _owner_card(first)}
        publish(store, cards[1])
        plan = FaultPlan.parse([f"at:mid-transfer:pause:{MARK}:600"])
        rt = RankRuntime(0, eng, cards, plan, store=store)
        a_src = eng.register(np.full(PAGE * PAGES, A_BYTE, dtype=np.uint8))
        triples = np.array([[i * PAGE, i * PAGE, PAGE] for i in range(PAGES)], dtype=np.int64)
        tokens = np.asarray(encode(MARK + " the prompt of A"), dtype=np.int32)
        old_inc = cards[1].incarnation

        # A: the first half posted and landed, the second half held in flight.
        now, held = plan.hold_in_flight(rt, "A", tokens, 1, a_src, triples, "mid-transfer")
        assert held is not None and len(now) == PAGES // 2
        first_half = rt.write(1, a_src, now, rid="A", incarnation=old_inc)
        assert _wait(rt, first_half, "A's first half") is BatchStatus.COMPLETED

        # The owner is killed; its job restarts it; the writer adopts the new card.
        stop(first.proc)
        second = start_target(transports, size=PAGE * PAGES)
        publish(store, _owner_card(second))
        assert rt.refresh_cards() == [1]
        new_inc = rt.cards[1].incarnation
        assert new_inc != old_inc

        # A's pages were allocated by the old incarnation: nothing more goes there.
        with pytest.raises(TransferError, match="allocated by incarnation"):
            rt.write(1, a_src, triples[:1], rid="A", incarnation=old_inc)

        # B is placed on the same pages of the new incarnation and written whole.
        b_src = eng.register(np.full(PAGE * PAGES, B_BYTE, dtype=np.uint8))
        b_write = rt.write(1, b_src, triples, rid="B", incarnation=new_inc)
        assert _wait(rt, b_write, "B's write") is BatchStatus.COMPLETED
        assert held.landed  # B's write to the same owner landed it right after
        landed = _wait(rt, held, "A's held half")

        b_pages = _pages_at(rt, triples)
        foreign = int((b_pages == A_BYTE).sum())
        if not bound:
            assert foreign > 0, "the broken seam re-targeted nothing: the test cannot fail"
            return
        assert foreign == 0, f"{foreign} bytes of A's held write landed in B's pages"
        assert bool((b_pages == B_BYTE).all())
        assert landed is BatchStatus.FAILED
        assert f"{old_inc:#x}" in str(held.error) and "gone" in str(held.error)
    finally:
        eng.shutdown()
        for target in (first, second):
            if target is not None:
                stop(target.proc)


# ---------------------------------------------------------------- the production path
class _Pending:
    """A posted batch that settles when the test says so."""

    error = None

    def __init__(self, done: bool = False) -> None:
        self.state = BatchStatus.COMPLETED if done else BatchStatus.PENDING

    def peek(self) -> BatchStatus:
        return self.state

    status = peek


class _RecordingEngine:
    """The engine under a real RankRuntime: each write recorded with the incarnation of
    the segment it was posted into; control messages complete at once."""

    incarnation = 3

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, _Pending]] = []  # (incarnation, rows, batch)
        self.closed: list = []

    def set_message_handler(self, fn) -> None:
        self.handler = fn

    def connect(self, address: bytes, name: str = "") -> object:
        return object()

    def peer_alive(self, peer) -> bool:
        return peer not in self.closed

    def close(self, peer, force: bool = False) -> None:
        self.closed.append(peer)

    def open_segment(self, peer, desc, expected_incarnation=None):
        descriptor = type("Descriptor", (), {"incarnation": expected_incarnation})()
        return type("Remote", (), {"descriptor": descriptor, "direct": None})()

    def write(self, peer, seg, remote, pages) -> _Pending:
        batch = _Pending()
        self.writes.append((remote.descriptor.incarnation, len(pages), batch))
        return batch

    def send(self, peer, payload: bytes) -> _Pending:
        return _Pending(done=True)

    notify = send

    def quiesce(self, peer) -> _Pending:
        return _Pending(done=True)

    def progress(self, timeout_s: float = 0, stay_awake: bool = False, drain_us: int = 0) -> int:
        return 0


@pytest.mark.parametrize(
    "guards",
    ["contract", "runtime-guard-alone", "broken-no-guard"],
)
def test_no_batch_of_a_job_goes_to_an_owner_incarnation_that_did_not_allocate_its_pages(
    guards, store, monkeypatch
):
    """A writer posts a job in one-row batches; the owner restarts between the first and
    the second. Nothing after the restart may go to the new incarnation: the writer fails
    the job when it adopts the new card (``_on_card_replaced``), and ``RankRuntime.write``
    refuses a write for the old incarnation whatever the role does. With the role's guard
    off the runtime's still holds (``runtime-guard-alone``). Broken mode: both off, the
    second batch goes into the new incarnation's pool, and the test sees it."""
    from kvferry.cluster import messages as m
    from kvferry.cluster.prefill import PrefillRank
    from kvferry.engine.models import ReplayConfig, ReplayModel
    from kvferry.engine.pool import KVPool

    if guards != "contract":
        monkeypatch.setattr(PrefillRank, "_on_card_replaced", lambda self, old, new: None)
    if guards == "broken-no-guard":

        def unguarded(self, rank, local, pages, *, rid, incarnation):
            return self.engine.write(self.peer(rank), local, self.remote_segment(rank), pages)

        monkeypatch.setattr(RankRuntime, "write", unguarded)
    cards = {
        0: _card(0, "router", b"r", None, 5, 1),
        2: _card(2, "decode", b"d", b"segment", 11, 2),
    }
    for card in cards.values():
        publish(store, card)
    engine = _RecordingEngine()
    rt = RankRuntime(1, engine, dict(cards), store=store)  # type: ignore[arg-type]
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    pool = KVPool(model.pool_config(16, 64))
    writer = PrefillRank.serving(rt, model, pool, None, (0, 2), router=0, max_batch_bytes=1)  # type: ignore[arg-type]
    seq = iter(range(1, 100))

    def deliver(kind, src: int, **fields) -> None:
        msg = kind.make(src=src, inc=cards[src].incarnation, seq=next(seq), **fields)
        rt._on_payload(b"", rt.seal_to_self(m.encode(msg)))

    tokens = np.arange(64, dtype="<i4")
    deliver(m.PLAN, 2, rid="A", offset=0, total=4, pages=[5, 6, 7, 8], generations=[1] * 4)
    deliver(
        m.PREFILL, 0, rid="A", tokens=tokens.tobytes(), offset=0, total=64, owner=2, owner_inc=11
    )
    for _ in range(50):
        if engine.writes:
            break
        rt.pump()
    assert [inc for inc, _, _ in engine.writes] == [11]  # the first batch, one row

    publish(store, dataclasses.replace(cards[2], incarnation=13, pid=3))
    assert rt.refresh_cards() == [2]
    engine.writes[0][2].state = BatchStatus.COMPLETED  # the first batch lands
    for _ in range(50):
        rt.pump()
    to_new = [rows for inc, rows, _ in engine.writes if inc != 11]
    if guards == "broken-no-guard":
        assert to_new, "the unguarded writer posted nothing more: the test cannot fail"
        return
    assert to_new == [], f"{sum(to_new)} rows of A went to the owner's new incarnation"
    assert len(engine.writes) == 1
    assert writer.jobs.get("A") is None or writer.jobs["A"].state.name in ("ACKING", "ABORTED")
