"""The kvferry connector inside vLLM's real Scheduler, both sides, pages moved by kvferry
between two processes. Each case runs safe, then in a broken mode (the decode reports a
load early) that the same checks must catch. The table of results is printed at the end
(``-s``) and written to ``$KVFERRY_VLLM_TABLE`` when set."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (.ci/vllm.sh builds its venv)")

import harness as h
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvferry.cluster.trust import generate_secret
from kvferry.transfer import TransferError

DECODE_BLOCKS = 6  # one request of 64 tokens (4 blocks + its decode block) and the null block
PROMPT = 64
PREFILL_EXTRA = {"transports": "shm", "hold_timeout_s": 60.0}
DECODE_EXTRA = {
    "transports": "shm",
    "transfer_timeout_s": 20.0,
    "abort_deadline_s": 3.0,
    "ack_retry_s": 0.2,
}
TABLE: list[dict[str, Any]] = []


class Prefill:
    """The prefill engine in another process."""

    def __init__(
        self,
        model: str,
        extra: dict[str, Any] | None = None,
        module: str = h.MODULE,
        *,
        tp: int = 2,
        layout: str = "LBNHC",
        block: int = h.BLOCK,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=h.prefill_main,
            args=(child, model, {**PREFILL_EXTRA, **(extra or {})}, tp, 64, layout, module, block),
            daemon=True,
        )
        self.proc.start()
        tag, self.pid = self.ask_raw(120)
        assert tag == "ready"

    def ask_raw(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("prefill process did not answer")
        return self.conn.recv()

    def ask(self, *cmd: Any, timeout: float = 60) -> Any:
        self.conn.send(cmd)
        return self.ask_raw(timeout)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.alive():
            try:
                self.ask("exit", timeout=10)
            except Exception:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def prefill(model):
    p = Prefill(model)
    yield p
    p.close()


def decode_side(model: str, unsafe: bool, blocks: int = DECODE_BLOCKS) -> h.Side:
    return h.Side(
        model, "kv_consumer", "decode", {**DECODE_EXTRA, "unsafe": unsafe}, tp=2, num_blocks=blocks
    )


def own_bytes(side: h.Side, rid: str, marker: str) -> bool:
    """The rows the decode read when it first scheduled ``rid`` (every prompt token, each
    worker its heads) are ``marker``'s prefill's."""
    got = side.first_read[rid]
    want = h.rows(marker, got[0].shape[2])
    return all(
        torch.equal(g, want[:, slice(*h.heads_of(side.tp, rank))]) for rank, g in enumerate(got)
    )


def steps(side: h.Side, until, limit_s: float = 30.0, pause: float = 0.002) -> float:
    t0 = time.monotonic()
    while not until():
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError("condition not reached")
        side.step()
        time.sleep(pause)
    return time.monotonic() - t0


def leaked(side: h.Side, limit_s: float = 5.0, blocks: int = DECODE_BLOCKS) -> int:
    """Blocks the decode (of ``blocks`` blocks) still holds once vLLM has had ``limit_s``
    of steps to free them (a finished request's blocks come back a step or two after its
    output): 0 unless a request's blocks are never returned."""
    try:
        steps(side, lambda: side.free_blocks() == blocks - 1, limit_s=limit_s)
    except TimeoutError:
        pass
    return blocks - 1 - side.free_blocks()


def add(
    side: h.Side, rid: str, params: dict[str, Any], max_tokens: int = 2, prompt: int = PROMPT
) -> None:
    prefill_rid = params.get("remote_request_id")  # the same prompt the prefill computed
    side.sched.add_request(
        h.request(rid, prompt, dict(params), max_tokens, side.block, prompt_of=prefill_rid)
    )


def finished(side: h.Side, rid: str) -> bool:
    o = side.outputs.get(rid)
    return o is not None and o.finish_reason is not None


def record(case: str, unsafe: bool, **row: Any) -> dict[str, Any]:
    row = {
        "connector": "kvferry" + (" (broken: early finished_recving)" if unsafe else ""),
        "case": case,
        **row,
    }
    TABLE.append(row)
    return row


