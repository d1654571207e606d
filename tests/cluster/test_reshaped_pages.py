"""A prefill rank whose pages hold another number of tokens than its owner's
(``--prefill-page-size``), or lie in memory in another order (``--kv-layout``: HND
heads-major, NHD token-major), against recording runtimes, no processes: the writer writes its
heads of the prompt as runs planned once, the notice names the owner's pages with one
checksum each of what the runs put there, and the owner's I5 checks pass on the bytes
that landed and decode reads the prompt back. Broken modes: a byte torn in flight, and a
writer that writes its pages as if both sides had its page size; both are caught before
decode reads a page; and, across layouts of one page size (which go page for page, laid as
in the writer's memory, and are turned into the owner's order after its checks), an owner
that never turns them, whose decode reads the wrong tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_protocol_units import RecordingRuntime, TimedRuntime, _card

from kvferry.cluster import messages as m
from kvferry.cluster import prefill_path
from kvferry.cluster.decode import DecodeRank, OwnerState
from kvferry.cluster.prefill import PrefillRank
from kvferry.engine.models import ReplayConfig, ReplayModel
from kvferry.engine.pool import KVPool
from kvferry.engine.reshard import Order

PROMPT = 100
WRITER, OWNER = 1, 2


def _model() -> ReplayModel:
    return ReplayModel(ReplayConfig(layers=2, kv_heads=2, head_dim=32, max_positions=4096))


def _pool(model: ReplayModel, page: int, order: Order, zero: bool = False) -> KVPool:
    return KVPool(dataclasses.replace(model.pool_config(page, 32), order=order), zero=zero)


def _ranks(
    src_page: int,
    dst_page: int,
    orders: tuple[Order, Order] = (Order.HND, Order.HND),
    chunk: int | None = None,
):
    cards = {
        WRITER: dataclasses.replace(
            _card(WRITER, "prefill"), page_size=src_page, kv_layout=orders[0].value
        ),
        OWNER: dataclasses.replace(
            _card(OWNER, "decode"), page_size=dst_page, kv_layout=orders[1].value
        ),
    }
    wrt, ort = RecordingRuntime(WRITER, cards), TimedRuntime(OWNER)
    ort.cards = cards
    model = _model()
    if chunk is not None:  # a prefill in steps of ``chunk`` tokens, back to the loop after each
        model.prefill_chunk_tokens = chunk
    writer = PrefillRank.serving(
        wrt,
        model,
        _pool(model, src_page, orders[0]),
        None,
        (0, 2),
        router=0,
        prefill_slice_s=0.0 if chunk is not None else prefill_path.PREFILL_SLICE_S,
    )
    owner = DecodeRank.serving(
        ort,
        model,
        _pool(model, dst_page, orders[1], zero=True),
        router=0,
        transfer_timeout_s=5.0,
        abort_deadline_s=1.0,
    )
    return writer, wrt, owner, ort


def _land(writer: PrefillRank, owner: DecodeRank, writes) -> None:
    src = writer.pool.storage.reshape(-1).view(torch.uint8)
    dst = owner.pool.storage.reshape(-1).view(torch.uint8)
    for _, triples in writes:
        for s, d, n in np.asarray(triples).tolist():
            dst[d : d + n] = src[s : s + n]


def _write_prompt(writer, wrt, owner, ort) -> np.ndarray:
    """ASSIGN at the owner, its PLAN and the prompt at the writer, the writer pumped to
    its notice and its writes landed in the owner's pool; the prompt's tokens."""
    tokens = (np.arange(PROMPT) * 7 % 400).astype("<i4")
    ort.deliver(
        m.ASSIGN, src=0, rid="r", prompt_len=PROMPT, max_tokens=4, writers=[WRITER],
        last_token=int(tokens[-1]),
    )  # fmt: skip
    plan = next(f for _, k, f in ort.sent if k == "PLAN")
    wrt.deliver(m.PLAN, src=OWNER, **plan)
    wrt.deliver(
        m.PREFILL, src=0, rid="r", tokens=tokens.tobytes(), offset=0, total=PROMPT,
        owner=OWNER, owner_inc=1,
    )  # fmt: skip
    for _ in range(50):
        wrt.pump()
    _land(writer, owner, wrt.writes)
    return tokens


def _serve(
    src_page: int,
    dst_page: int,
    tamper: bool = False,
    orders=(Order.HND, Order.HND),
    tamper_run: int = 3,
):
    writer, wrt, owner, ort = _ranks(src_page, dst_page, orders)
    tokens = _write_prompt(writer, wrt, owner, ort)
    if tamper:
        at = int(wrt.writes[0][1][tamper_run][1]) + 5  # a byte of that written run
        owner.pool.storage.reshape(-1).view(torch.uint8)[at] ^= 1
    notice = next(f for _, k, f in wrt.sent if k == "NOTICE")
    ort.deliver(m.NOTICE, src=WRITER, **notice)
    ort.pump()
    return owner, ort, tokens, notice


@pytest.mark.parametrize("src_page, dst_page", [(16, 32), (32, 16), (16, 64), (64, 16), (32, 64)])
def test_the_owner_verifies_and_decodes_what_a_reshaped_writer_wrote(src_page, dst_page):
    owner, ort, tokens, notice = _serve(src_page, dst_page)
    need = -(-PROMPT // dst_page)
    assert len(notice["pages"]) == len(notice["checksums"]) == need
    assert notice["bytes"] == PROMPT * 2 * 2 * 2 * 32 * 4  # tokens x layers x K/V x heads x dim
    assert owner.reqs["r"].state is OwnerState.DECODING
    for _ in range(4):
        owner.step()
    out = [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]]
    assert out == tokens[:4].tolist()


@pytest.mark.parametrize("src_page, dst_page", [(16, 32), (64, 16)])
def test_a_byte_torn_in_flight_fails_the_request(src_page, dst_page):
    owner, ort, _, _ = _serve(src_page, dst_page, tamper=True)
    assert "r" not in owner.reqs
    done = next(f for _, k, f in ort.sent if k == "DONE")
    assert done["outcome"] == "failed" and "checksum mismatch on 1 of" in done["error"]


def test_broken_a_writer_that_ignores_the_owner_page_size_is_caught(monkeypatch):
    """The broken mode: the writer writes page i of its own into the owner's page i, as
    when both sides had its page size (its 4 pages of 32 tokens into 4 of the owner's 7
    pages of 16)."""
    monkeypatch.setattr(prefill_path.PrefillPath, "reshaped", lambda self, job: False)
    owner, ort, _, _ = _serve(32, 16)
    assert "r" not in owner.reqs
    done = next(f for _, k, f in ort.sent if k == "DONE")
    assert done["outcome"] == "failed" and "integrity" in done["error"]


H, N = Order.HND, Order.NHD
LAYOUTS = [(H, N), (N, H), (N, N)]


@pytest.mark.parametrize("orders", LAYOUTS, ids=lambda o: f"{o[0].value}-{o[1].value}")
@pytest.mark.parametrize("src_page, dst_page", [(16, 16), (32, 16), (16, 64)])
def test_the_owner_verifies_and_decodes_across_layouts(orders, src_page, dst_page):
    """Heads-major into token-major pages and back, and token-major on both sides, at one
    page size and across two: the runs carry every head of every token into its place in
    the owner's memory (the replay model decodes the prompt back from the pool's view),
    and the checksums of each owner page as it lies in memory agree on both sides."""
    owner, ort, tokens, notice = _serve(src_page, dst_page, orders=orders)
    assert len(notice["checksums"]) == -(-PROMPT // dst_page)
    assert owner.reqs["r"].state is OwnerState.DECODING
    for _ in range(4):
        owner.step()
    out = [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]]
    assert out == tokens[:4].tolist()


@pytest.mark.parametrize("orders", LAYOUTS, ids=lambda o: f"{o[0].value}-{o[1].value}")
def test_a_byte_torn_in_flight_across_layouts_fails_the_request(orders):
    owner, ort, _, _ = _serve(16, 16, tamper=True, orders=orders)
    assert "r" not in owner.reqs
    done = next(f for _, k, f in ort.sent if k == "DONE")
    assert done["outcome"] == "failed" and "checksum mismatch on 1 of" in done["error"]


@pytest.mark.parametrize("orders", [(H, N), (N, H)], ids=["HND-NHD", "NHD-HND"])
def test_a_layout_change_of_one_page_size_goes_page_for_page_and_is_turned_on_arrival(orders):
    """One page size, two orders: the writer sends each page as it lies in its memory
    (one run per page run, no run per token and head), the owner checks those bytes as
    they landed, then turns its pages into its own order before decode reads them."""
    owner, ort, tokens, notice = _serve(16, 16, orders=orders)
    page_bytes = owner.pool.page_bytes
    assert owner.reqs["r"].state is OwnerState.DECODING
    owner.step()
    assert [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]] == [tokens[0]]
    assert len(notice["pages"]) == -(-PROMPT // 16)
    assert notice["bytes"] == len(notice["pages"]) * page_bytes


@pytest.mark.parametrize("orders", [(H, N), (N, H)], ids=["HND-NHD", "NHD-HND"])
def test_pipelined_parts_of_another_layout_are_turned_as_their_checks_pass(orders):
    """A planned writer posts parts while it computes; the owner checks each part as it
    arrives and turns its pages then (they are final: the part's notice follows its
    flush), so the notice leaves only the last pages to check and turn, and the pages
    already turned are not read again against the writer's order."""
    writer, wrt, owner, ort = _ranks(16, 16, orders, chunk=32)
    tokens = _write_prompt(writer, wrt, owner, ort)
    parts = [f for _, k, f in wrt.sent if k == "NOTICE_PART"]
    assert len(parts) >= 2, [k for _, k, _ in wrt.sent]
    req = owner.reqs["r"]
    for part in parts:
        ort.deliver(m.NOTICE_PART, src=WRITER, **part)
        ort.pump()
        assert req.turned is not None
        assert req.turned.sum() == part["offset"] + len(part["pages"])
    ort.deliver(m.NOTICE, src=WRITER, **next(f for _, k, f in wrt.sent if k == "NOTICE"))
    ort.pump()
    assert req.state is OwnerState.DECODING and bool(req.turned.all())
    for _ in range(4):
        owner.step()
    assert [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]] == tokens[:4].tolist()


