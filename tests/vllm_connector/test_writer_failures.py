"""A prefill worker's failures that are its own (cluster/vllm/writer_host.py): each ends its
job through the protocol (the owner told why, the ack after what is in flight, every
staging slot given back), whatever input or thread it came from, and an owner that asks
again is answered again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

from writer_fakes import TOKENS, abort, make_writer, plan, sender

from kvferry.cluster.receive import SeqWindow
from kvferry.cluster.vllm import staging as staging_module
from kvferry.cluster.vllm import wire, writer_host
from kvferry.cluster.vllm.connector import _WorkerSide
from kvferry.cluster.vllm.link import Link
from kvferry.cluster.vllm.metrics import KvferryStats
from kvferry.cluster.vllm.sidechannel import HandshakeKey
from kvferry.cluster.vllm.staging import Staging
from kvferry.engine.protocol.writer import WriterEvent, WriterState
from kvferry.transfer import protocol as transfer_protocol


@pytest.mark.parametrize("broken", [False, True], ids=["cut", "broken-whole"])
def test_a_reason_longer_than_an_abort_carries_is_cut_and_acked(monkeypatch, broken):
    """A job fails with a reason of 10,000 characters (an exception's text): the ABORT
    carries its first 4,096 and the ack follows the batches in flight. Broken mode: the
    reason sent whole does not encode, and the owner is never told (it waits for its
    transfer timeout; where the ack was due in the same row, it never goes)."""
    if broken:
        monkeypatch.setattr(wire, "clip_reason", lambda reason: reason)
    wr = make_writer(monkeypatch)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    failure = RuntimeError("x" * 10_000)
    if broken:
        with pytest.raises(Exception, match="4096"):
            wr.host.fail_request("r", failure)
        wr.settle_all()
        assert not wr.link.of(wire.ABORT)
        return
    wr.host.fail_request("r", failure)
    wr.settle_all()
    (told,) = wr.link.of(wire.ABORT)
    assert len(told["reason"]) == wire.MAX_REASON and told["reason"].endswith("...")
    assert len(wr.link.of(wire.ABORT_ACK)) == 1
    assert wr.host.prompts["r"].jobs[0].book.state is WriterState.ABORTED


def test_a_plan_that_names_many_heads_is_refused_in_a_short_reason(monkeypatch):
    """A PLAN naming 1,500 heads (the wire takes 4,096) is refused; the reason names the
    list's ends and its length, not every head."""
    wr = make_writer(monkeypatch)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS, heads=list(range(1500))))
    wr.settle_all()
    (told,) = wr.link.of(wire.ABORT)
    assert (
        "asks for heads [0, 1, " in told["reason"]
        and "1498, 1499] (1500 of them)" in told["reason"]
    )
    assert len(told["reason"]) < 300
    assert len(wr.link.of(wire.ABORT_ACK)) == 1


def _gather_fails_at(monkeypatch, call: int) -> None:
    real = staging_module.copy_runs
    calls = [0]

    def copy(dst, src, runs, *rest):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("the device said no")
        return real(dst, src, runs, *rest)

    monkeypatch.setattr(staging_module, "copy_runs", copy)


@pytest.mark.parametrize("call", [1, 2], ids=["its-own-gather", "the-gather-ahead"])
@pytest.mark.parametrize("broken", [False, True], ids=["given-back", "broken-kept"])
def test_a_gather_that_fails_fails_its_job_and_gives_its_slot_back(monkeypatch, call, broken):
    """The gather of a staged batch raises on its thread (a CUDA error, a buffer of the
    wrong device): its job fails, the owner is told why with the request, the ack
    follows the batches in flight, and every slot is free again. Broken mode: a slot
    kept after a failed gather, lost to every later request."""
    if broken:
        release = Staging.release
        monkeypatch.setattr(
            Staging,
            "release",
            lambda self, staged: None if staged.ready.exception() else release(self, staged),
        )
    _gather_fails_at(monkeypatch, call)
    wr = make_writer(monkeypatch, staging_slots=2)
    assert wr.staging is not None
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    wr.settle_all()
    (told,) = wr.link.of(wire.ABORT)
    assert told["source"] == "internal" and "RuntimeError: the device said no" in told["reason"]
    assert len(wr.link.of(wire.ABORT_ACK)) == 1
    assert wr.host.prompts["r"].jobs[0].book.state is WriterState.ABORTED
    assert (len(wr.staging.free) == 2) is not broken