# ---------------------------------------------------------------------- the cases
def case_normal(model, prefill, unsafe: bool) -> dict[str, Any]:
    params = prefill.ask("prefill", f"n-{unsafe}", PROMPT)
    assert params["do_remote_prefill"] and params["remote_request_id"] == f"n-{unsafe}"
    prefill.ask("run", False)  # the prefill holds still: nothing can land yet
    d = decode_side(model, unsafe)
    try:
        add(d, "d-1", params)
        for _ in range(40):
            d.step()
            time.sleep(0.005)
        early = "d-1" in d.first_read
        prefill.ask("run", True)
        steps(d, lambda: finished(d, "d-1"))
        good = own_bytes(d, "d-1", f"n-{unsafe}")
        steps(d, lambda: f"n-{unsafe}" not in prefill.ask("status")["holding"])
        return record(
            "normal",
            unsafe,
            scheduled_before_notice=early,
            foreign_bytes_read=int(not good),
            blocks_leaked=leaked(d),
            finish=str(d.outputs["d-1"].finish_reason),
        )
    finally:
        prefill.ask("run", True)
        d.shutdown()


def _planned(d, rid: str) -> bool:
    """Every worker's owner of ``rid`` has sent its plan (the writer may write now)."""
    from kvferry.engine.protocol.owner import OwnerState

    owned = [w._worker.owner.loads.get(rid) for w in d.workers]
    return all(o is not None and o.book.state is not OwnerState.NEW for o in owned)


def case_abort(model, prefill, unsafe: bool) -> dict[str, Any]:
    pa = prefill.ask("prefill", f"a-{unsafe}", PROMPT)
    pb = prefill.ask("prefill", f"b-{unsafe}", PROMPT)
    prefill.ask("run", False)
    d = decode_side(model, unsafe)
    try:
        add(d, "d-a", pa)
        steps(d, lambda: d.status("d-a") == RequestStatus.WAITING_FOR_REMOTE_KVS)
        # and until the owner's plan is out (AWAITING): the writer may write A's blocks
        # from then on. Before it (the handshake still pending), an abort closes at once,
        # rightly, and the case below would not test the quarantine at all.
        steps(d, lambda: _planned(d, "d-a"))
        a_blocks = d.blocks_of("d-a")
        free_held = d.free_blocks()
        for _ in range(5):
            d.step()
        d.sched.finish_requests("d-a", RequestStatus.FINISHED_ABORTED)
        add(d, "d-b", pb)  # waits for A's blocks: the pool holds one request
        released_early = False
        for _ in range(60):
            d.step()
            time.sleep(0.005)
            released_early |= (
                d.free_blocks() > free_held or d.status("d-b") != RequestStatus.WAITING
            )
        prefill.ask("run", True)
        t_run = time.monotonic()
        steps(d, lambda: d.status("d-b") != RequestStatus.WAITING)
        release_s = time.monotonic() - t_run  # after the writer could act at all
        b_blocks = d.blocks_of("d-b")
        steps(d, lambda: finished(d, "d-b"))
        good = own_bytes(d, "d-b", f"b-{unsafe}")
        steps(d, lambda: not {f"a-{unsafe}", f"b-{unsafe}"} & set(prefill.ask("status")["holding"]))
        return record(
            "abort while waiting",
            unsafe,
            released_before_ack=released_early,
            b_got_a_blocks=bool(set(a_blocks) & set(b_blocks)),
            foreign_bytes_read=int(not good),
            blocks_leaked=leaked(d),
            time_to_release_s=round(release_s, 3),
        )
    finally:
        prefill.ask("run", True)
        d.shutdown()


HOLD_S = 1.0  # the in-flight case: how long the writer holds still after the abort