@pytest.mark.parametrize("orders", [(H, N), (N, H)], ids=["HND-NHD", "NHD-HND"])
def test_broken_an_owner_that_never_turns_its_pages_decodes_wrong_tokens(orders, monkeypatch):
    """The broken mode: the owner leaves the landed pages in the writer's order. Its
    checks pass (the bytes are the writer's), but decode reads every token's KV from the
    wrong place: the replay model's tokens differ from the prompt's, which the test above
    (and every answer the fault suite compares) would catch."""
    monkeypatch.setattr(KVPool, "relayout", lambda self, pages, laid: None)
    owner, ort, tokens, _ = _serve(16, 16, orders=orders)
    assert owner.reqs["r"].state is OwnerState.DECODING
    for _ in range(4):
        owner.step()
    out = [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]]
    assert len(out) == 4 and out != tokens[:4].tolist()


@pytest.mark.parametrize(
    "orders, src_page, dst_page",
    [((N, N), 16, 16), ((H, N), 16, 16), ((N, H), 32, 16), ((H, H), 16, 32)],
    ids=["NHD-NHD", "HND-NHD", "NHD-HND-32-16", "HND-HND-16-32"],
)
def test_the_owner_checks_in_slices_runs_that_cross_its_pages(
    orders, src_page, dst_page, monkeypatch
):
    """The owner checks a few pages a step. Token-major pages are whole runs, which join
    across pages adjacent on both sides (a fresh pool's plan is pages 0, 1, 2, ...): a
    joined run counted under the page it starts in left the later pages of the next
    slices without their bytes, and a prompt written right failed its checks. Each run is
    cut at the owner's pages before the slices take theirs."""
    from kvferry.cluster import decode_path

    per_page = dst_page * 2 * 2 * 2 * 32 * 4  # tokens x layers x K/V x heads x dim x fp32
    monkeypatch.setattr(decode_path, "CHECKSUM_SLICE_BYTES", 2 * per_page)
    owner, ort, tokens, _ = _serve(src_page, dst_page, orders=orders)
    assert owner.reqs["r"].state is OwnerState.DECODING, [f for _, k, f in ort.sent]
    owner.step()
    assert [t for _, k, f in ort.sent if k == "TOKENS" for t in f["tokens"]] == [tokens[0]]