@pytest.mark.parametrize("part_bytes", [16384, 1 << 20], ids=["of-a-part", "of-the-load"])
def test_a_failed_batch_tells_the_owner_why(monkeypatch, part_bytes):
    """A batch fails on the wire, in a pipelined load's first part or in a load of one
    part: the owner's ABORT names the transfer and the failure either way."""
    wr = make_writer(monkeypatch, staging_slots=0, part_bytes=part_bytes)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    wr.engine.finish(0, fail=True)
    wr.host.settle()
    wr.settle_all()
    (told,) = wr.link.of(wire.ABORT)
    assert told["source"] == "transfer" and told["reason"].startswith("write failed")


def test_an_owner_that_aborts_again_after_the_job_ended_is_acked_again(monkeypatch):
    """TP 1 -> TP 2: decode worker 0's job ended (landed and noticed; or aborted and
    acked) while worker 1's goes on, so the prompt lives. An ABORT from worker 0 then
    (its retry, the first ack lost) is acked again, over the endpoint it came from."""
    for first in ("landed", "aborted"):
        wr = make_writer(monkeypatch, staging_slots=0, part_bytes=1 << 20)
        wr.hand_over()
        for d in range(2):
            wr.host.on_plan(sender(d), plan(d, wr.dsts[d], TOKENS))
        if first == "aborted":
            wr.host.on_owner_abort(sender(0), abort(0))
        wr.settle_all(rseg=b"x0")
        job = wr.host.prompts["r"].jobs[0]
        ended = WriterState.DONE if first == "landed" else WriterState.ABORTED
        assert job.book.state is ended and "r@tp0" not in wr.host.jobs
        acks = len(wr.link.of(wire.ABORT_ACK))
        wr.host.on_owner_abort(sender(0), abort(0))
        wr.host.settle()
        assert len(wr.link.of(wire.ABORT_ACK)) == acks + 1, first
        assert "r@tp0" not in wr.host.jobs  # ended again, its book let go


@pytest.mark.parametrize("kind", ["PLAN", "NOTICE"])
def test_a_message_a_host_cannot_act_on_fails_its_request_and_the_loop_goes_on(kind):
    """A message that decodes but raises in a host (a bug, or input its checks missed)
    is counted and fails its request on that host, named as that host keys it (a PLAN's
    at the prefill by rid, a NOTICE's at the decode by orid), and the poll goes on."""
    if kind == "PLAN":
        side, calls = _side(sends=True, failing="writer.on_plan")
        payload = wire.encode(
            wire.PLAN, rid="p-1", orid="d-1", blocks=[1], gens=[1], tokens=16, regions={},
            descs=[], tp_rank=0, tp_size=1, kv_heads=4, heads=[0, 1, 2, 3],
        )  # fmt: skip
        want = [("writer.fail_request", "p-1")]
    else:
        side, calls = _side(sends=True, failing="owner.on_notice")
        side.owner.load_from = lambda msg, m: (object(), 0)
        payload = wire.encode(
            wire.NOTICE, rid="p-1", orid="d-1", tokens=16, blocks=[1], gens=[1],
            checksums=[7], bytes=4096,
        )  # fmt: skip
        want = [("owner.fail_request", "d-1")]
    side._on_message(_sealed(side, payload, "peer0"))
    assert calls == want
    assert side.stats.data["internal_errors"] == 1


@pytest.mark.parametrize("broken", [False, True], ids=["after-its-puts", "broken-at-failure"])
def test_a_failed_batch_settles_only_once_its_puts_are_done(monkeypatch, broken):
    """A staged batch fails part way (its post failed after some puts went out, which
    complete later): it settles, and the job fails, once the transport reads its slot no
    more, so no other batch is gathered under those puts and the job's end (which gives
    vLLM its blocks back) waits for them too. Broken mode: settled as it fails, the slot
    back under the puts in flight."""
    wr = make_writer(monkeypatch, staging_slots=2)
    assert wr.staging is not None
    if broken:
        monkeypatch.setattr(type(wr.engine), "reading", lambda self, batch: False)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    failed = wr.engine.finish(0, fail=True, still_reading=2)
    wr.host.settle()
    if broken:
        assert wr.link.of(wire.ABORT) and len(wr.staging.free) == 2  # under the puts
        return
    assert not wr.link.of(wire.ABORT) and not wr.staging.free  # still read, job on hold
    failed.outstanding = 0
    wr.host.settle()
    wr.settle_all()
    assert wr.link.of(wire.ABORT)  # the job failed once its puts ended
    assert len(wr.staging.free) == 2