def case_abort_in_flight(model, prefill, broken: bool) -> dict[str, Any]:
    """Abort a load while its writer has a write posted and unsettled (the prefill holds
    still right after posting its first batch): the decode must hold the blocks (not
    report the request in finished_recving) until the writer drained, flushed and acked.
    ``prefill`` posts one block per batch. Broken: QUARANTINE gives the blocks back."""
    tag = "qb" if broken else "q"
    pa = prefill.ask("prefill", f"{tag}-a", PROMPT)
    pb = prefill.ask("prefill", f"{tag}-b", PROMPT)
    prefill.ask("pause_after_batches", f"{tag}-a", 1)
    module = "broken_quarantine" if broken else h.MODULE
    d = h.Side(
        model, "kv_consumer", "decode", DECODE_EXTRA, tp=2, num_blocks=DECODE_BLOCKS, module=module
    )
    try:
        add(d, "d-qa", pa)
        steps(d, lambda: not prefill.ask("status")["running"])  # a batch of A's is posted
        jobs = prefill.ask("status")["jobs"].get(f"{tag}-a", [])
        in_flight = any(state == "writing" and n > 0 for state, n, _ in jobs)
        a_blocks = d.blocks_of("d-qa")
        free_held = d.free_blocks()
        d.sched.finish_requests("d-qa", RequestStatus.FINISHED_ABORTED)
        add(d, "d-qb", pb)  # waits for A's blocks: the pool holds one request
        released_early = False
        t0 = time.monotonic()
        while time.monotonic() - t0 < HOLD_S:  # asks again every 0.2 s; deadline at 3 s
            d.step()
            time.sleep(0.005)
            released_early |= (
                d.free_blocks() > free_held or d.status("d-qb") != RequestStatus.WAITING
            )
        prefill.ask("run", True)
        t_run = time.monotonic()
        steps(d, lambda: d.status("d-qb") != RequestStatus.WAITING)
        release_s = time.monotonic() - t_run
        b_blocks = d.blocks_of("d-qb")
        steps(d, lambda: finished(d, "d-qb"))
        good = own_bytes(d, "d-qb", f"{tag}-b")
        steps(d, lambda: not {f"{tag}-a", f"{tag}-b"} & set(prefill.ask("status")["holding"]))
        row = record(
            "abort with a write in flight",
            False,
            write_in_flight_at_abort=in_flight,
            released_before_ack=released_early,
            b_got_a_blocks=bool(set(a_blocks) & set(b_blocks)),
            foreign_bytes_read=int(not good),
            blocks_leaked=leaked(d),
            time_to_release_s=round(release_s, 3),
        )
        if broken:
            row["connector"] = "kvferry (broken: quarantine frees)"
        return row
    finally:
        prefill.ask("run", True)
        d.shutdown()


def case_crash(model, unsafe: bool, caplog) -> dict[str, Any]:
    p = Prefill(model, {"max_batch_bytes": 4096})
    d = decode_side(model, unsafe)
    try:
        params = p.ask("prefill", "c-1", PROMPT)
        p.ask("kill_after_batches", "c-1", 1)
        add(d, "d-c", params)
        held = released = released_alive = False
        t0 = time.monotonic()
        t_dead = None

        def done() -> bool:
            # Released: d-c's blocks back in the pool. Not its output: vLLM fails a
            # request as soon as one TP worker reports a load error (a worker that never
            # planned, its prefill gone before it connected), while another worker's
            # share is still quarantined and the blocks stay allocated.
            nonlocal held, released, released_alive, t_dead
            if t_dead is None and not p.alive():
                t_dead = time.monotonic()
            all_free = d.free_blocks() == DECODE_BLOCKS - 1
            held |= not all_free
            if held and all_free and not released:
                released, released_alive = True, p.alive()
            return released and finished(d, "d-c")

        steps(d, done)
        out = d.outputs["d-c"]
        clear = any(
            "d-c" in r.getMessage()
            and (
                "exited before its notice" in r.getMessage()
                or "cannot connect to prefill" in r.getMessage()
            )
            for r in caplog.records
        )
        read = "d-c" in d.first_read
        return record(
            "prefill killed mid-transfer",
            unsafe,
            released_while_writer_alive=released_alive,
            failed=out.finish_reason == FinishReason.ERROR,
            clear_error=clear,
            foreign_bytes_read=int(read and not own_bytes(d, "d-c", "c-1")),
            blocks_leaked=leaked(d),
            time_to_release_s=round(time.monotonic() - (t_dead or t0), 3),
        )
    finally:
        d.shutdown()
        p.close()


