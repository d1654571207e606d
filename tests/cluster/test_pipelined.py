"""The pipelined long-prompt path against recording runtimes, no processes: a writer posts
the pages its prefill made final while it computes the rest and sends a NOTICE_PART for
each part that landed; the owner checks a part when it arrives, takes no part as the
writer's flush, and checks with the whole notice only the pages no part checked."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_protocol_units import RecordingRuntime, _owner

from kvferry.cluster import decode, decode_path, prefill_path
from kvferry.cluster import messages as m
from kvferry.cluster.decode import OwnerState
from kvferry.cluster.prefill import PrefillRank
from kvferry.engine import stepwise
from kvferry.engine.integrity import page_checksums
from kvferry.engine.models import ReplayConfig, ReplayModel
from kvferry.engine.pool import KVPool
from kvferry.engine.protocol import owner as oc
from kvferry.engine.protocol import writer as wc
from kvferry.engine.protocol.table import Move, replace
from kvferry.engine.protocol.writer import WriterDo, WriterEvent, WriterState
from kvferry.engine.stepwise import chunk_bounds, kv_token_bytes

CHUNK = 32  # tokens of a layer per prefill step: a 100-token prompt makes 4 steps
PAGE = 16
PROMPT = 100  # 7 pages: parts of 2 pages after each of the first three steps
PLANNED = list(range(20, 27))


class HoldingRuntime(RecordingRuntime):
    """Batches stay in flight until the test settles them."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.in_flight: list = []

    def watch(self, batch, callback, rid=None) -> None:
        if getattr(batch, "is_write", False):
            self.in_flight.append((batch, callback))
        else:
            callback(batch)

    def write(self, rank, local, pages, rid=None, incarnation=None):
        batch = super().write(rank, local, pages, rid, incarnation)
        held = type("HeldBatch", (), {"is_write": True, "status": batch.status, "error": None})
        return held()

    def settle_all(self) -> None:
        while self.in_flight:
            batch, callback = self.in_flight.pop(0)
            callback(batch)


def _writer(
    rt: RecordingRuntime, table=None, slice_s: float = 0.0, max_batch_bytes: int = 256 << 20
) -> tuple[PrefillRank, ReplayModel]:
    model = ReplayModel(ReplayConfig(layers=1, kv_heads=2, head_dim=32, max_positions=4096))
    model.prefill_chunk_tokens = CHUNK
    writer = PrefillRank.serving(
        rt,
        model,
        KVPool(model.pool_config(PAGE, 64)),
        segment=None,
        head_range=(0, 2),
        router=0,
        prefill_slice_s=slice_s,  # 0: back to the loop after every step
        max_batch_bytes=max_batch_bytes,
    )
    if table is not None:
        writer.driver.table = table
    return writer, model


def _plan_then_prompt(rt: RecordingRuntime, rid: str) -> None:
    rt.deliver(
        m.PLAN, src=2, rid=rid, offset=0, total=len(PLANNED), pages=PLANNED, generations=[1] * 7
    )
    rt.deliver_prompt(rid, PROMPT)


def _pump(rt: RecordingRuntime, times: int = 20) -> None:
    for _ in range(times):
        rt.pump()