def _side(sends: bool, failing: str | None = None):
    """A worker side over recording hosts; ``failing``: the host method that raises."""
    calls: list[tuple[str, str | None]] = []

    def record(name):
        def call(*args):
            if name == failing:
                raise KeyError("regions")
            calls.append((name, args[0] if args and isinstance(args[0], str) else None))

        return call

    side = object.__new__(_WorkerSide)
    side.stats = KvferryStats()
    side.key, side.engine = KEY, SimpleNamespace(incarnation=ENGINE_INC)
    side._unauthenticated_from = set()
    side._windows = {}
    side.sends = sends
    side.writer = SimpleNamespace(
        on_plan=record("writer.on_plan"),
        on_owner_abort=record("writer.on_owner_abort"),
        fail_request=lambda rid, exc: calls.append(("writer.fail_request", rid)),
    )
    side.owner = SimpleNamespace(
        load_from=lambda msg, m: None,
        on_notice=record("owner.on_notice"),
        fail_request=lambda rid, exc: calls.append(("owner.fail_request", rid)),
    )
    return side, calls


KEY = HandshakeKey.generate()  # the engines' secret, as both sides of a message hold it
ENGINE_INC = 0x77  # the receiving engine's incarnation


def _sealed(
    side, payload: bytes, sender: str, key: HandshakeKey = KEY, to: int = ENGINE_INC, seq: int = 1
):
    """An incoming message from the engine named ``sender``, tagged as its Link tags it
    (``seq``: its number among that engine's messages)."""
    address = sender.encode()
    sealed = key.seal_message(to, address, seq, payload)
    return SimpleNamespace(payload=sealed, sender_address=address, sender_name=sender)


def _abort_from(rid: str, orid: str) -> bytes:
    return wire.encode(
        wire.ABORT, rid=rid, orid=orid, source="transfer", reason="late", tp_rank=0,
        tp_size=1, kv_heads=4,
    )  # fmt: skip


def test_a_late_writers_abort_at_a_decode_only_engine_is_stale_not_an_owners():
    """An ABORT no load of this worker claims (its load ended here, or it comes from
    another incarnation) is an owner's abort of a send only on an engine that sends; on a
    decode-only engine it is counted stale, and no prompt or ack is made of it."""
    side, calls = _side(sends=False)
    side._on_message(_sealed(side, _abort_from("p-1", "d-1"), "prefill0"))
    assert calls == [] and side.stats.data["stale_messages"] == 1
    side, calls = _side(sends=True)
    side._on_message(_sealed(side, _abort_from("p-1", "d-1"), "decode0"))
    assert calls == [("writer.on_owner_abort", None)]


def test_an_abort_the_writer_cannot_act_on_fails_only_the_writers_request():
    """An owner's ABORT of one of our sends that raises in the writer fails the writer's
    job for it, and no load of ours: the decode request id it names is the remote
    decode's, which a load of this (kv_both) engine may share."""
    side, calls = _side(sends=True, failing="writer.on_owner_abort")
    side._on_message(_sealed(side, _abort_from("p-1", "d-1"), "decode0"))
    assert calls == [("writer.fail_request", "p-1")]
    assert side.stats.data["internal_errors"] == 1


@pytest.mark.parametrize("broken", [False, True], ids=["by-its-decode-request", "broken-by-rank"])
def test_a_second_decode_request_naming_ours_neither_plans_nor_aborts_it(monkeypatch, broken):
    """Two decode requests of one decode worker name our request (a router's retry, or
    params that lie). The second's PLAN is refused at once (ABORT and ack to it: nothing
    of ours goes into its blocks), and its client's ABORT is acked as its own; the first
    one's job goes on and lands. Broken mode: an abort matched by the decode rank alone
    aborts the first one's job."""
    wr = make_writer(monkeypatch, staging_slots=0, part_bytes=1 << 20)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))  # decode request d-r
    second = {**plan(0, wr.dsts[0], TOKENS), "orid": "d-r2"}
    wr.host.on_plan(sender(0), second)
    refused = [m for m in wr.link.of(wire.ABORT) if m["orid"] == "d-r2"]
    assert refused and "planned by decode request d-r already" in refused[0]["reason"]
    assert [m["orid"] for m in wr.link.of(wire.ABORT_ACK)] == ["d-r2"]
    job = wr.host.prompts["r"].jobs[0]
    if broken:
        job.orid = ""  # the job's owner unknown: an abort is matched by the rank alone
    wr.host.on_owner_abort(sender(0), {**abort(0), "orid": "d-r2"})
    wr.settle_all()
    if broken:
        assert job.book.state is WriterState.ABORTED
        return
    assert [m["orid"] for m in wr.link.of(wire.ABORT_ACK)] == ["d-r2", "d-r2"]
    assert job.book.state is WriterState.DONE
    assert [m["orid"] for m in wr.link.of(wire.NOTICE)] == ["d-r"]