def case_reject(model, prefill, unsafe: bool, module: str = h.MODULE) -> dict[str, Any]:
    free0 = prefill.ask("status")["free"]
    params = prefill.ask("prefill", f"r-{unsafe}-{module[-6:]}", PROMPT)
    d = h.Side(
        model,
        "kv_consumer",
        "decode",
        {**DECODE_EXTRA, "unsafe": unsafe},
        tp=2,
        num_blocks=DECODE_BLOCKS,
        module=module,
    )
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
            "rejected before allocation",
            unsafe,
            prefill_freed_s=None if freed is None else round(freed, 3),
            blocks_leaked=free0 - prefill.ask("status")["free"],
            time_to_release_s=None if freed is None else round(freed, 3),
        )
    finally:
        d.shutdown()


def case_prefill_gone_before_plan(model, caplog, broken: bool) -> dict[str, Any]:
    """The decode knows the prefill (a first load went through), then the prefill is
    killed and a load of it arrives: connecting to its worker fails (its shared-memory
    segment is gone). That load must fail through the protocol, logged with its id; the
    engine goes on. Broken: the connect is outside any catch, as it was."""
    module = "broken_connect" if broken else h.MODULE
    p = Prefill(model)
    d = h.Side(
        model, "kv_consumer", "decode", DECODE_EXTRA, tp=2, num_blocks=DECODE_BLOCKS, module=module
    )
    try:
        add(d, "d-g1", p.ask("prefill", "g-1", PROMPT))
        steps(d, lambda: finished(d, "d-g1"))
        params = p.ask("prefill", "g-2", PROMPT)
        os.kill(p.pid, signal.SIGKILL)
        p.proc.join(10)
        add(d, "d-g2", params)
        escaped, transfer_error = "", False
        try:
            steps(d, lambda: finished(d, "d-g2"))
        except TimeoutError:
            raise
        except Exception as exc:  # out of vLLM's step: the engine would be dead
            escaped, transfer_error = f"{type(exc).__name__}: {exc}", isinstance(exc, TransferError)
        out = d.outputs.get("d-g2")
        clear = any(
            "d-g2" in r.getMessage() and "cannot connect to prefill worker" in r.getMessage()
            for r in caplog.records
        )
        row = record(
            "prefill gone before the plan",
            False,
            escaped=escaped,
            escaped_transfer_error=transfer_error,
            failed=out is not None and out.finish_reason == FinishReason.ERROR,
            clear_error=clear,
            decoded="d-g2" in d.first_read,
            blocks_leaked=None if escaped else leaked(d),
        )
        if broken:
            row["connector"] = "kvferry (broken: connect uncaught)"
        return row
    finally:
        d.shutdown()
        p.close()


def case_corrupt(model, prefill, unsafe: bool) -> dict[str, Any]:
    params = prefill.ask("prefill", f"x-{unsafe}", PROMPT)
    prefill.ask("corrupt", f"x-{unsafe}")
    d = decode_side(model, unsafe)
    try:
        add(d, "d-x", params)
        steps(d, lambda: finished(d, "d-x"))
        out = d.outputs["d-x"]
        decoded = "d-x" in d.scheduled
        steps(d, lambda: f"x-{unsafe}" not in prefill.ask("status")["holding"])
        return record(
            "corrupted bytes",
            unsafe,
            decoded=decoded,
            failed=out.finish_reason == FinishReason.ERROR,
            blocks_leaked=leaked(d),
        )
    finally:
        d.shutdown()