def test_a_planned_writer_posts_parts_while_it_computes_and_notices_them():
    """Parts of the final pages go while the rest is computed, each followed by its
    NOTICE_PART; every page is written once, in order; the whole NOTICE follows the last
    write and carries the same checksums as the parts did."""
    rt = RecordingRuntime(rank=1)
    writer, _ = _writer(rt)
    _plan_then_prompt(rt, "p1")
    _pump(rt)
    kinds = [k for k in rt.kinds() if k in ("NOTICE_PART", "NOTICE")]
    assert kinds == ["NOTICE_PART"] * 3 + ["NOTICE"]
    parts = [f for _, k, f in rt.sent if k == "NOTICE_PART"]
    assert [(f["offset"], list(f["pages"])) for f in parts] == [
        (0, PLANNED[0:2]),
        (2, PLANNED[2:4]),
        (4, PLANNED[4:6]),
    ]
    written = np.concatenate([rows[:, 1] for _, rows in rt.writes])
    page_bytes = writer.pool.page_bytes
    assert (written // page_bytes).tolist() == PLANNED  # each page once, in order
    notice = next(f for _, k, f in rt.sent if k == "NOTICE")
    assert notice["total"] == 7 and list(notice["pages"]) == PLANNED
    assert notice["bytes"] == 7 * page_bytes
    src = writer.allocator.pages_of("p1") if writer.allocator.pages_of("p1") else None
    assert src is None  # freed once the notice flushed
    assert [c for f in parts for c in f["checksums"]] == list(notice["checksums"][:6])


def test_a_writer_planned_after_its_prefill_writes_at_once_without_parts():
    rt = RecordingRuntime(rank=1)
    _writer(rt)
    rt.deliver_prompt("p2", PROMPT)
    _pump(rt)
    rt.deliver(
        m.PLAN, src=2, rid="p2", offset=0, total=len(PLANNED), pages=PLANNED, generations=[1] * 7
    )
    _pump(rt)
    assert "NOTICE_PART" not in rt.kinds() and "NOTICE" in rt.kinds()


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "broken-runs-in-the-row"])
def test_a_prefill_that_fits_one_slice_posts_its_parts_from_the_loop(deferred):
    """A planned writer whose whole prefill fits in one slice: its parts still go as the
    pages become final, each checksummed once, then the notice. The prefill starts from
    the rank's next pump, not inside the PROMPT row that started it, where each part it
    made ready would wait behind the row's other effects while the prefill ran on and
    checksummed every page. Broken mode: deferred work that runs at once (inside the
    row); the queued parts then find their pages checksummed, and the request fails."""
    rt = RecordingRuntime(rank=1)
    rt.defer_at_once = not deferred
    writer, _ = _writer(rt, slice_s=60.0)
    if not deferred:
        with pytest.raises(
            AssertionError, match=r"request p9: part \[0, 6\) to post, but 7 pages checksummed"
        ):
            _plan_then_prompt(rt, "p9")
        return
    _plan_then_prompt(rt, "p9")
    assert rt.writes == [] and len(writer.jobs["p9"].checksums) == 0  # nothing ran in the row
    _pump(rt)
    kinds = [k for k in rt.kinds() if k in ("NOTICE_PART", "NOTICE")]
    assert kinds == ["NOTICE_PART"] * 3 + ["NOTICE"]
    notice = next(f for _, k, f in rt.sent if k == "NOTICE")
    parts = [f for _, k, f in rt.sent if k == "NOTICE_PART"]
    assert len(notice["checksums"]) == len(PLANNED)
    assert [c for f in parts for c in f["checksums"]] == list(notice["checksums"][:6])
    written = np.concatenate([rows[:, 1] for _, rows in rt.writes])
    assert (written // writer.pool.page_bytes).tolist() == PLANNED  # each page once


def test_part_checksums_are_the_source_pages_checksums():
    rt = RecordingRuntime(rank=1)
    _, model = _writer(rt)
    _plan_then_prompt(rt, "p3")
    _pump(rt)
    notice = next(f for _, k, f in rt.sent if k == "NOTICE")
    # the same prompt computed again into fresh pages gives the same bytes (the full
    # pages: the last one's slots past the prompt hold whatever its pool held)
    pool = KVPool(model.pool_config(PAGE, 8))
    model.prefill(pool.kv, np.arange(PROMPT), list(range(7)))
    assert list(notice["checksums"][:6]) == page_checksums(pool.kv, list(range(6))).tolist()


@pytest.mark.parametrize("drains", [True, False], ids=["drains", "broken-acks-in-flight"])
def test_an_abort_mid_pipeline_waits_for_the_part_in_flight(drains):
    """The ABORT arrives while a part's batch is in flight and the rest is not computed:
    nothing more is computed or posted, and the ack goes only once that batch settled
    (its flush follows). Broken mode: a table that acks there at once, as a writer with
    nothing posted may; the ack overtakes a write that can still land."""
    S, E, D = WriterState, WriterEvent, WriterDo
    table = None
    if not drains:
        broken = Move(S.ACKING, (D.STOP_POSTING, D.TOMBSTONE, D.SEND_ACK))
        table = replace(wc.WRITER_TABLE, {(S.COMPUTING_PLANNED, E.ABORT): broken})
    rt = HoldingRuntime(rank=1)
    writer, _ = _writer(rt, table)
    _plan_then_prompt(rt, "p4")
    rt.pump_once()  # the first step ran: its part is posted
    assert len(rt.in_flight) == 1 and writer.jobs["p4"].state is S.COMPUTING_PLANNED
    rt.deliver(m.ABORT, src=0, rid="p4", owner=2, writers=[1], source="client", reason="gone")
    if not drains:
        assert "ABORT_ACK" in rt.kinds() and rt.in_flight  # the test catches the early ack
        return
    _pump(rt)
    assert "ABORT_ACK" not in rt.kinds() and len(rt.writes) == 1  # nothing more posted
    rt.settle_all()
    _pump(rt)
    assert rt.kinds()[-2:] == ["ABORT_ACK", "RELEASED"]
    assert "NOTICE" not in rt.kinds()
    assert writer.allocator.counts()["owned"] == 0


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "broken-queue-replaced"])
def test_a_prefill_that_ends_while_a_part_is_posted_still_writes_every_page(kept, monkeypatch):
    """A part of several batches is half posted (one batch in flight, the rest queued)
    when the prefill ends: the rest of the prompt goes behind the part's queued rows, so
    every page the NOTICE names was written. Broken mode: the rest replaces the queue, as
    it once did; a page named by the notice is never written (with integrity off, the
    decode would read whatever another request left in it)."""
    if not kept:
        monkeypatch.setattr(prefill_path.PrefillPath, "_behind_queued", lambda self, job, t: t)
    rt = HoldingRuntime(rank=1)
    writer, _ = _writer(rt, max_batch_bytes=1)  # one row a batch: a part takes several
    _plan_then_prompt(rt, "p9")
    rt.pump_once()  # the first step: part [0, 2) posted, its first batch in flight
    job = writer.jobs["p9"]
    assert job.part == (0, 2) and len(rt.in_flight) == 1 and job.queued()
    _pump(rt)  # the prefill ends while that batch is in flight
    rt.settle_all()
    _pump(rt)
    notice = next(f for _, k, f in rt.sent if k == "NOTICE")
    assert list(notice["pages"]) == PLANNED
    page_bytes = writer.pool.page_bytes
    written = (np.concatenate([rows[:, 1] for _, rows in rt.writes]) // page_bytes).tolist()
    if not kept:
        assert sorted(set(written)) != PLANNED  # the test catches the page never written
        return
    assert written == PLANNED  # each page once, in order
    assert notice["bytes"] == len(PLANNED) * page_bytes


def test_a_part_that_fails_to_land_fails_the_request_with_its_reason():
    """A part's batch fails while the rest is computed: the writer stops computing and
    posting, tells the router and the owner why, and acks once nothing is in flight."""
    from kvferry.transfer import BatchStatus

    rt = HoldingRuntime(rank=1)
    writer, _ = _writer(rt)
    _plan_then_prompt(rt, "p5")
    rt.pump_once()  # the first step ran: its part is posted
    assert len(rt.in_flight) == 1
    failed = type(
        "Failed",
        (),
        {
            "status": lambda self: BatchStatus.FAILED,
            "error": "reset",
            "reading": lambda self: False,
        },
    )
    rt.in_flight[0] = (failed(), rt.in_flight[0][1])
    rt.settle_all()
    _pump(rt)
    aborts = [(to, f["reason"]) for to, k, f in rt.sent if k == "ABORT"]
    assert aborts and all("write to rank 2 failed: reset" in why for _, why in aborts)
    assert "ABORT_ACK" in rt.kinds() and "NOTICE" not in rt.kinds()
    assert len(rt.writes) == 1 and writer.allocator.counts()["owned"] == 0


# ---------------------------------------------------------------- the owner
def _assign(owner, rt, rid: str) -> tuple[list[int], list[int]]:
    rt.deliver(m.ASSIGN, src=0, rid=rid, prompt_len=40, max_tokens=8, writers=[1], last_token=7)
    plan = next(f for _, k, f in rt.sent if k == "PLAN")
    return plan["pages"][:3], plan["generations"][:3]


def _part(owner, pages, gens, lo, hi, corrupt=False):
    sums = page_checksums(owner.pool.kv, pages[lo:hi]).tolist()
    if corrupt:
        sums[0] ^= 1
    return dict(offset=lo, pages=pages[lo:hi], generations=gens[lo:hi], checksums=sums)


def test_the_owner_checks_a_part_on_arrival_and_only_the_rest_with_the_notice(monkeypatch):
    checked: list[list[int]] = []
    real = decode_path.page_checksums

    def spy(view, pages):
        checked.append(list(pages))
        return real(view, pages)

    monkeypatch.setattr(decode_path, "page_checksums", spy)
    owner, rt = _owner()
    pages, gens = _assign(owner, rt, "o1")
    rt.deliver(m.NOTICE_PART, src=1, rid="o1", **_part(owner, pages, gens, 0, 2))
    rt.pump()
    assert checked == [pages[:2]] and owner.reqs["o1"].state is OwnerState.AWAITING
    whole = _part(owner, pages, gens, 0, 3)
    slice_bytes = owner.pool.kv[0].numel() * owner.pool.kv.element_size()
    rt.deliver(m.NOTICE, src=1, rid="o1", tokens=40, total=3, bytes=3 * slice_bytes, **whole)
    rt.pump()
    assert checked == [pages[:2], pages[2:3]]
    assert owner.reqs["o1"].state is OwnerState.DECODING


def _deliver_notice(owner, rt: RecordingRuntime, rid: str, whole: dict) -> None:
    """Writer 1's NOTICE of ``rid``'s 3 pages (40 tokens) with ``whole``'s pages,
    generations and checksums (all of them, or its first chunk's), then one pump."""
    slice_bytes = owner.pool.kv[0].numel() * owner.pool.kv.element_size()
    rt.deliver(m.NOTICE, src=1, rid=rid, tokens=40, total=3, bytes=3 * slice_bytes, **whole)
    rt.pump()


def _corrupt_part_fails(owner, rt: RecordingRuntime, rid: str, pages, gens, lo: int, hi: int):
    """Writer 1's NOTICE_PART of ``rid``'s pages ``[lo, hi)`` with a checksum off by one
    bit: the request fails at once with the mismatch."""
    rt.deliver(m.NOTICE_PART, src=1, rid=rid, **_part(owner, pages, gens, lo, hi, corrupt=True))
    rt.pump()
    done = [f for _, k, f in rt.sent if k == "DONE"]
    assert len(done) == 1 and "checksum mismatch" in done[0]["error"]


@pytest.mark.parametrize("quarantines", [True, False], ids=["quarantines", "broken-frees"])
def test_a_corrupt_part_fails_the_request_but_keeps_its_pages_from_the_writer(
    quarantines, monkeypatch
):
    """A part whose bytes are not what its writer checksummed: the request fails at once
    (no token), but the writer may still be writing the rest, so the pages are
    quarantined until it acks. Broken mode: an owner that frees them at the failed check,
    under the writes still coming."""
    if not quarantines:
        S, E, D = oc.OwnerState, oc.OwnerEvent, oc.OwnerDo
        broken = Move(S.CLOSED, (D.COUNT_INTEGRITY, D.REPORT_FAILED, D.TOMBSTONE, D.FREE))
        monkeypatch.setattr(
            oc, "OWNER_TABLE", replace(oc.OWNER_TABLE, {(S.AWAITING, E.CORRUPT): broken})
        )
    owner, rt = _owner()
    if not quarantines:
        owner.driver.table = oc.OWNER_TABLE
    pages, gens = _assign(owner, rt, "o2")
    rt.sent.clear()
    _corrupt_part_fails(owner, rt, "o2", pages, gens, 0, 2)
    if not quarantines:
        assert owner.allocator.counts()["quarantined"] == 0  # the test catches the free
        return
    assert owner.reqs["o2"].state is OwnerState.QUARANTINED
    assert owner.allocator.counts()["quarantined"] == 3
    rt.deliver(m.ABORT_ACK, src=1, rid="o2")
    assert [f["how"] for _, k, f in rt.sent if k == "RELEASED"] == ["acked"]


@pytest.mark.parametrize("frees", [True, False], ids=["frees", "broken-quarantines"])
def test_a_corrupt_part_after_every_writer_flushed_frees_at_once(frees, monkeypatch):
    """The writer's NOTICE is in chunks and its first came (sent after its flush: nothing
    more can land), then a part fails its check: the pages are freed at once, the failure
    reported. Broken mode: the failure quarantines as if writes could still land, asks
    nobody, and holds the pages to the abort deadline, then releases them as severed."""
    if not frees:
        monkeypatch.setattr(oc, "on_part_corrupt", lambda book: oc.OwnerEvent.CORRUPT)
    monkeypatch.setattr(decode, "PAGES_PER_CHUNK", 2)
    owner, rt = _owner()
    pages, gens = _assign(owner, rt, "o3")
    _deliver_notice(owner, rt, "o3", _part(owner, pages, gens, 0, 2))  # its first chunk
    assert owner.reqs["o3"].book.writers_done()
    _corrupt_part_fails(owner, rt, "o3", pages, gens, 2, 3)
    if not frees:
        assert owner.allocator.counts()["quarantined"] == 3  # the test catches the hold
        return
    assert "o3" not in owner.reqs and owner.allocator.counts()["quarantined"] == 0
    assert [f["how"] for _, k, f in rt.sent if k == "RELEASED"] == ["freed"]


@pytest.mark.parametrize("compared", [True, False], ids=["compared", "broken-trusted"])
def test_a_notice_that_disagrees_with_its_part_fails_the_request(compared, monkeypatch):
    """The whole notice must repeat the checksums a part was checked against: the pages a
    part checked are skipped then, so a notice that names other checksums for them (its
    writer wrote them again, or the notice is not the part's) fails the request. Broken
    mode: an owner that skips the part's pages without comparing decodes from them."""
    if not compared:

        def cut_only(planned, notice, mask, sums):
            rest = np.flatnonzero(~mask)
            pages = np.asarray(notice.pages)[rest]
            gens = np.asarray(notice.generations)[rest]
            sums_left = np.asarray(notice.checksums)[rest]
            cut = decode_path.VerifyNotice(
                notice.writer, notice.tokens, pages, gens, sums_left, notice.bytes
            )
            planned = decode_path.Planned(planned.rid, planned.tokens, pages, gens, planned.bytes)
            return cut, planned, rest

        monkeypatch.setattr(decode_path, "unchecked_rest", cut_only)
    owner, rt = _owner()
    pages, gens = _assign(owner, rt, "o3")
    rt.deliver(m.NOTICE_PART, src=1, rid="o3", **_part(owner, pages, gens, 0, 2))
    rt.pump()
    whole = _part(owner, pages, gens, 0, 3)
    whole["checksums"][0] ^= 1  # not what the part said
    _deliver_notice(owner, rt, "o3", whole)
    if not compared:
        assert owner.reqs["o3"].state is OwnerState.DECODING  # the test catches the skip
        return
    done = [f for _, k, f in rt.sent if k == "DONE"]
    assert len(done) == 1 and "other checksums than its parts" in done[0]["error"]
    assert "o3" not in owner.reqs


def test_a_part_that_names_pages_outside_its_plan_fails_the_request():
    """A part naming a page of another place in the plan (or another allocation) fails
    the request with the pages in the error, its pages quarantined (the writer writes on)."""
    owner, rt = _owner()
    pages, gens = _assign(owner, rt, "o4")
    part = _part(owner, pages, gens, 0, 2)
    part["offset"] = 1  # pages 0-1 claimed at index 1
    rt.deliver(m.NOTICE_PART, src=1, rid="o4", **part)
    rt.pump()
    done = [f for _, k, f in rt.sent if k == "DONE"]
    assert len(done) == 1 and "notice part names 2 pages from index 1" in done[0]["error"]
    assert owner.reqs["o4"].state is OwnerState.QUARANTINED


@pytest.mark.parametrize(
    "counted", ["pieces", "whole-chunks", "first-layer"], ids=lambda c: f"count-{c}"
)
@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 300),
    chunk=st.integers(1, 80),
    layers=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 16]),
    tail_bytes=st.sampled_from([stepwise.TAIL_BYTES, 256]),  # 256: a tail cut by its bytes
)
def test_a_page_counts_as_final_only_once_every_layer_of_it_is_written(
    counted, tokens, chunk, layers, page_size, tail_bytes
):
    """The writer's count of final pages follows the model's pieces (whole chunks, then
    a tail halved down to a number of tokens or of bytes, each through every layer): at
    every yield of the prefill, each page it counts final holds its K/V in every layer,
    as after the whole prefill. Broken modes: a count that takes every piece for a whole
    chunk counts pages of the tail final before they are written, and the test sees it
    wherever the tail has more than one piece; one that takes a piece as final after its
    first layer, wherever there are two layers and two pieces."""
    from kvferry.cluster.prefill_path import _FinalPages

    model = ReplayModel(
        ReplayConfig(
            layers=layers, kv_heads=1, head_dim=16, max_positions=512, prefill_chunk_tokens=chunk
        )
    )
    pages = -(-tokens // page_size)
    prompt = torch.arange(tokens) % 200 + 1
    done = KVPool(model.pool_config(page_size, pages))
    pool = KVPool(model.pool_config(page_size, pages))
    done.kv.zero_(), pool.kv.zero_()
    model.prefill(done.kv, prompt, list(range(pages)))
    with mock.patch.object(stepwise, "TAIL_BYTES", tail_bytes):
        final = _FinalPages(model, tokens, pool.kv)
        if counted == "whole-chunks":
            final.written = [min(tokens, chunk * (i + 1)) for i in range(len(final.written))]
        elif counted == "first-layer":
            final.layers = 1
        early = 0
        for yielded in model.prefill_layers(pool.kv, prompt, list(range(pages))):
            n = final.after(yielded)
            if not torch.equal(pool.kv[:n], done.kv[:n]):
                early += 1
        pieces = chunk_bounds(tokens, chunk, kv_token_bytes(pool.kv))
        if counted == "pieces":
            assert early == 0
        elif counted == "whole-chunks" and len(pieces) > -(-tokens // chunk) + 1:
            assert early > 0  # the test catches the count that runs ahead of the writes
        elif counted == "first-layer" and layers > 1 and _a_page_per_piece(pieces, page_size):
            assert early > 0


def _a_page_per_piece(pieces: list[tuple[int, int]], page_size: int) -> bool:
    """Whether the first piece but the last makes a page final (a page's end in it)."""
    return len(pieces) > 1 and pieces[0][1] >= page_size


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "broken-parts-only"])
def test_the_notice_checks_the_canaries_of_the_pages_no_part_checked(checked, monkeypatch):
    """A part checked pages 0-1 (their canaries too); the notice checks only page 2's,
    at its place in the allocation. A page 2 whose canary names another request fails
    the request with no token. Broken mode (an owner that leaves every canary to the
    parts) decodes over it, and the test sees it."""
    from kvferry.engine.integrity import Canary, request_id_hash

    owner, rt = _owner()
    pages, gens = _assign(owner, rt, "o9")
    rt.deliver(m.NOTICE_PART, src=1, rid="o9", **_part(owner, pages, gens, 0, 2))
    rt.pump()
    if not checked:  # from the notice on: the part's check ran
        monkeypatch.setattr(decode_path, "check_canaries", lambda planned, rows, index=None: None)
    owner.path.canaries.stamp([pages[2]], [Canary(request_id_hash("another"), gens[2], 2)])
    rt.sent.clear()
    _deliver_notice(owner, rt, "o9", _part(owner, pages, gens, 0, 3))
    if not checked:
        assert owner.reqs["o9"].state is OwnerState.DECODING  # the test catches the skip
        return
    assert "TOKENS" not in rt.kinds()
    done = [f for _, k, f in rt.sent if k == "DONE"]
    assert len(done) == 1 and f"canary mismatch on pages [{pages[2]}]" in done[0]["error"]
    assert "o9" not in owner.reqs