@pytest.mark.parametrize(
    "how",
    ["no tag", "another secret", "another incarnation", "another sender", "broken-unchecked"],
)
def test_a_message_without_the_secrets_tag_is_dropped_and_counted(monkeypatch, how):
    """Every control message carries a tag under the engines' secret bound to its sender's
    address and this engine's incarnation: one without it (a stranger's, one sealed for
    another incarnation, one claiming another engine's address) is dropped before it is
    decoded, counted and logged once per sender. Broken mode: messages taken unchecked;
    a stranger's ABORT reaches the writer."""
    side, calls = _side(sends=True)
    payload = _abort_from("p-1", "d-1")
    if how == "broken-unchecked":
        monkeypatch.setattr(
            HandshakeKey, "open_message", lambda self, inc, sender, sealed: (1, sealed)
        )
        side._on_message(SimpleNamespace(payload=payload, sender_address=b"x", sender_name="x"))
        assert calls == [("writer.on_owner_abort", None)]  # the test catches it
        return
    if how == "no tag":
        msg = SimpleNamespace(payload=payload, sender_address=b"decode0", sender_name="decode0")
    elif how == "another secret":
        msg = _sealed(side, payload, "decode0", key=HandshakeKey.generate())
    elif how == "another incarnation":
        msg = _sealed(side, payload, "decode0", to=ENGINE_INC + 1)
    else:
        msg = _sealed(side, payload, "decode0")
        msg.sender_address = b"writer0"  # what the envelope claims, not what was tagged
    side._on_message(msg)
    side._on_message(msg)
    assert calls == [] and side.stats.data["unauthenticated_messages"] == 2


class _SendingEngine:
    """A sending engine as the Link sees it: its address (which names its incarnation)
    and what it sent."""

    def __init__(self, incarnation: int) -> None:
        self.address = transfer_protocol.CODEC.encode(
            transfer_protocol.ADDRESS.make(
                ucx=b"ucx", incarnation=incarnation, name="decode0", host="h", boot_id="b",
                pidns=1, pid=7,
            )
        )  # fmt: skip
        self.sent: list[bytes] = []

    def send(self, peer, sealed: bytes) -> object:
        self.sent.append(sealed)
        return object()


def _sent_by(engine: _SendingEngine, link: Link, payload: bytes) -> SimpleNamespace:
    """``payload`` sealed and numbered by ``link`` as it goes on the wire, then received."""
    peer = SimpleNamespace(info=SimpleNamespace(incarnation=ENGINE_INC), name="prefill0")
    assert link.send(peer, payload, "p-1") is not None  # type: ignore[arg-type]
    return SimpleNamespace(
        payload=engine.sent[-1], sender_address=engine.address, sender_name="decode0"
    )


@pytest.mark.parametrize("window", [True, False], ids=["window", "broken-no-window"])
def test_a_replayed_message_is_refused_and_logged(monkeypatch, caplog, window):
    """A message sealed with the secret, recorded on the network and delivered again to
    the engine it was sealed for, is refused by its sender's window of sequence numbers,
    counted and logged with the sender and the numbers; so is one older than the window.
    Broken mode: the window takes every number, and the replayed ABORT reaches the
    writer a second time, which the same check sees."""
    if not window:
        monkeypatch.setattr(SeqWindow, "take", lambda self, inc, seq: True)
    side, calls = _side(sends=True)
    engine = _SendingEngine(incarnation=0x11)
    link = Link(engine, KEY)  # type: ignore[arg-type]
    recorded = _sent_by(engine, link, _abort_from("p-1", "d-1"))
    side._on_message(recorded)
    side._on_message(recorded)  # the replay
    replays = side.stats.data.get("replayed_messages", 0)
    taken = len(calls)
    assert (taken, replays) == ((1, 1) if window else (2, 0))  # the test catches it
    if not window:
        return
    assert "refused a replayed message from decode0: sequence number 1" in caplog.text
    for _ in range(SeqWindow().size + 2):  # more than the window holds
        side._on_message(_sent_by(engine, link, _abort_from("p-1", "d-1")))
    assert len(calls) == SeqWindow().size + 3
    side._on_message(recorded)  # below the window now
    assert len(calls) == SeqWindow().size + 3 and side.stats.data["replayed_messages"] == 2