def case_wrong_secret(
    model, tmp_path, caplog, broken: bool, decode_module: str = "stranger"
) -> dict[str, Any]:
    """The decode holds another handshake secret than the prefill. Its own prefill, whose
    hold timeout is short: no decode can reach it to say the load failed. The decode is a
    stranger's (``decode_module``), which takes the prefill's parameters without checking
    their ticket, so that the side channel is what refuses it; kvferry's own decode
    refuses the ticket first."""
    module = "broken_handshake" if broken else h.MODULE
    p = Prefill(model, {"hold_timeout_s": 5.0}, module=module)
    other = tmp_path / "another-secret"
    other.write_text(generate_secret() + "\n")
    other.chmod(0o600)
    extra = {**DECODE_EXTRA, "secret_file": str(other)}
    decode_module = module if broken else decode_module
    d = h.Side(
        model, "kv_consumer", "decode", extra, tp=2, num_blocks=DECODE_BLOCKS, module=decode_module
    )
    try:
        free0 = p.ask("status")["free"]
        params = p.ask("prefill", "s-1", PROMPT)
        add(d, "d-s", params)
        steps(d, lambda: finished(d, "d-s"))
        out = d.outputs["d-s"]
        learned = sum(len(w._worker.owner.handshakes) for w in d.workers)
        steps(d, lambda: "s-1" not in p.ask("status")["holding"])
        status = p.ask("status")
        clear = any(
            "d-s" in r.getMessage() and "refused this engine's proof" in r.getMessage()
            for r in caplog.records
        )
        ticket_refused = any(
            "request d-s: no remote prefill: kvferry_ticket does not check" in r.getMessage()
            for r in caplog.records
        )
        row = record(
            "decode with another secret",
            False,
            failed=out.finish_reason == FinishReason.ERROR,
            clear_error=clear,
            ticket_refused=ticket_refused,
            addresses_learned=learned,
            decoded="d-s" in d.first_read,
            read_prefills_bytes="d-s" in d.first_read and own_bytes(d, "d-s", "s-1"),
            prefill_refused=status["refused"],
            blocks_leaked=leaked(d),
            prefill_blocks_leaked=free0 - status["free"],
        )
        if broken:
            row["connector"] = "kvferry (broken: side channel open)"
        return row
    finally:
        d.shutdown()
        p.close()


# ---------------------------------------------------------------------- the tests
def test_normal(model, prefill):
    row = case_normal(model, prefill, unsafe=False)
    assert not row["scheduled_before_notice"] and row["foreign_bytes_read"] == 0, row
    assert row["blocks_leaked"] == 0, row


def test_normal_broken_mode_caught(model, prefill):
    row = case_normal(model, prefill, unsafe=True)
    assert row["scheduled_before_notice"] and row["foreign_bytes_read"] == 1, row


def test_abort_waits_for_every_ack(model, prefill):
    row = case_abort(model, prefill, unsafe=False)
    assert not row["released_before_ack"] and row["foreign_bytes_read"] == 0, row
    assert row["blocks_leaked"] == 0, row


def test_abort_broken_mode_caught(model, prefill):
    row = case_abort(model, prefill, unsafe=True)
    assert row["released_before_ack"] and row["foreign_bytes_read"] == 1, row


@pytest.fixture(scope="module")
def small_batches(model):
    """A prefill that posts one block per batch: an abort finds writes in flight."""
    p = Prefill(model, {"max_batch_bytes": 4096})
    yield p
    p.close()


def test_abort_with_a_write_in_flight_holds_the_blocks(model, small_batches):
    row = case_abort_in_flight(model, small_batches, broken=False)
    assert row["write_in_flight_at_abort"], row  # else the case tests nothing
    assert not row["released_before_ack"], row
    assert row["foreign_bytes_read"] == 0 and row["blocks_leaked"] == 0, row


def test_abort_with_a_write_in_flight_broken_mode_caught(model, small_batches):
    """The broken connector (tests/vllm_connector/broken_quarantine.py) gives quarantined
    blocks back at once."""
    row = case_abort_in_flight(model, small_batches, broken=True)
    assert row["write_in_flight_at_abort"], row
    assert row["released_before_ack"], row