@given(
    st.lists(st.integers(0, 30), max_size=60),
    st.lists(st.integers(0, 35), unique=True, max_size=20),
)
def test_a_slice_of_pages_finds_exactly_its_runs(keys, wanted):
    """The owner groups a writer's runs by page once; a slice's pages find theirs by
    bisection: every run of each wanted page, in the slice's order, and no other."""
    from kvferry.cluster.decode_path import _rows_of

    keys_a = np.sort(np.asarray(keys, dtype=np.int64))
    got = _rows_of(keys_a, np.asarray(wanted, dtype=np.int64)).tolist()
    assert got == [i for w in wanted for i in np.flatnonzero(keys_a == w).tolist()]


@pytest.mark.parametrize("orders", [(N, N), (H, N)], ids=["NHD-NHD", "HND-NHD"])
def test_a_byte_torn_in_the_last_slice_of_checks_fails_the_request(orders, monkeypatch):
    """The same slices of two pages: a byte torn in the last run written (the last slice's
    pages) is caught, so grouping runs by page leaves no page unchecked."""
    from kvferry.cluster import decode_path

    monkeypatch.setattr(decode_path, "CHECKSUM_SLICE_BYTES", 2 * 16 * 2 * 2 * 2 * 32 * 4)
    owner, ort, _, _ = _serve(16, 16, tamper=True, orders=orders, tamper_run=-1)
    assert "r" not in owner.reqs
    done = next(f for _, k, f in ort.sent if k == "DONE")
    assert done["outcome"] == "failed" and "checksum mismatch on 1 of" in done["error"]