def test_messages_out_of_order_within_the_window_are_taken():
    """The transport may deliver one engine's messages out of order (over two endpoints,
    one closed and one new): each number is taken once, in any order within the window."""
    side, calls = _side(sends=True)
    payload = _abort_from("p-1", "d-1")
    for seq in (3, 1, 2, 2):
        side._on_message(_sealed(side, payload, "decode0", seq=seq))
    assert len(calls) == 3 and side.stats.data["replayed_messages"] == 1


def test_a_restarted_senders_first_message_is_taken():
    """A restarted engine numbers its messages from 1 again, under a new address (its new
    incarnation's): its first message is taken, and the old incarnation's recorded one is
    still refused."""
    side, calls = _side(sends=True)
    old = _SendingEngine(incarnation=0x11)
    old_link = Link(old, KEY)  # type: ignore[arg-type]
    recorded = _sent_by(old, old_link, _abort_from("p-1", "d-1"))
    side._on_message(recorded)
    new = _SendingEngine(incarnation=0x13)
    fresh = _sent_by(new, Link(new, KEY), _abort_from("p-2", "d-2"))  # type: ignore[arg-type]
    assert KEY.open_message(ENGINE_INC, new.address, fresh.payload)[0] == 1  # from 1 again
    side._on_message(fresh)
    side._on_message(recorded)
    assert len(calls) == 2 and side.stats.data["replayed_messages"] == 1


def _flush_failing(wr, kind: wire.Kind) -> list[tuple[str, str]]:
    """Make every notify of ``kind`` a batch whose flush failed; returns the releases the
    writer reports, as (how, justification)."""
    real = wr.link.notify

    def notify(peer, payload, rid):
        batch = real(peer, payload, rid)
        if batch is not None and wr.link.sent[-1]["k"] is kind:
            batch.done, batch.failed, batch.error = False, True, "UCS_ERR_CONNECTION_RESET"
        return batch

    wr.link.notify = notify
    releases: list[tuple[str, str]] = []
    real_released = wr.host.released
    wr.host.released = lambda jid, pages, how, proof: (  # type: ignore[method-assign]
        releases.append((str(how.value), str(proof.value))),
        real_released(jid, pages, how, proof),
    )
    return releases


@pytest.mark.parametrize("broken", [False, True], ids=["fails", "broken-taken-as-flushed"])
def test_a_notice_whose_flush_failed_fails_the_request(monkeypatch, broken):
    """Every write landed, but the NOTICE's flush fails: nothing proves the writes
    ended, so the request fails (the decode told) and the blocks wait for the ack.
    Broken mode: the notice taken as flushed, the request ends as served."""
    wr = make_writer(monkeypatch)
    if broken:
        monkeypatch.setattr(
            writer_host.WriterHost,
            "_notice_settled",
            lambda self, job, b: self.driver.feed(job, WriterEvent.NOTICE_FLUSHED),
        )
    releases = _flush_failing(wr, wire.NOTICE)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    wr.settle_all()
    assert wr.link.of(wire.NOTICE)
    if broken:
        assert not wr.link.of(wire.ABORT) and ("freed", "own-flush") in releases
        return
    (abort,) = wr.link.of(wire.ABORT)
    assert "the notice's flush failed" in abort["reason"]
    assert ("freed", "own-flush") not in releases


@pytest.mark.parametrize("broken", [False, True], ids=["drained", "broken-claims-a-flush"])
def test_an_ack_whose_flush_failed_says_drained(monkeypatch, broken):
    """The decode aborts; the ack's flush fails. The ack followed the drain, so the
    blocks go back, and the release says ``drained``, not ``own-flush``. Broken mode:
    the failure taken as the flush."""
    wr = make_writer(monkeypatch)
    if broken:
        real = writer_host.WriterWire.send_ack

        def send_ack(self, jid, owner, flushed):
            real(self, jid, owner, None if flushed is None else lambda ok: flushed(True))

        monkeypatch.setattr(writer_host.WriterWire, "send_ack", send_ack)
    releases = _flush_failing(wr, wire.ABORT_ACK)
    wr.hand_over()
    wr.host.on_plan(sender(0), plan(0, wr.dsts[0], TOKENS))
    wr.host.on_owner_abort(sender(0), abort(0))
    wr.settle_all()
    assert wr.link.of(wire.ABORT_ACK)
    want = ("aborted", "own-flush" if broken else "drained")
    assert want in releases