def test_prefill_gone_before_the_plan_fails_the_load(model, caplog):
    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    row = case_prefill_gone_before_plan(model, caplog, broken=False)
    assert not row["escaped"] and row["failed"] and row["clear_error"], row
    assert not row["decoded"] and row["blocks_leaked"] == 0, row


def test_prefill_gone_broken_mode_caught(model, caplog):
    """The broken connector (tests/vllm_connector/broken_connect.py) connects outside any
    catch: the transfer error escapes vLLM's step."""
    row = case_prefill_gone_before_plan(model, caplog, broken=True)
    assert row["escaped"] and row["escaped_transfer_error"], row


def test_prefill_killed_mid_transfer(model, caplog):
    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    row = case_crash(model, unsafe=False, caplog=caplog)
    assert not row["released_while_writer_alive"], row
    assert row["failed"] and row["clear_error"] and row["blocks_leaked"] == 0, row


def test_prefill_killed_broken_mode_caught(model, caplog):
    row = case_crash(model, unsafe=True, caplog=caplog)
    assert not row["failed"] or row["foreign_bytes_read"] or row["released_while_writer_alive"], row


def test_rejection_frees_prefill_at_once(model, prefill):
    row = case_reject(model, prefill, unsafe=False)
    assert row["prefill_freed_s"] is not None and row["prefill_freed_s"] < 2.0, row


def test_rejection_broken_mode_caught(model, prefill):
    """The broken connector (tests/vllm_connector/broken.py) forgets to tell the prefill."""
    row = case_reject(model, prefill, unsafe=False, module="broken")
    TABLE[-1]["connector"] = "kvferry (broken: prefill not told)"
    assert row["prefill_freed_s"] is None and row["blocks_leaked"] > 0, row


def test_corrupted_bytes_fail_the_load(model, prefill):
    row = case_corrupt(model, prefill, unsafe=False)
    assert row["failed"] and not row["decoded"] and row["blocks_leaked"] == 0, row


def test_corruption_broken_mode_caught(model, prefill):
    row = case_corrupt(model, prefill, unsafe=True)
    assert row["decoded"] and not row["failed"], row


def test_another_secret_is_refused_at_the_handshake(model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    row = case_wrong_secret(model, tmp_path, caplog, broken=False)
    assert row["failed"] and row["clear_error"] and not row["decoded"], row
    assert row["addresses_learned"] == 0 and row["prefill_refused"] == 2, row  # one per TP worker
    assert row["blocks_leaked"] == 0 and row["prefill_blocks_leaked"] == 0, row


def test_another_secret_is_refused_at_the_ticket(model, tmp_path, caplog):
    """kvferry's own decode of another secret: the ticket does not check, so it computes
    the prompt itself and never asks the prefill's side channel."""
    caplog.set_level(logging.INFO, logger="kvferry.vllm")
    row = case_wrong_secret(model, tmp_path, caplog, broken=False, decode_module=h.MODULE)
    assert row["ticket_refused"] and not row["failed"] and row["decoded"], row
    assert not row["read_prefills_bytes"], row
    assert row["addresses_learned"] == 0 and row["prefill_refused"] == 0, row
    assert row["blocks_leaked"] == 0 and row["prefill_blocks_leaked"] == 0, row


def test_another_secret_broken_mode_caught(model, tmp_path, caplog):
    """Both engines' side channels as they were: the decode with another secret gets the
    prefill's addresses and loads."""
    row = case_wrong_secret(model, tmp_path, caplog, broken=True)
    assert row["addresses_learned"] > 0 and row["decoded"] and not row["failed"], row


def test_zz_table():
    lines = [json.dumps(r) for r in TABLE]
    print("\n" + "\n".join(lines))
    if os.environ.get("KVFERRY_VLLM_TABLE"):
        with open(os.environ["KVFERRY_VLLM_TABLE"], "w") as f:
            f.write("\n".join(lines) + "\n")
