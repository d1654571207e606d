"""The kvferry connector between two vLLM engines of different shapes: TP sizes, block
sizes and KV layouts (``LBNHC`` = NHD, ``LBHNC`` = HND) that differ, each pair through
vLLM's real Scheduler on both sides and real kvferry transfers between two processes.
Per pair: the decode reads exactly the prefill's rows for its heads; corrupted bytes
fail the load; a rejection frees the prefill at once; nothing leaks. The prefill writes
each load in parts of one block (``part_bytes``), so every case runs the pipelined path:
each part checked (and turned) by the decode when its NOTICE_PART arrives. Across writers: an
abort holds a decode worker's blocks until every one of its writers acked, and a broken
mode that takes the first writer's ack for all (vLLM #56104) is caught."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
import test_connector as tc
from test_connector import DECODE_EXTRA, Prefill, finished, steps
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

PROMPT = 90  # a last block partly filled at every block size here
PARTS = {"part_bytes": 1}  # the prefill's loads in parts of one block each
DECODE_BLOCKS = 16
ROWS: list[dict[str, Any]] = []


@dataclass(frozen=True)
class Shape:
    tp: int
    block: int
    layout: str

    def __str__(self) -> str:
        order = {"LBNHC": "NHD", "LBHNC": "HND"}.get(self.layout, self.layout)
        return f"tp{self.tp}-b{self.block}-{order}"


PAIRS = [
    (Shape(2, 16, "LBNHC"), Shape(1, 16, "LBNHC")),  # TP 2 -> 1
    (Shape(1, 16, "LBNHC"), Shape(2, 32, "LBHNC")),  # TP 1 -> 2, bigger blocks, NHD -> HND
    (Shape(2, 32, "LBHNC"), Shape(4, 16, "LBNHC")),  # TP 2 -> 4, smaller blocks, HND -> NHD
    (Shape(4, 16, "LBNHC"), Shape(2, 16, "LBNHC")),  # TP 4 -> 2
    (Shape(4, 32, "LBHNC"), Shape(1, 64, "LBNHC")),  # TP 4 -> 1, 32 -> 64
    (Shape(2, 16, "LBNHC"), Shape(2, 64, "LBHNC")),  # same TP, blocks and layout differ
    (Shape(1, 16, "LBNHC"), Shape(1, 16, "LBHNC")),  # the layout alone
]
IDS = [f"{p}-to-{d}" for p, d in PAIRS]


class ShapedPrefill(Prefill):
    def __init__(self, model: str, shape: Shape, extra: dict[str, Any] | None = None) -> None:
        self.shape = shape
        super().__init__(model, extra, tp=shape.tp, layout=shape.layout, block=shape.block)


def decode_side(
    model: str,
    shape: Shape,
    unsafe: bool = False,
    module: str = h.MODULE,
    blocks: int = DECODE_BLOCKS,
) -> h.Side:
    return h.Side(
        model,
        "kv_consumer",
        "decode",
        {**DECODE_EXTRA, "unsafe": unsafe},
        tp=shape.tp,
        num_blocks=blocks,
        layout=shape.layout,
        block=shape.block,
        module=module,
    )


def count_parts(side: h.Side) -> list[int]:
    """A list that grows by one for each NOTICE_PART a decode worker of ``side``
    takes in."""
    seen: list[int] = []
    for w in side.workers:
        owner = w._worker.owner
        on_part = owner.on_notice_part

        def counted(o: Any, wr: int, m: dict[str, Any], on_part: Any = on_part) -> None:
            seen.append(int(m["offset"]))
            on_part(o, wr, m)

        owner.on_notice_part = counted
    return seen


def one_request(shape: Shape) -> int:
    """A decode pool that holds one request of PROMPT tokens, not two (and the null
    block): a second request waits for the first one's blocks."""
    return -(-PROMPT // shape.block) + 2


def add(side: h.Side, rid: str, params: dict[str, Any], max_tokens: int = 2) -> None:
    tc.add(side, rid, params, max_tokens, PROMPT)


def own_rows(side: h.Side, rid: str, marker: str) -> bool:
    """The rows the decode read when it first scheduled ``rid`` (every prompt token, each
    worker its heads) are ``marker``'s prefill's."""
    got = side.first_read[rid]
    want = h.rows(marker, PROMPT)
    return all(
        torch.equal(g, want[:, slice(*h.heads_of(side.tp, rank, side.kv_heads))])
        for rank, g in enumerate(got)
    )


def leaked(side: h.Side, limit_s: float = 5.0) -> int:
    return tc.leaked(side, limit_s, DECODE_BLOCKS)


def record(pair: str, case: str, connector: str = "kvferry", **row: Any) -> dict[str, Any]:
    row = {"connector": connector, "pair": pair, "case": case, **row}
    ROWS.append(row)
    return row


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module", params=PAIRS, ids=IDS)
def pair(request, model):
    prefill_shape, decode_shape = request.param
    p = ShapedPrefill(model, prefill_shape, PARTS)
    yield p, decode_shape
    p.close()


# ---------------------------------------------------------------------- the cases
def case_normal(model, prefill: ShapedPrefill, shape: Shape, unsafe: bool) -> dict[str, Any]:
    marker = f"n-{shape}-{unsafe}"
    params = prefill.ask("prefill", marker, PROMPT)
    if unsafe:
        prefill.ask("run", False)  # nothing lands while the broken decode reports early
    d = decode_side(model, shape, unsafe)
    parts = count_parts(d)
    try:
        add(d, "d-n", params)
        if unsafe:
            steps(d, lambda: "d-n" in d.first_read)
            prefill.ask("run", True)
        steps(d, lambda: finished(d, "d-n"))
        good = own_rows(d, "d-n", marker)
        steps(d, lambda: marker not in prefill.ask("status")["holding"])
        return record(
            f"{prefill.shape}->{shape}",
            "normal",
            "kvferry" + (" (broken: early finished_recving)" if unsafe else ""),
            foreign_rows_read=int(not good),
            failed=d.outputs["d-n"].finish_reason == FinishReason.ERROR,
            blocks_leaked=leaked(d),
            parts=len(parts),
        )
    finally:
        prefill.ask("run", True)
        d.shutdown()


def case_corrupt(
    model, prefill: ShapedPrefill, shape: Shape, when: str, unsafe: bool = False
) -> dict[str, Any]:
    """``when``: "before-plan", source bytes changed after vLLM handed them over (the
    writer's own check refuses to send them, or the owner's page checksums catch them);
    "in-flight", changed after the job's checksums (the owner's check of what landed).
    Broken (unsafe): the decode checks nothing."""
    marker = f"x-{when}-{shape}-{unsafe}"
    params = prefill.ask("prefill", marker, PROMPT)
    prefill.ask("corrupt" if when == "before-plan" else "corrupt_in_flight", marker)
    d = decode_side(model, shape, unsafe)
    try:
        add(d, "d-x", params)
        steps(d, lambda: finished(d, "d-x"))
        out = d.outputs["d-x"]
        steps(d, lambda: marker not in prefill.ask("status")["holding"])
        return record(
            f"{prefill.shape}->{shape}",
            f"corrupted bytes ({when})",
            "kvferry" + (" (broken: early finished_recving)" if unsafe else ""),
            decoded="d-x" in d.first_read,
            failed=out.finish_reason == FinishReason.ERROR,
            blocks_leaked=leaked(d),
        )
    finally:
        d.shutdown()


def tear_first_part(side: h.Side) -> list[int]:
    """At each decode worker, a byte of the first block of its first writer's first
    NOTICE_PART is flipped as the part arrives, before it is checked: a write torn in
    flight, in a block no later check reads again. Returns the blocks torn."""
    torn: list[int] = []
    for w in side.workers:
        owner = w._worker.owner

        def tearing(o: Any, wr: int, m: dict[str, Any], owner=owner, on_part=owner.on_notice_part):
            if wr == 0 and not getattr(o, "torn", False):
                block = int(m["blocks"][0])
                data = owner.regions.block_bytes_of([block])
                data[:, 5] ^= 0xFF
                owner.regions.write_block_bytes([block], data)
                o.torn = True
                torn.append(block)
            on_part(o, wr, m)

        owner.on_notice_part = tearing
    return torn


def case_torn_part(model, prefill: ShapedPrefill, shape: Shape, broken: bool) -> dict[str, Any]:
    """A block torn in the load's first part (:func:`tear_first_part`): the decode's
    check of that part fails the load (the whole notice's check skips what the parts
    checked, so nothing else would). Broken: a decode that takes its parts as checked
    unread (tests/vllm_connector/broken_parts.py)."""
    marker = f"t-{shape}-{broken}"
    params = prefill.ask("prefill", marker, PROMPT)
    module = "broken_parts" if broken else h.MODULE
    d = decode_side(model, shape, module=module)
    parts = count_parts(d)
    torn = tear_first_part(d)
    try:
        add(d, "d-t", params)
        steps(d, lambda: finished(d, "d-t"))
        out = d.outputs["d-t"]
        steps(d, lambda: marker not in prefill.ask("status")["holding"])
        return record(
            f"{prefill.shape}->{shape}",
            "torn in an early part",
            "kvferry" + (" (broken: parts taken unread)" if broken else ""),
            decoded="d-t" in d.first_read,
            failed=out.finish_reason == FinishReason.ERROR,
            blocks_leaked=leaked(d),
            parts=len(parts),
            torn=len(torn),
        )
    finally:
        d.shutdown()


def case_reject(model, prefill: ShapedPrefill, shape: Shape) -> dict[str, Any]:
    free0 = prefill.ask("status")["free"]
    params = prefill.ask("prefill", f"r-{shape}", PROMPT)
    d = decode_side(model, shape)
    try:
        add(d, "d-r", params)
        d.sched.finish_requests("d-r", RequestStatus.FINISHED_ABORTED)  # before allocation
        t0 = time.monotonic()
        freed = None
        while time.monotonic() - t0 < 5.0:
            d.step()
            time.sleep(0.01)
            if prefill.ask("status")["free"] == free0:
                freed = time.monotonic() - t0
                break
        return record(
            f"{prefill.shape}->{shape}",
            "rejected before allocation",
            prefill_freed_s=None if freed is None else round(freed, 3),
            blocks_leaked=free0 - prefill.ask("status")["free"],
        )
    finally:
        d.shutdown()


def case_first_writer_acks(model, prefill: ShapedPrefill, shape: Shape, broken: bool) -> dict:
    """A decode worker with two writers aborts a load after its plans went out; one
    writer acks, the other (held still) has not yet even read its plan. The blocks must
    stay with vLLM's request until the second writer acked too. Broken: the first ack is
    taken for every writer's (tests/vllm_connector/broken_first_ack.py)."""
    module = "broken_first_ack" if broken else h.MODULE
    tag = "fb" if broken else "f"
    pa = prefill.ask("prefill", f"{tag}-a", PROMPT)
    pb = prefill.ask("prefill", f"{tag}-b", PROMPT)
    prefill.ask("run", False)
    d = decode_side(model, shape, module=module, blocks=one_request(shape))
    try:
        add(d, "d-fa", pa)
        steps(d, lambda: _planned(d, "d-fa"))
        writers = len(d.workers[0]._worker.owner.loads["d-fa"].links)
        a_blocks = d.blocks_of("d-fa")
        free_held = d.free_blocks()
        d.sched.finish_requests("d-fa", RequestStatus.FINISHED_ABORTED)
        add(d, "d-fb", pb, max_tokens=2)
        prefill.ask("hold_worker", prefill.shape.tp - 1)
        prefill.ask("run", True)
        released_early = acked_one = False
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # the abort deadline is 3 s
            d.step()
            time.sleep(0.005)
            load = d.workers[0]._worker.owner.loads.get("d-fa")
            acked_one |= load is None or bool(load.book.acked)  # gone: released on an ack
            released_early |= (
                d.free_blocks() > free_held or d.status("d-fb") != RequestStatus.WAITING
            )
        prefill.ask("release_worker", prefill.shape.tp - 1)
        steps(d, lambda: d.status("d-fb") != RequestStatus.WAITING)
        b_blocks = d.blocks_of("d-fb")
        steps(d, lambda: finished(d, "d-fb"))
        good = own_rows(d, "d-fb", f"{tag}-b")
        steps(d, lambda: not {f"{tag}-a", f"{tag}-b"} & set(prefill.ask("status")["holding"]))
        return record(
            f"{prefill.shape}->{shape}",
            "abort, one of two writers acked",
            "kvferry" + (" (broken: first ack for all)" if broken else ""),
            writers=writers,
            one_writer_acked=acked_one,
            released_before_every_ack=released_early,
            b_got_a_blocks=bool(set(a_blocks) & set(b_blocks)),
            foreign_rows_read=int(not good),
        )
    finally:
        prefill.ask("release_worker", prefill.shape.tp - 1)
        prefill.ask("run", True)
        d.shutdown()


def case_abort(model, prefill: ShapedPrefill, shape: Shape, unsafe: bool) -> dict[str, Any]:
    """Abort a load after its plans went out, with the prefill held still: every decode
    worker keeps its blocks until each of its writers acked; B, which waits for them,
    then reads its own rows. Broken (unsafe): the blocks go back at the abort."""
    tag = f"{shape}-{unsafe}"
    pa = prefill.ask("prefill", f"a-{tag}", PROMPT)
    pb = prefill.ask("prefill", f"b-{tag}", PROMPT)
    prefill.ask("run", False)
    d = decode_side(model, shape, unsafe, blocks=one_request(shape))
    try:
        add(d, "d-a", pa)
        steps(d, lambda: _planned(d, "d-a"))
        a_blocks = d.blocks_of("d-a")
        free_held = d.free_blocks()
        d.sched.finish_requests("d-a", RequestStatus.FINISHED_ABORTED)
        add(d, "d-b", pb)
        released_early = False
        for _ in range(60):
            d.step()
            time.sleep(0.005)
            released_early |= (
                d.free_blocks() > free_held or d.status("d-b") != RequestStatus.WAITING
            )
        prefill.ask("run", True)
        steps(d, lambda: d.status("d-b") != RequestStatus.WAITING)
        b_blocks = d.blocks_of("d-b")
        steps(d, lambda: finished(d, "d-b"))
        good = own_rows(d, "d-b", f"b-{tag}")
        steps(d, lambda: not {f"a-{tag}", f"b-{tag}"} & set(prefill.ask("status")["holding"]))
        return record(
            f"{prefill.shape}->{shape}",
            "abort while waiting",
            "kvferry" + (" (broken: early finished_recving)" if unsafe else ""),
            released_before_ack=released_early,
            b_got_a_blocks=bool(set(a_blocks) & set(b_blocks)),
            foreign_rows_read=int(not good),
        )
    finally:
        prefill.ask("run", True)
        d.shutdown()


def case_crash(model, prefill_shape: Shape, shape: Shape, caplog) -> dict[str, Any]:
    """The prefill's process is killed once a job posted its first batch (one block's
    worth a batch): every decode worker fails its load, and its blocks come back only
    once every writer of its is proven gone."""
    p = ShapedPrefill(model, prefill_shape, {"max_batch_bytes": 4096})
    d = decode_side(model, shape)
    try:
        params = p.ask("prefill", "c-1", PROMPT)
        p.ask("kill_after_batches", "c-1", 1)
        add(d, "d-c", params)
        held = released = released_alive = False

        def done() -> bool:
            nonlocal held, released, released_alive
            all_free = d.free_blocks() == DECODE_BLOCKS - 1
            held |= not all_free
            if held and all_free and not released:
                released, released_alive = True, p.alive()
            return released and finished(d, "d-c")

        steps(d, done)
        clear = any(
            "d-c" in r.getMessage()
            and (
                "exited before its notice" in r.getMessage()
                or "cannot connect to prefill" in r.getMessage()
            )
            for r in caplog.records
        )
        return record(
            f"{prefill_shape}->{shape}",
            "prefill killed mid-transfer",
            released_while_writer_alive=released_alive,
            failed=d.outputs["d-c"].finish_reason == FinishReason.ERROR,
            clear_error=clear,
            decoded="d-c" in d.first_read,
            blocks_leaked=leaked(d),
        )
    finally:
        d.shutdown()
        p.close()


def _planned(d: h.Side, rid: str) -> bool:
    from kvferry.engine.protocol.owner import OwnerState

    owned = [w._worker.owner.loads.get(rid) for w in d.workers]
    return all(o is not None and o.book.state is not OwnerState.NEW for o in owned)


# ---------------------------------------------------------------------- the tests
def test_pair_decodes_the_prefills_rows(model, pair):
    prefill, shape = pair
    row = case_normal(model, prefill, shape, unsafe=False)
    assert row["foreign_rows_read"] == 0 and not row["failed"], row
    assert row["blocks_leaked"] == 0 and row["parts"] >= 1, row


def test_pair_goes_in_parts_each_checked_as_it_lands(model, pair):
    prefill, shape = pair
    row = case_torn_part(model, prefill, shape, broken=False)
    assert row["parts"] >= 1 and row["torn"] >= 1, row  # else it tests nothing
    assert row["failed"] and not row["decoded"] and row["blocks_leaked"] == 0, row


def test_pair_parts_taken_unread_broken_mode_caught(model, pair):
    prefill, shape = pair
    row = case_torn_part(model, prefill, shape, broken=True)
    assert row["torn"] >= 1 and row["decoded"] and not row["failed"], row


def test_pair_broken_mode_caught(model, pair):
    prefill, shape = pair
    row = case_normal(model, prefill, shape, unsafe=True)
    assert row["foreign_rows_read"] == 1, row


def test_pair_abort_waits_for_every_ack(model, pair):
    prefill, shape = pair
    row = case_abort(model, prefill, shape, unsafe=False)
    assert not row["released_before_ack"] and row["foreign_rows_read"] == 0, row


def test_pair_abort_broken_mode_caught(model, pair):
    prefill, shape = pair
    row = case_abort(model, prefill, shape, unsafe=True)
    assert row["released_before_ack"], row


@pytest.mark.parametrize("pair_shapes", [PAIRS[0], PAIRS[2]], ids=[IDS[0], IDS[2]])
def test_pair_prefill_killed_mid_transfer(model, pair_shapes, caplog):
    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    row = case_crash(model, *pair_shapes, caplog)
    assert not row["released_while_writer_alive"] and row["failed"] and row["clear_error"], row
    assert not row["decoded"] and row["blocks_leaked"] == 0, row


@pytest.mark.parametrize("when", ["before-plan", "in-flight"])
def test_pair_corrupted_bytes_fail_the_load(model, pair, when):
    prefill, shape = pair
    row = case_corrupt(model, prefill, shape, when)
    assert row["failed"] and not row["decoded"] and row["blocks_leaked"] == 0, row


def test_pair_corruption_broken_mode_caught(model, pair):
    prefill, shape = pair
    row = case_corrupt(model, prefill, shape, "in-flight", unsafe=True)
    assert row["decoded"] and not row["failed"], row


def test_pair_rejection_frees_the_prefill_at_once(model, pair):
    prefill, shape = pair
    row = case_reject(model, prefill, shape)
    assert row["prefill_freed_s"] is not None and row["prefill_freed_s"] < 2.0, row
    assert row["blocks_leaked"] == 0, row


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """A model of 2 KV heads, a prefill of TP 4 (heads 0, 0, 1, 1: two workers hold
    replicas) into a decode of TP 1: workers 0 and 2 write, workers 1 and 3 are told by a
    plan of no heads that nothing is wanted from them."""
    model = h.model_dir(tmp_path_factory.mktemp("model-kv2"), kv_heads=2)
    p = ShapedPrefill(model, Shape(4, 16, "LBNHC"))
    yield model, p, Shape(1, 32, "LBHNC")
    p.close()


def test_gqa_replicas_write_once_and_the_others_free_at_once(replicas):
    model, prefill, shape = replicas
    row = case_normal(model, prefill, shape, unsafe=False)
    assert row["foreign_rows_read"] == 0 and not row["failed"], row
    assert row["blocks_leaked"] == 0, row
    status = prefill.ask("status")
    assert not status["holding"] and not status["jobs"], status


def test_gqa_replicas_rejection_frees_every_prefill_worker(replicas):
    model, prefill, shape = replicas
    row = case_reject(model, prefill, shape)
    assert row["prefill_freed_s"] is not None and row["prefill_freed_s"] < 2.0, row
    assert row["blocks_leaked"] == 0, row


@pytest.fixture(scope="module")
def two_writers(model):
    """A prefill of TP 2 into a decode of TP 1: each decode load has two writers."""
    p = ShapedPrefill(model, Shape(2, 16, "LBNHC"))
    yield p, Shape(1, 32, "LBHNC")
    p.close()


def test_abort_holds_the_blocks_until_every_writer_acked(model, two_writers):
    prefill, shape = two_writers
    row = case_first_writer_acks(model, prefill, shape, broken=False)
    assert row["writers"] == 2 and row["one_writer_acked"], row  # else the case tests nothing
    assert not row["released_before_every_ack"], row
    assert row["foreign_rows_read"] == 0, row


def test_abort_first_ack_for_all_broken_mode_caught(model, two_writers):
    prefill, shape = two_writers
    row = case_first_writer_acks(model, prefill, shape, broken=True)
    assert row["writers"] == 2 and row["one_writer_acked"], row
    assert row["released_before_every_ack"], row


def test_zz_table():
    lines = [json.dumps(r) for r in ROWS]
    logging.getLogger("kvferry.tests").info("shape pairs:\n%s", "\n".join(lines))
    print("\n" + "\n".join(lines))
    if os.environ.get("KVFERRY_VLLM_TABLE"):
        with open(os.environ["KVFERRY_VLLM_TABLE"], "a") as f:
            f.write("\n".join(lines) + "\n")
